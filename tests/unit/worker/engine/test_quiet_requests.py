"""Quiet requests (Engine.add_request's `quiet`, what a non-streamed response asks for):
the first output and the finished one only, every token and the same text as the same
request with an output per step; the steps between make no output object at all."""
from __future__ import annotations

import asyncio

from tests.support.fake_runner import EOS, VOCAB, FakeRunner
from worker.api import RequestOutput, SamplingParams
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.sequence import Sequence

PROMPT = [5, 6, 7, 8, 9, 10]


class PositionRunner(FakeRunner):
    """Samples a function of the position: equal prompts get equal tokens."""

    def sample(self, seq: Sequence) -> int:
        return 3 + (len(seq.token_ids) * 7) % (VOCAB - 3)


def make_engine() -> Engine:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    return Engine(config, CacheConfig(block_size=4), PositionRunner(64), VOCAB, frozenset({EOS}))


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_a_quiet_request_has_its_first_output_and_its_last() -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    engine.add_request("loud", PROMPT, params)
    engine.add_request("quiet", PROMPT, params, quiet=True)
    engine.add_request("one", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), quiet=True)
    out = run(engine)
    loud = [t for o in out["loud"] for t in o.new_token_ids]
    assert len(out["loud"]) == 9
    assert [o.new_token_ids for o in out["quiet"]] == [loud[:1], loud[1:]]
    assert [o.finished for o in out["quiet"]] == [False, True]
    assert out["quiet"][-1].finish_reason == out["loud"][-1].finish_reason == "length"
    assert out["quiet"][-1].num_output_tokens == 9
    assert [o.new_token_ids for o in out["one"]] == [loud[:1]] and out["one"][0].finished


def test_logprobs_make_a_request_loud() -> None:
    """Per-token logprobs leave with each token's output: such a request is never quiet."""
    engine = make_engine()
    engine.add_request("q", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1),
                       quiet=True)
    assert len(run(engine)["q"]) == 4


def test_an_aborted_quiet_request_keeps_its_tokens() -> None:
    """The abort's output carries the tokens made since the first output (nothing lost)."""
    engine = make_engine()
    engine.add_request("q", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), quiet=True)
    outputs = [o for _ in range(5) for o in engine.step()]
    assert len(outputs) == 1  # the first token's; four more were made since
    aborted = engine.abort_request("q")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert len(outputs[0].new_token_ids + aborted.new_token_ids) == 5
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_run_into_with_text_at_end_reads_two_outputs_of_the_same_text() -> None:
    """AsyncEngine.run_into(text_at_end=True) (the batched streams' non-streamed path):
    quiet unless a stop string must be watched for; the text equals the streamed one's."""
    from worker.api import load_tokenizer
    from worker.default_model import default_model_path

    tokenizer = load_tokenizer(default_model_path())

    async def main() -> dict[str, list[RequestOutput]]:
        ae = AsyncEngine(make_engine(), tokenizer)
        seen: dict[str, list[RequestOutput]] = {"streamed": [], "at_end": [], "stop": []}
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["never in this text"])
        try:
            await asyncio.gather(
                ae.run_into(PROMPT, params, "streamed", seen["streamed"].append),
                ae.run_into(PROMPT, params, "at_end", seen["at_end"].append, text_at_end=True),
                ae.run_into(PROMPT, stop, "stop", seen["stop"].append, text_at_end=True))
        finally:
            ae.shutdown()
        return seen

    seen = asyncio.run(main())
    assert (len(seen["streamed"]), len(seen["at_end"]), len(seen["stop"])) == (12, 2, 12)
    text = "".join(o.text_delta for o in seen["streamed"])
    assert text and "".join(o.text_delta for o in seen["at_end"]) == text
    assert [t for o in seen["at_end"] for t in o.new_token_ids] == [t for o in seen["streamed"] for t in o.new_token_ids]
