"""KV kept across a tool pause on the real CPU engine (kv/retention.py): a session's second
turn, after a pause in which other requests churned through the pool, finds its first
turn's prefix cached (on the device, or moved to the host tier under pressure), and every
greedy output equals transformers' token for token. Without retention, or past the TTL,
plain LRU evicts the prefix and the turn recomputes it."""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kv.block_hash import hash_full_blocks
from router.routing.types import ReplicaReport
from worker.api import RequestOutput, SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine
from worker.serving.routing_report import build_routing_stats

if TYPE_CHECKING:
    from tests.conftest import HFReference

BLOCK = 16
VOCAB = 512
MAX_TOKENS = 6
TTL_S = 60.0

_rng = random.Random(23)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


FIRST = _tokens(5 * BLOCK + 7)  # turn 1: 5 full blocks and a partial one
TOOL_RESULT = _tokens(9)
FILLERS = [_tokens(3 * BLOCK + 5) for _ in range(4)]  # cold requests of other clients


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(model_dir: Path, ttl_s: float, num_blocks: int = 16, host_bytes: int = 0) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks, host_kv_cache_bytes=host_bytes,
                    session_kv_ttl_s=ttl_s),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    ))


def _serve(engine: Engine, requests: list[tuple[str, list[int], str | None]],
           finals: dict[str, RequestOutput]) -> dict[str, list[int]]:
    """Add every (id, prompt, session) at once, step until all finish; greedy tokens by id."""
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, session in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), session_id=session)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, hf_reference: HFReference) -> dict[str, list[int]]:
    (first,) = hf_reference("llama", [FIRST], [MAX_TOKENS])
    second_prompt = FIRST + first + TOOL_RESULT  # the client re-sends the answer and the tool result
    (second,) = hf_reference("llama", [second_prompt], [MAX_TOKENS])
    fillers = hf_reference("llama", FILLERS, [MAX_TOKENS] * len(FILLERS))
    return {"turn1": first, "turn2": second, "second_prompt": second_prompt,
            **{f"filler{i}": out for i, out in enumerate(fillers)}}


@pytest.mark.parametrize("case", ["retained", "off", "expired", "host_tier"])
def test_second_turn_after_pause_hits_retained_prefix(case: str, tiny_llama: Path,
                                                      reference: dict[str, list[int]]) -> None:
    ttl = 0.0 if case == "off" else TTL_S
    host = 64 * 8192 if case == "host_tier" else 0
    engine = _engine(tiny_llama, ttl, host_bytes=host)
    clock = FakeClock()
    if engine.kv.retention is not None:
        engine.kv.retention.clock = clock
    finals: dict[str, RequestOutput] = {}
    assert _serve(engine, [("turn1", FIRST, "s")], finals) == {"turn1": reference["turn1"]}
    if ttl:
        assert engine.kv.retention.retained_block_ids("s") == [0, 1, 2, 3, 4]  # its full blocks
        assert engine.stats().kv.retained_blocks == 5
        # The routing report: retained blocks are part of the free blocks (no headroom
        # lost), and lead the prefix hashes a capped snapshot carries.
        stats = build_routing_stats(engine, engine.stats(), engine.kv.cached_block_hashes(5), 0.0).to_dict()
        report = ReplicaReport.from_stats(stats)
        assert report is not None and report.retained_blocks == 5
        assert report.free_blocks == engine.kv.num_total_blocks
        assert report.prefix_hashes == set(hash_full_blocks(FIRST, BLOCK))
    # The tool runs; other clients' requests use the pool meanwhile.
    clock.now += TTL_S + 1 if case == "expired" else 30.0
    fillers = [(f"filler{i}", f, None) for i, f in enumerate(FILLERS)]
    if case == "host_tier":  # all at once: they need the retained blocks, which move to the host tier
        got = _serve(engine, fillers, finals)
        assert engine.kv.retention.num_pressure_evictions > 0
        # The session's blocks moved down are kept apart from the host tier's LRU.
        kept = set(engine.tiers.host._kept)
        assert kept and kept <= set(hash_full_blocks(FIRST, BLOCK)) and not engine.kv.retention.moved_down
    else:  # one after another: each fits beside the retained blocks
        got = {}
        for filler in fillers:
            got.update(_serve(engine, [filler], finals))
    assert got == {f"filler{i}": reference[f"filler{i}"] for i in range(len(FILLERS))}
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks  # retained blocks count as free
    out = _serve(engine, [("turn2", reference["second_prompt"], "s")], finals)
    assert out == {"turn2": reference["turn2"]}
    cached = finals["turn2"].num_cached_tokens
    if case in ("retained", "host_tier"):
        assert cached == 5 * BLOCK  # the whole first turn's prefix (its full blocks)
    else:
        assert cached < 5 * BLOCK
    if case == "host_tier":
        assert engine.tiers.num_loaded_blocks > 0
        engine.tiers.close()
