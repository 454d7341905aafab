"""What speculative decoding counts: per request and per engine the drafts verified and
accepted, generated tokens and usage unchanged in meaning, the routing report's growth
forecast holding each row's lookahead, and the per-replica metrics."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from router.frontend.metrics import WorkerStatsCollector
from tests.unit.worker.spec.test_spec_vs_hf import MAX_TOKENS, PROMPTS, _engine, _greedy
from worker.api import RequestOutput, SamplingParams
from worker.sequence import Sequence
from worker.serving.routing_report import build_routing_stats, decode_growth_blocks, growth_blocks

if TYPE_CHECKING:
    from tests.conftest import TinyModels

BS = 16


def _seq(prompt_len: int, max_tokens: int, num_output: int) -> Sequence:
    s = Sequence("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    s.token_ids.extend(range(num_output))
    s.num_computed_tokens = s.num_tokens - 1
    return s


def test_growth_holds_the_lookahead_within_max_tokens() -> None:
    # 40 prompt + 40 out = 80 tokens, 79 computed (5 blocks). Forecast max(30, 41) -> 81
    # tokens = 6 blocks: 1. With 8 drafts: 80 + 8 = 88 tokens = 6 blocks: still 1; with 24:
    # 104 tokens = 7 blocks: 2.
    s = _seq(40, 100, 40)
    assert growth_blocks(s, 79, 30.0, BS, 4096) == 1
    assert growth_blocks(s, 79, 30.0, BS, 4096, lookahead_tokens=8) == 1
    assert growth_blocks(s, 79, 30.0, BS, 4096, lookahead_tokens=24) == 2
    # max_tokens 48 caps it: 40 + 48 = 88 tokens = 6 blocks.
    assert growth_blocks(_seq(40, 48, 40), 79, 30.0, BS, 4096, lookahead_tokens=24) == 1
    # Summed over running and waiting sequences alike.
    assert decode_growth_blocks([s, s], [], 30.0, BS, 4096, lookahead_tokens=24) == 4


def test_engine_and_request_counts(tiny_model: TinyModels, run_engine: Callable) -> None:
    engine = _engine(tiny_model("llama"))
    indices = list(range(len(PROMPTS)))
    finals: dict[str, RequestOutput] = {}
    out = run_engine(engine, [PROMPTS[i] for i in indices], [_greedy(MAX_TOKENS[i]) for i in indices],
                     final_outputs=finals)
    stats = engine.stats()
    # Generated tokens are tokens, not rows: one per output token of every request.
    assert stats.num_generated_tokens == sum(len(t) for t in out.values()) > stats.num_steps
    drafted = sum(o.extra.get("spec_draft_tokens", 0) for o in finals.values())
    accepted = sum(o.extra.get("spec_accepted_tokens", 0) for o in finals.values())
    assert (drafted, accepted) == (stats.num_draft_tokens, stats.num_accepted_draft_tokens)
    assert 0 < accepted < drafted
    assert stats.num_verify_rows <= drafted
    for rid, o in finals.items():  # usage: every output token once
        assert o.num_output_tokens == len(out[rid])
        assert o.extra.get("spec_accepted_tokens", 0) <= o.extra.get("spec_draft_tokens", 0)
    counters = engine.scheduler.speculator.counters
    assert counters.acceptance_rate == accepted / drafted
    assert counters.tokens_per_row == (accepted + stats.num_verify_rows) / stats.num_verify_rows
    as_dict = stats.to_dict()
    assert as_dict["num_draft_tokens"] == drafted and as_dict["num_accepted_draft_tokens"] == accepted


def test_routing_report_counts_lookahead(tiny_model: TinyModels) -> None:
    on, off = _engine(tiny_model("llama"), num_tokens=16), _engine(tiny_model("llama"), spec=False)
    reports = []
    for engine in (on, off):
        engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0.0))
        for _ in range(3):
            engine.step()
        engine.output_lengths.record(3)  # a mean of 3 output tokens
        reports.append(build_routing_stats(engine, engine.stats(), [], 0.0))
    (running,) = on.scheduler.running
    # Forecast max(3, out + 1) tokens past the prompt; with 16 drafts num_tokens + 16.
    expected = growth_blocks(running, running.num_computed_tokens, 3.0, BS, on.max_model_len, lookahead_tokens=16)
    assert reports[0].decode_growth_blocks == expected
    assert reports[0].decode_growth_blocks > reports[1].decode_growth_blocks


def test_metrics_render_the_counters() -> None:
    collector = WorkerStatsCollector("m")
    collector.latest = [{"replica_id": "a", "num_draft_tokens": 10.0, "num_accepted_draft_tokens": 7.0}]
    families = {f.name: f for f in collector.collect()}
    assert families["kvserve:spec_decode_num_draft_tokens"].samples[0].value == 10.0
    assert families["kvserve:spec_decode_num_accepted_tokens"].samples[0].value == 7.0
