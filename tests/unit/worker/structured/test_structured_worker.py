"""Structured outputs in the worker: spec -> grammar, the compile cache and its thread,
the batch bitmask in the sampler (constrained and unconstrained rows together), and the
engine end to end on the embedded kvserve-tiny model (gibberish that must still parse)."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from worker.api import SamplingParams, SamplingParamsError, StructuredOutput
from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.default_model import default_model_path
from worker.engine.core import Engine
from worker.sampling.sampler import Sampler
from worker.sequence import Sequence
from worker.structured.compiler import GrammarCompiler
from worker.structured.grammar import GrammarError, check
from worker.structured.state import GrammarState
from worker.engine.build import build_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def compiler(hf_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler.for_hf_tokenizer(hf_tokenizer, len(hf_tokenizer))


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
        cache=CacheConfig(kv_cache_bytes=16 * 1024**2),
    )
    return build_engine(config)


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(SamplingParamsError):
        StructuredOutput("xml", "")


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput("json_schema", json.dumps({"type": "frobnicate"})),
        StructuredOutput("json_schema", json.dumps({"type": "object", "required": "name"})),
        StructuredOutput("json_schema", "[1, 2]"),
        StructuredOutput("regex", "(unclosed"),
        StructuredOutput("choice", "[]"),
        StructuredOutput("choice", '["a", 3]'),
        StructuredOutput("grammar", "start: undefined_rule"),
    ],
)
def test_invalid_specs_raise(so: StructuredOutput) -> None:
    with pytest.raises(GrammarError):
        check(so)


def test_valid_specs_pass() -> None:
    for so in [
        StructuredOutput("json_object"),
        StructuredOutput("json_schema", json.dumps(SCHEMA)),
        StructuredOutput("regex", r"\d+"),
        StructuredOutput("choice", '["yes", "no"]'),
        StructuredOutput("grammar", 'start: "a"+ "b"'),
        StructuredOutput("grammar", 'root ::= "x" | "y"'),  # GBNF
    ]:
        check(so)


def test_compile_cache_and_thread(compiler: GrammarCompiler) -> None:
    so = StructuredOutput("regex", "[a-c]{2,4}")
    before = compiler.num_compiles
    first = compiler.submit(so)
    second = compiler.submit(StructuredOutput("regex", "[a-c]{2,4}"))
    assert first is second and compiler.num_compiles == before + 1
    matcher = first.result(timeout=60)
    assert not matcher.is_error()

    # The compile runs on the pool's thread, not the caller's.
    seen: list[str] = []
    real = compiler._compile

    def spy(spec: StructuredOutput) -> Any:
        seen.append(threading.current_thread().name)
        return real(spec)

    compiler._compile = spy  # type: ignore[method-assign]
    try:
        compiler.submit(StructuredOutput("regex", "[x-z]+")).result(timeout=60)
    finally:
        del compiler._compile
    assert seen and seen[0].startswith("kvserve-grammar")


def test_compile_error_comes_back_through_the_future(compiler: GrammarCompiler) -> None:
    future = compiler.submit(StructuredOutput("regex", "(bad"))
    assert isinstance(future.exception(timeout=60), GrammarError)
    state = GrammarState(future)
    assert state.start() is not None


def test_sampler_masks_constrained_rows_only(compiler: GrammarCompiler, hf_tokenizer: Any) -> None:
    """One batch: a row constrained to digits, an unconstrained row, a row constrained to
    'yes'/'no'. Logits favour a letter token everywhere; the mask must move only the
    constrained rows."""
    vocab = len(hf_tokenizer)
    digit_ids = {i for i in range(vocab) if re.fullmatch(r"\d+", hf_tokenizer.decode([i]) or "")}
    letter = next(i for i in range(vocab) if hf_tokenizer.decode([i]) == "q")
    seqs = []
    for so in [StructuredOutput("regex", r"\d{1,3}"), None, StructuredOutput("choice", '["yes", "no"]')]:
        seq = Sequence("r", [5, 6], SamplingParams(temperature=0.0, structured=so))
        if so is not None:
            seq.grammar = GrammarState(compiler.submit(so))
            assert seq.grammar.start() is None
        seqs.append(seq)
    logits = torch.zeros(3, vocab)
    logits[:, letter] = 10.0
    out = Sampler(vocab, torch.device("cpu"))(logits, seqs)
    assert out.token_ids[0] in digit_ids
    assert out.token_ids[1] == letter
    assert "yes".startswith(hf_tokenizer.decode([out.token_ids[2]])) or "no".startswith(
        hf_tokenizer.decode([out.token_ids[2]])
    )


def test_bitmask_unpacking_and_when_masks_overlap(compiler: GrammarCompiler, hf_tokenizer: Any) -> None:
    """The CPU unpack (numpy) equals the device path's shift-and-mask; the mask thread
    runs only for accelerators (on CPU the sampler computes the mask inline)."""
    import numpy as np

    from worker.structured.bitmask import MaskPrefetcher, apply_bitmask, compute_bitmask

    vocab = len(hf_tokenizer)
    seqs = []
    for so in [StructuredOutput("regex", r"\d{1,3}"), None]:
        seq = Sequence("r", [5, 6], SamplingParams(temperature=0.0, structured=so))
        if so is not None:
            seq.grammar = GrammarState(compiler.submit(so))
            assert seq.grammar.start() is None
        seqs.append(seq)
    bitmask = compute_bitmask(seqs, vocab)
    assert bitmask is not None and (bitmask[1] == -1).all()
    assert np.array_equal(compute_bitmask(seqs, vocab, parallel=False), bitmask)  # the CPU device's way
    logits = torch.randn(2, vocab)
    words = torch.from_numpy(bitmask)
    allowed = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :vocab]
    assert torch.equal(apply_bitmask(logits, bitmask), logits.masked_fill(~allowed, float("-inf")))
    assert 0 < int(allowed[0].sum()) < vocab and bool(allowed[1].all())

    assert MaskPrefetcher("cpu").start(seqs, vocab) is None
    future = MaskPrefetcher("cuda").start(seqs, vocab)  # no CUDA call: a thread computes it
    assert future is not None and np.array_equal(future.result(), bitmask)
    assert MaskPrefetcher("cuda").start([seqs[1]], vocab) is None  # nothing constrained


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def test_engine_constrained_beside_unconstrained(engine: Engine, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer("Tell me about a person.")["input_ids"]
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    requests = {
        f"json-{t}-{i}": (ids, SamplingParams(max_tokens=120, temperature=t, seed=i, structured=so))
        for t in (0.0, 1.0)
        for i in range(3)
    }
    requests["free"] = (ids, SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    requests["choice"] = (ids, SamplingParams(max_tokens=10, temperature=1.0, structured=StructuredOutput("choice", '["red", "green"]')))
    results = _run(engine, requests)
    for rid, (tokens, reason) in results.items():
        text = hf_tokenizer.decode(tokens, skip_special_tokens=True)
        if rid.startswith("json"):
            assert reason == "stop", (rid, text)
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid == "choice":
            assert reason == "stop" and text in ("red", "green")
    assert not engine.compiles.seqs and not engine.seqs


def test_engine_fails_a_request_whose_grammar_does_not_compile(engine: Engine) -> None:
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "(x")))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "error" and "regex" in outs[-1].error


def test_abort_while_compiling(engine: Engine) -> None:
    future: Future[Any] = Future()  # a compile that never finishes
    engine.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "a+")))
    seq = engine.seqs["slow"]
    seq.grammar = GrammarState(future)
    out = engine.abort_request("slow")
    assert out is not None and out.finish_reason == "abort"
    assert not engine.compiles.seqs and not engine.has_unfinished()
