"""Structured outputs on a model served from a single .gguf file: the grammar compiler
must build its vocabulary from the file (through worker.api.load_tokenizer, the project's
one tokenizer loader), and the engine must then hold a real model's output to a JSON
schema, both for `response_format: json_schema` and for a named tool call.

The model is SmolLM2-135M-Instruct (Q4_1; see tests/support/real_models.py). No Ray: the
engine is stepped in this process; the ingress's part (request -> StructuredOutput) is
unit-tested elsewhere and does not depend on how the model is stored. Kept small for 2 CPU
cores: one engine, two constrained requests decoded together, a few dozen tokens each.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from worker.api import SamplingParams, StructuredOutput
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.structured.compiler import GrammarCompiler
from worker.engine.build import build_engine

pytestmark = pytest.mark.gguf

# Bounded strings and numbers: every value the grammar allows ends within MAX_TOKENS, so a
# request that parses proves the constraint, not a lucky stop.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}]
MAX_TOKENS = 48
NUM_BLOCKS, BLOCK = 32, 16


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(gguf_path), dtype="float32", device="cpu", num_threads=1),
        CacheConfig(block_size=BLOCK, num_blocks_override=NUM_BLOCKS),
        SchedulerConfig(max_num_batched_tokens=256),
    ))


def chat_prompt(tokenizer: Any, question: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tools=tools, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_compiler_for_the_gguf_file_compiles_a_schema(gguf_path: Path, tokenizer: Any) -> None:
    """The serving path's compiler (built from the model path, as build_engine builds
    it) reads the .gguf file's vocabulary."""
    compiler = GrammarCompiler.for_model_path(gguf_path, len(tokenizer))
    try:
        matcher = compiler.submit(StructuredOutput("json_schema", json.dumps(PERSON))).result(timeout=120)
        assert not matcher.is_error()
        # The compiler's vocabulary is the file's: the first token the schema allows is `{`.
        assert matcher.consume_tokens(tokenizer.encode("{", add_special_tokens=False))
    finally:
        compiler.shutdown()


def test_engine_holds_gguf_output_to_json_schema_and_named_tool_call(
    engine: Engine, tokenizer: Any, run_engine: Callable[..., dict[str, list[int]]]
) -> None:
    prompts = [
        chat_prompt(tokenizer, "Describe a person named Alice, aged 30, as JSON."),
        chat_prompt(tokenizer, "What is the weather in Oslo?", TOOLS),
    ]
    # A named tool call is held to the function's parameters schema (the ingress builds it
    # so: router tools' tool_constraint); response_format json_schema to its schema.
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                       structured=StructuredOutput("json_schema", json.dumps(PERSON))),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                       structured=StructuredOutput("json_schema", json.dumps(TOOLS[0]["function"]["parameters"]))),
    ]
    finals: dict[str, Any] = {}
    got = run_engine(engine, prompts, params, final_outputs=finals)
    values = {}
    for rid, schema in (("0", PERSON), ("1", WEATHER)):
        assert finals[rid].finish_reason == "stop", (finals[rid].finish_reason, finals[rid].error)
        values[rid] = json.loads(tokenizer.decode(got[rid], skip_special_tokens=True))
        jsonschema.validate(values[rid], schema)
    # The answers take their values from the questions: the grammar's token ids are the
    # model's own (a vocabulary from another tokenizer would still parse, as gibberish).
    assert values["0"]["name"] == "Alice" and values["1"]["city"] == "Oslo"
    assert not engine.compiles.seqs and not engine.seqs
