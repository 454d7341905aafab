"""Migration keeps a request's grammar (issue 48, finding 11): a JSON-schema stream cut
after a few tokens and resumed as router/frontend/migration.py resumes it (prompt +
generated, `num_resumed_tokens`) must give the client text that is valid JSON against the
schema. Before the fix the resumed request's grammar started again from the root, so the
continuation opened a second object and the client's text did not parse.

Runs the worker's own path: the async engine's inbox, Engine.add_request, the compile
wait, on the embedded kvserve-tiny model (its output is gibberish that must still parse)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from router.frontend.migration import Migration
from worker.api import GenerateRequest, SamplingParams, StructuredOutput
from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.default_model import default_model_path
from worker.engine.async_engine import AsyncEngine
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


class ActorDiedError(Exception):
    """Named as Ray's: the migration treats it as a dead replica."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def loop() -> Any:
    """One event loop for the module: the async engine's step loop answers on the loop it started on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def async_engine(tokenizer: Any, loop: asyncio.AbstractEventLoop) -> Any:
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
        cache=CacheConfig(kv_cache_bytes=16 * 1024**2),
    )
    engine = AsyncEngine(build_engine(config), tokenizer)
    yield engine
    engine.shutdown()


async def _stream(engine: AsyncEngine, request: GenerateRequest, migration: Migration, cut_after: int | None) -> tuple[str, str | None]:
    """The client's text from one attempt; stops reading after `cut_after` tokens (the replica died)."""
    text, reason, seen = "", None, 0
    async for out in engine.generate(request.prompt_token_ids, request.params, request.request_id,
                                     request.num_resumed_tokens):
        out = migration.observe(out)
        text += out.text_delta
        seen += len(out.new_token_ids)
        if out.finished:
            reason = out.finish_reason
        if cut_after is not None and seen >= cut_after:
            break
    return text, reason


@pytest.mark.parametrize("temperature,seed,cut_after", [(0.0, 0, 3), (0.0, 0, 9), (1.0, 1, 4), (1.0, 2, 7)])
def test_a_resumed_json_schema_stream_is_valid_json(async_engine: AsyncEngine, tokenizer: Any, loop: asyncio.AbstractEventLoop,
                                                    temperature: float, seed: int, cut_after: int) -> None:
    ids = tokenizer("Tell me about a person.")["input_ids"]
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    request = GenerateRequest(f"mig-{temperature}-{seed}-{cut_after}", ids, params)
    migration = Migration(request, max_migrations=1)

    async def run() -> tuple[str, str | None]:
        head, reason = await _stream(async_engine, request, migration, cut_after)
        assert reason is None, "the first attempt must be cut mid-stream"
        resumed = migration.next_request(ActorDiedError("replica gone"))
        assert resumed is not None and resumed.num_resumed_tokens == len(migration.generated_token_ids) >= cut_after
        tail, reason = await _stream(async_engine, resumed, migration, None)
        return head + tail, reason

    text, reason = loop.run_until_complete(run())
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == tokenizer.decode(migration.generated_token_ids, skip_special_tokens=True)


def test_a_resumed_output_outside_the_grammar_fails_the_request(async_engine: AsyncEngine, tokenizer: Any,
                                                                 loop: asyncio.AbstractEventLoop) -> None:
    """Tokens that the grammar could never have produced are refused, not continued from."""
    ids = tokenizer("Tell me about a person.")["input_ids"]
    bogus = tokenizer("hello", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=20, temperature=0.0,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    request = replace(GenerateRequest("mig-bogus", ids + bogus, params), num_resumed_tokens=len(bogus))

    async def run() -> Any:
        last = None
        async for out in async_engine.generate(request.prompt_token_ids, params, request.request_id,
                                               request.num_resumed_tokens):
            last = out
        return last

    try:
        last = loop.run_until_complete(run())
    except Exception as e:  # the engine's RequestError for a failed request
        assert "grammar" in str(e)
    else:
        assert last is not None and last.finish_reason == "error" and "grammar" in (last.error or "")


def test_a_resumed_request_asks_no_prompt_logprobs_again() -> None:
    """The first output carried the prompt logprobs; the resumed request must not send the
    earlier output back to the client as prompt entries."""
    params = SamplingParams(max_tokens=10, prompt_logprobs=2, logprobs=1)
    migration = Migration(GenerateRequest("r", [5, 6, 7], params), max_migrations=1)
    migration.generated_token_ids.extend([8, 9])
    resumed = migration.next_request(ActorDiedError("gone"))
    assert resumed is not None and resumed.params.prompt_logprobs is None and resumed.params.logprobs == 1
    assert resumed.params.max_tokens == 8 and resumed.num_resumed_tokens == 2


def test_a_disaggregated_decode_continues_the_prefill_sides_grammar(tokenizer: Any) -> None:
    """The same state carried across the prefill/decode split: the decode replica's grammar
    starts past the first token the prefill replica sampled under it (before the fix it
    started at the root, one token behind the output)."""
    from worker.engine.core import Engine

    def engine() -> Engine:
        return build_engine(EngineConfig(model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
                                         cache=CacheConfig(kv_cache_bytes=16 * 1024**2)))

    def run(e: Engine, rid: str) -> list[Any]:
        outs = []
        while e.has_unfinished():
            outs += [o for o in e.step() if o.request_id == rid]
        return outs

    prefill, decode = engine(), engine()
    ids = tokenizer("Tell me about a person.")["input_ids"]
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for seed in range(3):
        rid = f"pd-{seed}"
        prefill.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=1.0, seed=seed, structured=so), export_kv=True)
        (first,) = run(prefill, rid)
        export = first.extra["kv_export"]
        decode.add_request(rid, ids, SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=so),
                           kv_import=export)
        prefill.release_kv(rid)
        rest = run(decode, rid)
        tokens = list(first.new_token_ids) + [t for o in rest for t in o.new_token_ids]
        assert rest[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
