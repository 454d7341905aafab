"""The structured-output tokenizer is built in the background from the moment a replica is
ready, not by the first grammar request (worker/structured/compiler.py's prewarm, started
by AsyncEngine.from_config and not waited for), and the model's tokenizer is loaded once
for both the grammar and the replica. The embedded default model, on CPU."""
from __future__ import annotations

from typing import Any

import pytest

from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.default_model import default_model_path
from worker.engine.async_engine import AsyncEngine
from worker.sampling_params import StructuredOutput
from worker.structured.compiler import GrammarCompiler

VOCAB = 2048  # at least the default model's tokenizer's size
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def test_prewarm_builds_the_tokenizer_once_before_any_compile() -> None:
    compiler = GrammarCompiler.for_model_path(default_model_path(), VOCAB)
    builds: list[Any] = []
    make = compiler._make_tokenizer
    compiler._make_tokenizer = lambda: builds.append(1) or make()
    assert compiler.prewarm() is not None
    hf_tokenizer = compiler.wait_prewarmed()
    assert builds == [1] and hf_tokenizer is compiler.hf_tokenizer and hf_tokenizer is not None
    assert compiler.num_compiles == 0  # built before any grammar asked for it
    compiler.submit(StructuredOutput("json_schema", SCHEMA)).result(timeout=30)
    assert builds == [1]  # the first compile found it built
    compiler.shutdown()


def test_without_a_prewarm_there_is_nothing_to_wait_for() -> None:
    compiler = GrammarCompiler.for_model_path(default_model_path(), VOCAB)
    assert compiler.wait_prewarmed() is None and compiler.hf_tokenizer is None
    compiler.shutdown()


def test_a_failed_prewarm_is_logged_and_the_replica_loads_its_own(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    compiler = GrammarCompiler.for_model_path(tmp_path, VOCAB)  # no tokenizer files there
    compiler.prewarm()
    assert compiler.wait_prewarmed() is None
    assert "structured-output tokenizer not ready at start" in caplog.text
    compiler.shutdown()


def test_a_ready_replica_builds_the_grammar_tokenizer_from_its_own_tokenizer() -> None:
    config = EngineConfig(model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
                          cache=CacheConfig(kv_cache_bytes=16 * 1024**2))
    engine = AsyncEngine.from_config(config)
    try:
        compiler = engine.engine.compiles.compiler
        assert compiler.wait_prewarmed() is engine.tokenizer  # started at ready, from the replica's
        assert compiler._tokenizer is not None  # one tokenizer load for both
    finally:
        engine.shutdown()
