"""The engine API (AsyncEngine over the engine core) on a tiny random Llama: seeded
sampling, stop strings, abort and early exit, bad requests, a failing step, logprobs and
stats. No Ray.

Synchronisation: results are awaited through the streams. Block release after an abort
happens on the step thread after the caller's stream has ended, so it is observed by
polling `stats()` in a bounded loop of zero-length awaits (no sleeps as synchronisation).
"""
from __future__ import annotations

import asyncio
import math
import random
import string
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.async_engine import AsyncEngine
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine import Engine, RequestError
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 512  # tests/tiny_models.py; the tokenizer below has exactly this many tokens
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly the tiny model's 512 ids, <pad>/<s>/</s> = 0/1/2 as
    in the model's config (the tiny checkpoints ship no tokenizer)."""
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    corpus = [
        " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(40)) + ". "
        for _ in range(300)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    assert len(fast) == VOCAB and fast.eos_token_id == 2
    return fast


def _engine(model_dir: Path, max_num_seqs: int = 16) -> Engine:
    return Engine.from_config(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN),
        )
    )


@pytest.fixture
def engine(tiny_llama: Path) -> Engine:
    return _engine(tiny_llama)


@pytest.fixture
def async_engine(engine: Engine, tokenizer: PreTrainedTokenizerFast) -> Iterator[AsyncEngine]:
    ae = AsyncEngine(engine, tokenizer)
    yield ae
    ae.shutdown()


# -- helpers --------------------------------------------------------------------------------

def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outs)


async def _wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll a condition set by the step thread, yielding to the loop between checks."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.001)


def _all_free(ae: AsyncEngine) -> Callable[[], bool]:
    def check() -> bool:
        s = ae.stats()
        return s.kv.free_blocks == s.kv.total_blocks and s.num_running == 0 and s.num_waiting == 0

    return check


class _FailingForward:
    """Wraps the model's forward; raises on the next call once armed."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward
        self.armed = False
        self.num_failures = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.armed:
            self.armed = False
            self.num_failures += 1
            raise RuntimeError("injected forward failure")
        return self.forward(*args, **kwargs)


# -- seeded sampling --------------------------------------------------------------------------

async def test_seeded_sampling_independent_of_batch(async_engine: AsyncEngine) -> None:
    rng = random.Random(5)
    prompt_a, prompt_b = _prompt(rng, 23), _prompt(rng, 70)
    seeded = [
        ("a7", prompt_a, SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)),
        ("b11", prompt_b, SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)),
        ("a99", prompt_a, SamplingParams(max_tokens=24, temperature=0.8, seed=99, ignore_eos=True)),
    ]

    def others(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
        # Unseeded and seeded neighbours, some of which switch the batch onto the
        # top-k / top-p / min-p paths of the sampler.
        r = random.Random(seed)
        kinds = [
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.8),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=1.0, top_p=0.9),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.5, top_k=5),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.8, min_p=0.1, seed=3),
            SamplingParams(max_tokens=r.randint(1, 40), temperature=0.0),
        ]
        return [(f"o{seed}-{i}", _prompt(r, r.randint(1, 120)), p) for i, p in enumerate(kinds)]

    async def run_together(reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
        streams = [async_engine.generate(p, sp, request_id=rid) for rid, p, sp in reqs]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        return {rid: _tokens(outs) for (rid, _, _), outs in zip(reqs, results)}

    alone = {}
    for req in seeded:
        alone.update(await run_together([req]))
    assert all(len(t) == 24 for t in alone.values())
    # The seed matters (the tiny model's distribution is close to uniform).
    assert alone["a7"] != alone["a99"]

    batched = await run_together(seeded + others(1))
    reordered = await run_together(others(2)[::-1] + seeded[::-1])
    for rid, _, _ in seeded:
        assert batched[rid] == alone[rid], rid
        assert reordered[rid] == alone[rid], rid
    await _wait_until(_all_free(async_engine), "all blocks free")


# -- stop strings --------------------------------------------------------------------------------

def _pick_stop_string(text: str) -> str:
    """A 3-character ASCII stop string that first occurs a little way into `text`."""
    allowed = set(string.ascii_letters + " ")
    for i in range(4, len(text) - 3):
        s = text[i : i + 3]
        if set(s) <= allowed and s.strip() and text.find(s) == i:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include_stop", [False, True])
async def test_stop_string_ends_request(
    async_engine: AsyncEngine, tokenizer: PreTrainedTokenizerFast, include_stop: bool
) -> None:
    prompt = tokenizer.encode("ba ce di fo gu ha je ki lo mu")
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    full = await _collect(async_engine.generate(prompt, greedy))
    full_text = _text(full)
    assert full_text == tokenizer.decode(_tokens(full), skip_special_tokens=True)
    assert full[-1].finish_reason == "length"

    stop = _pick_stop_string(full_text)
    params = SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=include_stop
    )
    outs = await _collect(async_engine.generate(prompt, params))
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == stop
    assert all(not o.finished for o in outs[:-1])
    end = full_text.index(stop) + (len(stop) if include_stop else 0)
    assert _text(outs) == full_text[:end]
    assert _tokens(outs) == _tokens(full)[: len(_tokens(outs))]
    assert len(_tokens(outs)) < 48
    # The core does not know stop strings: the stream's end aborts it there.
    await _wait_until(_all_free(async_engine), "stopped request's blocks freed")


# -- abort and leaving early -----------------------------------------------------------------------

async def test_abort_frees_blocks_and_ends_stream(async_engine: AsyncEngine) -> None:
    prompt = _prompt(random.Random(1), 40)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = async_engine.generate(prompt, params, request_id="victim")
    outs = [await anext(stream), await anext(stream)]
    assert async_engine.stats().kv.free_blocks < async_engine.stats().kv.total_blocks
    # The step in flight may still finish; the abort is applied right after it.
    num_generated_at_abort = async_engine.engine.num_generated_tokens
    async_engine.abort("victim")
    outs += [out async for out in stream]
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort"
    assert not any(o.finished for o in outs[:-1])
    assert last.num_output_tokens == len(_tokens(outs)) < 200
    assert last.num_output_tokens <= num_generated_at_abort + 2
    # Freed before the abort output was even sent; stats() catches up one loop later.
    await _wait_until(_all_free(async_engine), "aborted request's blocks freed")
    assert async_engine.engine.seqs == {}
    async_engine.abort("victim")  # aborting again (or an unknown id) is a no-op
    async_engine.abort("never-existed")
    # And the engine keeps serving.
    again = await _collect(async_engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0)))
    assert again[-1].finish_reason == "length" and len(_tokens(again)) == 5


@pytest.mark.parametrize("how", ["aclose", "cancel", "drop"])
async def test_leaving_stream_early_aborts(async_engine: AsyncEngine, how: str) -> None:
    prompt = _prompt(random.Random(2), 30)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    got_first = asyncio.Event()

    async def consume(stream: AsyncIterator[RequestOutput]) -> None:
        async for _ in stream:
            got_first.set()

    if how == "aclose":
        stream = async_engine.generate(prompt, params, request_id="leaver")
        await anext(stream)
        await stream.aclose()
    elif how == "cancel":
        task = asyncio.create_task(consume(async_engine.generate(prompt, params, request_id="leaver")))
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:  # break out of `async for` and drop the generator: the loop's finaliser closes it
        stream = async_engine.generate(prompt, params, request_id="leaver")
        async for _ in stream:
            break
        del stream

    await _wait_until(_all_free(async_engine), f"blocks freed after {how}")
    await _wait_until(lambda: "leaver" not in async_engine.engine.seqs, "request removed")
    assert async_engine.stats().num_generated_tokens < 200
    # The id can be used again, and the engine serves it normally.
    outs = await _collect(async_engine.generate(prompt, SamplingParams(max_tokens=3), request_id="leaver"))
    assert outs[-1].finish_reason == "length"


# -- bad requests ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=3.0), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(logprobs=10_000), "logprobs"),
        (dict(stop=("",)), "stop"),
        (dict(stop=tuple(str(i) for i in range(1000))), "stop"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


async def test_invalid_requests_rejected_engine_keeps_serving(async_engine: AsyncEngine) -> None:
    ok = SamplingParams(max_tokens=4, temperature=0.0)
    bad_requests = [
        ([5] * MAX_MODEL_LEN, ok, "max_model_len"),
        ([5] * (MAX_MODEL_LEN + 100), ok, "max_model_len"),
        ([], ok, "empty"),
        ([5, VOCAB], ok, "prompt token ids"),
        ([5, -1], ok, "prompt token ids"),
        ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=(VOCAB + 3,)), "stop_token_ids"),
    ]
    for prompt, params, match in bad_requests:
        with pytest.raises(RequestError, match=match):
            await anext(async_engine.generate(prompt, params))

    # A request id already streaming is refused; the first request is unaffected.
    first = async_engine.generate([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0), request_id="dup")
    head = await anext(first)
    with pytest.raises(RequestError, match="already in use"):
        await anext(async_engine.generate([7, 8], ok, request_id="dup"))
    rest = await _collect(first)
    assert rest[-1].finish_reason == "length" and len(_tokens([head, *rest])) == 20

    # The longest prompt that fits is served, and so is the next ordinary request.
    longest = await _collect(async_engine.generate([5] * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=8)))
    assert longest[-1].finish_reason == "length" and len(_tokens(longest)) == 1  # max_model_len
    normal = await _collect(async_engine.generate([11, 12, 13], ok))
    assert normal[-1].finish_reason == "length" and len(_tokens(normal)) == 4
    assert async_engine.is_alive
    await _wait_until(_all_free(async_engine), "all blocks free")


def test_sync_engine_rejects_bad_requests(engine: Engine, run_engine: Callable) -> None:
    ok = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("long", [5] * MAX_MODEL_LEN, ok)
    engine.add_request("x", [5, 6], ok)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("x", [5, 6], ok)
    assert engine.abort_request("x").finish_reason == "abort"
    assert engine.abort_request("x") is None
    assert len(run_engine(engine, [[5, 6]], ok, request_ids=["y"])["y"]) == 3


# -- a failing step ---------------------------------------------------------------------------------

async def test_failing_step_fails_only_in_flight_requests(
    async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(3)
    victims = [_prompt(rng, 20), _prompt(rng, 50)]
    survivor = _prompt(rng, 30)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = _tokens(await _collect(async_engine.generate(survivor, greedy)))

    model = async_engine.engine.runner.model
    failing = _FailingForward(model.forward)
    monkeypatch.setattr(model, "forward", failing)

    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    streams = [async_engine.generate(p, long) for p in victims]
    heads = [await anext(s) for s in streams]  # both are running now
    failing.armed = True
    results = [[h, *await _collect(s)] for h, s in zip(heads, streams)]
    assert failing.num_failures == 1
    for outs in results:
        last = outs[-1]
        assert last.finished and last.finish_reason == "error"
        assert last.error and "injected forward failure" in last.error
        assert len(_tokens(outs)) < 200
    await _wait_until(_all_free(async_engine), "failed requests' blocks freed")

    assert async_engine.is_alive
    after = await _collect(async_engine.generate(survivor, greedy))
    assert _tokens(after) == expected and after[-1].finish_reason == "length"


def test_failing_step_spares_waiting_requests(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, run_engine: Callable
) -> None:
    engine = _engine(tiny_llama, max_num_seqs=2)  # the third request has to wait
    rng = random.Random(4)
    prompts = [_prompt(rng, 20), _prompt(rng, 33), _prompt(rng, 17)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = run_engine(engine, prompts[2:], greedy, request_ids=["ref"])["ref"]

    failing = _FailingForward(engine.runner.model.forward)
    monkeypatch.setattr(engine.runner.model, "forward", failing)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    first = engine.step()
    assert sorted(o.request_id for o in first) == ["0", "1"]
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 1
    failing.armed = True
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["0", "1"]
    assert all(o.finished and o.finish_reason == "error" and o.error for o in failed)
    assert set(engine.seqs) == {"2"}
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "2" and out.finish_reason != "error"
            tokens += out.new_token_ids
    assert tokens == expected
    stats = engine.stats()
    assert stats.kv.free_blocks == stats.kv.total_blocks


# -- logprobs ---------------------------------------------------------------------------------------

async def test_logprobs(async_engine: AsyncEngine, tiny_llama: Path) -> None:
    rng = random.Random(6)
    prompt = _prompt(rng, 25)
    requests = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=5),
        SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
        SamplingParams(max_tokens=6, temperature=0.0),
    ]
    results = await asyncio.gather(*(_collect(async_engine.generate(prompt, p)) for p in requests))

    for params, outs in zip(requests, results):
        for out in outs:
            if params.logprobs is None:
                assert out.logprobs is None
                continue
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids) == 1
            lp = out.logprobs[0]
            assert lp.token_id == out.new_token_ids[0]
            assert lp.logprob <= 0.0 and math.isfinite(lp.logprob)
            assert len(lp.top) == params.logprobs
            values = [v for _, v in lp.top]
            assert all(v <= 0.0 for v in values) and values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
            assert len({t for t, _ in lp.top}) == len(lp.top)
            if params.logprobs:
                assert lp.logprob <= values[0] + 1e-6
            if params.greedy and params.logprobs:
                assert lp.top[0][0] == lp.token_id
                assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)

    # The first token's top-5 agree with transformers' log-softmax over the prompt.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    values, ids = ref.topk(5)
    top = results[0][0].logprobs[0].top
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


# -- stats ---------------------------------------------------------------------------------------------

def test_stats_sync_engine(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_num_seqs=1)
    s0 = engine.stats()
    assert s0.kv.total_blocks == s0.kv.free_blocks == NUM_BLOCKS and s0.kv.block_size == 16
    assert s0.num_running == s0.num_waiting == s0.num_steps == s0.num_generated_tokens == 0
    assert s0.kv.usage == 0.0 and s0.tokens_per_s == 0.0 and s0.forward_share == 0.0

    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), greedy)  # 37 tokens: 3 blocks
    engine.add_request("b", list(range(100, 120)), greedy)  # waits (max_num_seqs=1)
    engine.step()
    s1 = engine.stats()
    assert s1.num_running == 1 and s1.num_waiting == 1 and s1.num_waiting_prompt_tokens == 20
    assert s1.kv.free_blocks == NUM_BLOCKS - 3 and 0.0 < s1.kv.usage < 1.0
    assert s1.num_steps == 1 and s1.num_generated_tokens == 1
    while engine.has_unfinished():
        engine.step()
    s2 = engine.stats()
    assert s2.num_running == s2.num_waiting == s2.num_waiting_prompt_tokens == 0
    assert s2.kv.free_blocks == NUM_BLOCKS and s2.kv.usage == 0.0
    assert s2.num_generated_tokens == 10 and s2.num_steps == 10
    assert s2.tokens_per_s > 0.0 and 0.0 < s2.forward_share <= 1.0
    assert s2.kv.prefix_cache_queries == 37 + 20 and s2.kv.prefix_cache_hits == 0
    assert s2.kv.num_cached_blocks > 0  # the finished requests' full blocks stay cached
    d = s2.to_dict()
    for key in ("total_blocks", "free_blocks", "kv_usage", "num_running", "num_waiting",
                "num_preemptions", "num_generated_tokens", "tokens_per_s", "prefix_cache_hits"):
        assert key in d
    assert "kv" not in d and d["free_blocks"] == NUM_BLOCKS


async def test_stats_async_engine(async_engine: AsyncEngine) -> None:
    rng = random.Random(8)
    requests = [(_prompt(rng, rng.randint(1, 60)), rng.randint(1, 20)) for _ in range(6)]
    results = await asyncio.gather(*(
        _collect(async_engine.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
        for p, n in requests
    ))
    assert [len(_tokens(outs)) for outs in results] == [n for _, n in requests]
    for (p, n), outs in zip(requests, results):
        last = outs[-1]
        assert last.num_prompt_tokens == len(p) and last.num_output_tokens == n
        assert last.first_token_time is not None and last.first_token_time >= last.arrival_time
    # The snapshot after the last step shows an empty, idle engine.
    await _wait_until(_all_free(async_engine), "idle")
    s = async_engine.stats()
    assert s.num_generated_tokens == sum(n for _, n in requests)
    assert 0 < s.num_steps <= s.num_generated_tokens
    assert s.num_preemptions == 0 and s.kv.usage == 0.0
    assert s.tokens_per_s >= 0.0 and 0.0 < s.forward_share <= 1.0
