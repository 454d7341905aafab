"""Grammar compiles cannot stall a server (issue 30, "Exposure and limits"): the ingress
checks constraints off its event loop, a worker fails a request whose grammar has not
compiled within the time limit (and keeps serving), and a schema nested past the
recursion limit is a 400, not a 500."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from router.frontend.auth import Principal
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress
from tests.unit.router.frontend.test_pipeline import inputs
from worker.api import SamplingParams, SamplingParamsError, StructuredOutput, check_structured_output
from worker.config import CacheConfig, EngineConfig, ModelConfig
from worker.default_model import default_model_path
from worker.structured.compiler import GrammarCompiler
from worker.structured.state import GrammarState
from worker.engine.build import build_engine


async def test_constrained_requests_convert_off_the_event_loop() -> None:
    # Finding: a constrained request's schema was compiled (checked) on the ingress's event
    # loop whenever its body was small, stalling every other request meanwhile.
    fake = FakeIngress(max_queued_requests=4)
    threads: list[int] = []
    build = inputs(4, 1)

    def to_inputs(max_model_len: int) -> Any:
        threads.append(threading.get_ident())
        return build(max_model_len)

    stream = await fake.pipeline.start(Principal("k"), 1, 10, to_inputs, "r", 0.0, offload=True)
    [e async for e in stream]
    assert threads and threads[0] != threading.get_ident()


def test_a_schema_nested_past_the_recursion_limit_is_refused() -> None:
    # Finding: RecursionError in the schema check escaped as a 500.
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SamplingParamsError, match="nested"):
        check_structured_output(StructuredOutput("json_schema", json.dumps(schema)))


def test_a_grammar_past_its_deadline_fails_its_request() -> None:
    never: Future[Any] = Future()
    late = GrammarState(never, deadline=time.monotonic() - 1.0)
    assert late.ready and "did not compile within" in (late.start() or "")
    assert not GrammarState(never, deadline=time.monotonic() + 60.0).ready


def test_the_engine_fails_a_stuck_compile_and_keeps_serving() -> None:
    # Finding: compiles had no time limit: a grammar that never finished compiling held its
    # request (and, on a one-thread pool, every later constrained request) forever.
    release = threading.Event()
    config = EngineConfig(
        model=ModelConfig(model=str(default_model_path()), device="cpu", num_threads=1),
        cache=CacheConfig(kv_cache_bytes=16 * 1024**2),
    )
    engine = build_engine(config)

    def stuck_tokenizer() -> Any:
        release.wait(30)  # the compile pool's first job builds the tokenizer: it hangs here
        raise RuntimeError("released")

    engine.compiles.compiler = GrammarCompiler(stuck_tokenizer, compile_timeout_s=0.2)
    try:
        so = StructuredOutput("regex", "[ab]+")
        engine.add_request("stuck", [1, 5, 6], SamplingParams(max_tokens=4, temperature=0.0, structured=so))
        engine.add_request("plain", [1, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
        finished: dict[str, Any] = {}
        deadline = time.monotonic() + 20
        while engine.has_unfinished() and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == {"stuck", "plain"}
        assert finished["stuck"].error is not None and "did not compile within" in str(finished["stuck"].error)
        assert finished["plain"].error is None and finished["plain"].finish_reason == "length"
    finally:
        release.set()
        engine.compiles.compiler.shutdown()
