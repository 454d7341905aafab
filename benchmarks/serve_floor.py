"""The floor under the Serve path: a bare Ray Serve app with kvserve's hops and device,
and nothing else (benchmarks/hostpath.py --serve-floor runs it beside kvserve's app).

What any engine served on Ray Serve pays at least, per request and per streamed chunk, on
the same machine, in the same run:

    front door (HAProxy, or Serve's HTTP proxy) -> ingress (FastAPI: read the JSON body,
    one streaming handle call, write the response) -> worker (one async generator per
    request)

The worker has no engine: a shared loop stands in for the device, planning each step as
kvserve's scheduler would at its defaults (a decode per running request, prompt chunks in
the rest of the token budget), pricing it with kvserve's own step-cost model (sim:h200,
llama-3-8b: the device the hostpath app simulates) and sleeping that long at time
dilation 1, so the load's concurrency, pacing and device time match kvserve's. Each request's call yields what Serve apps usually send, one item
per chunk on its own stream: a streamed request a chunk per `stream_interval_s` (its
first token and its end at once, as kvserve paces them), a non-streamed one a single
item at the end. No tokenizer, no scheduler, no KV cache, no routing policy, no
admission, metrics or tracing: what kvserve's app costs above this floor is its own.

The deployments carry the names and resources of kvserve's app (`ingress`, `worker`,
0.1 CPU each), so benchmarks/hostpath_serve.py measures their CPU the same way, and the
worker reports `modelled_device_s` as kvserve's worker does.
"""
# No `from __future__ import annotations` here: FastAPI reads the route's `Request`
# annotation from the method Serve wraps, where a string annotation does not resolve.
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

STREAM_INTERVAL_S = 0.05  # kvserve's default workers.stream_interval_ms
MAX_ONGOING = 1024


@dataclass
class _Active:
    """One request on the stand-in device: its prompt, how much of it is computed, and the
    tokens it has and still wants."""

    max_tokens: int
    prompt_len: int
    computed: int = 0  # prompt tokens computed (chunked prefill)
    produced: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class _Device:
    """A shared step loop with kvserve's default budget (SchedulerConfig: max_num_seqs,
    max_num_batched_tokens): every running request decodes one token, and the rest of the
    budget takes prompt chunks in arrival order (a prompt's last chunk samples its first
    token). Each step is priced by kvserve's cost model for the rows it holds."""

    def __init__(self) -> None:
        from worker.config import SchedulerConfig
        from worker.costs.cost_model import StepCostModel
        from worker.costs.profiles import load_profile
        from worker.costs.shapes import load_shape

        self.cost = StepCostModel(load_shape("llama-3-8b"), load_profile("h200"))
        limits = SchedulerConfig()
        self.max_num_seqs, self.token_budget = limits.max_num_seqs, limits.max_num_batched_tokens
        self.active: list[_Active] = []
        self.modelled_s = 0.0
        self._loop_task: asyncio.Task[None] | None = None

    def add(self, request: _Active) -> None:
        self.active.append(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _plan(self) -> list[tuple[_Active, int]]:
        """(request, new tokens) for the next step: decodes first, then prompt chunks."""
        running = [r for r in self.active if r.computed == r.prompt_len][: self.max_num_seqs]
        plan = [(r, 1) for r in running]
        budget = self.token_budget - len(plan)
        for r in self.active:
            if budget <= 0 or len(plan) >= self.max_num_seqs:
                break
            if r.computed < r.prompt_len:
                n = min(r.prompt_len - r.computed, budget)
                plan.append((r, n))
                budget -= n
        return plan

    async def _run(self) -> None:
        while self.active:
            plan = self._plan()
            rows = [(n, r.computed + r.produced, r.computed + n >= r.prompt_len) for r, n in plan]
            step_s = self.cost.predict_rows(rows)
            await asyncio.sleep(step_s)
            self.modelled_s += step_s
            for r, n in plan:
                if r.computed < r.prompt_len:
                    r.computed += n
                    if r.computed < r.prompt_len:
                        continue  # a chunk that does not end the prompt samples nothing
                r.produced += 1
                r.wake.set()
            self.active = [r for r in self.active if r.produced < r.max_tokens]


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=MAX_ONGOING)
class FloorWorker:
    def __init__(self) -> None:
        self.device = _Device()

    async def generate(self, max_tokens: int, prompt_len: int, stream: bool) -> AsyncIterator[int]:
        """Yields token counts: per chunk when streamed, once at the end when not."""
        request = _Active(max_tokens, prompt_len)
        self.device.add(request)
        sent, last_sent = 0, -float("inf")
        while sent < max_tokens:
            await request.wake.wait()
            request.wake.clear()
            produced = request.produced
            now = time.monotonic()
            first_or_last = sent == 0 or produced >= max_tokens
            if stream and (first_or_last or now - last_sent >= STREAM_INTERVAL_S):
                yield produced - sent
                sent, last_sent = produced, now
            elif not stream and produced >= max_tokens:
                yield produced
                sent = produced

    async def stats(self) -> dict[str, float]:
        return {"modelled_device_s": self.device.modelled_s}


_app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=MAX_ONGOING, name="ingress")
@serve.ingress(_app)
class FloorIngress:
    def __init__(self, worker: Any) -> None:
        self.worker = worker

    @_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        body = await request.json()
        prompt = body["prompt"]
        call = self.worker.options(stream=True).generate.remote(
            int(body["max_tokens"]), len(prompt) if isinstance(prompt, list) else 1, bool(body.get("stream")))
        if not body.get("stream"):
            tokens = 0
            async for n in call:
                tokens += n
            return JSONResponse({"object": "text_completion", "usage": {"completion_tokens": tokens}})

        async def events() -> AsyncIterator[str]:
            tokens = 0
            async for n in call:
                tokens += n
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x" * n}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'object': 'text_completion', 'usage': {'completion_tokens': tokens}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def build_floor_app() -> Any:
    """The bare app, bound: `serve.run(build_floor_app(), name=..., route_prefix=...)`."""
    return FloorIngress.bind(FloorWorker.options(name="worker").bind())
