"""The ingress side of disaggregation (router/frontend/disagg.py) with fake worker handles, and the
two-pool application build (no Ray cluster is started)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.app import DECODE_DEPLOYMENT, POLICY_ROUTER, PREFILL_DEPLOYMENT, build_app  # noqa: E402
from cluster.config import ConfigError, KVServeConfig  # noqa: E402
from kv.transfer import KVHandle  # noqa: E402
from router import errors  # noqa: E402
from router.frontend.disagg import DisaggregatedGenerate  # noqa: E402
from worker.api import GenerateRequest, RequestOutput, SamplingParams  # noqa: E402


class _Response:
    def __init__(self, result: Any = None, stream: list[Any] | None = None, gate: asyncio.Event | None = None) -> None:
        self._result, self._stream, self._gate = result, stream or [], gate
        self.cancelled = False

    def __await__(self):  # noqa: ANN204
        async def get() -> Any:
            if self._gate is not None:
                await self._gate.wait()
            return self._result

        return get().__await__()

    def __aiter__(self):  # noqa: ANN204
        async def gen():  # noqa: ANN202
            for item in self._stream:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return gen()

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, handle: _Handle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args: Any, **kwargs: Any) -> _Response:
        self.handle.calls.append((self.name, args, kwargs))
        return self.handle.responder(self.name, args, kwargs)


class _Handle:
    def __init__(self, responder: Any) -> None:
        self.responder = responder
        self.calls: list[tuple[str, tuple, dict]] = []

    def options(self, **_: Any) -> _Handle:
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


def _out(tokens: list[int], finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r-0", tokens, finished=finished, finish_reason=reason)


REQUEST = GenerateRequest("r-0", [5, 6, 7], SamplingParams(max_tokens=3))
HANDLE = KVHandle("r-0", "local", object(), 3, 100, "replica-A")


DECODE_REPLICA = "replica-D"


def _decode_pool(decoded: list[Any]) -> _Handle:
    """A decode pool speaking the batched protocol (router/frontend/output_hub.py): the
    request's own call answers with the replica's id; its outputs come on that replica's
    `outputs` stream, one list per step (an exception there: the replica died)."""
    def respond(name: str, args: tuple, kwargs: dict) -> _Response:
        if name in ("decode", "generate"):
            return _Response(stream=[DECODE_REPLICA])
        assert name == "outputs" and kwargs == {"replica_id": DECODE_REPLICA}, (name, kwargs)
        return _Response(stream=[item if isinstance(item, BaseException) else [item] for item in decoded])

    return _Handle(respond)


def _pools(first: RequestOutput, handle: KVHandle | None, decoded: list[Any], gate: asyncio.Event | None = None):  # noqa: ANN202
    prefill = _Handle(lambda name, a, k: _Response(result=(first, handle), gate=gate) if name == "prefill" else _Response())
    return prefill, _decode_pool(decoded)


async def _collect(gen: DisaggregatedGenerate, request: GenerateRequest = REQUEST) -> list[RequestOutput]:
    outs = [out async for out in gen.generate.remote(request)]
    await asyncio.sleep(0)  # let the fire-and-forget ack run
    await asyncio.sleep(0)
    return outs


def test_prefill_then_decode_then_ack_to_the_pinning_replica() -> None:
    prefill, decode = _pools(_out([11]), HANDLE, [_out([12]), _out([13], True, "length")])
    gen = DisaggregatedGenerate(prefill, decode)
    outs = asyncio.run(_collect(gen))
    assert [o.new_token_ids for o in outs] == [[11], [12], [13]]
    assert [c[0] for c in prefill.calls] == ["prefill", "release_kv"]
    assert prefill.calls[1][1] == ("r-0",) and prefill.calls[1][2] == {"replica_id": "replica-A"}
    # The decode half went out on the decode pool's batched stream.
    (name, args, kwargs), (outputs, _, _) = decode.calls
    assert (name, args[0].request_id, args[0].output_stream, args[1], kwargs) == (
        "decode", "r-0", gen.decode.stream_id, HANDLE, {})
    assert outputs == "outputs"
    assert gen.queue.num_waiting == 0


def test_a_request_that_ends_at_its_first_token_never_decodes() -> None:
    prefill, decode = _pools(_out([2], True, "stop"), None, [])
    gen = DisaggregatedGenerate(prefill, decode)
    outs = asyncio.run(_collect(gen))
    assert [o.finish_reason for o in outs] == ["stop"] and not decode.calls
    assert [c[0] for c in prefill.calls] == ["prefill"] and gen.queue.num_waiting == 0


def test_decode_failure_still_releases_the_prefill_copy() -> None:
    prefill, decode = _pools(_out([11]), HANDLE, [RuntimeError("decode replica died")])
    gen = DisaggregatedGenerate(prefill, decode)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="died"):
            await _collect(gen)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [c[0] for c in prefill.calls] == ["prefill", "release_kv"] and gen.queue.num_waiting == 0


def test_the_wait_queue_is_bounded_with_429_and_cancel_releases() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        prefill, decode = _pools(_out([11]), HANDLE, [_out([12], True, "length")], gate)
        gen = DisaggregatedGenerate(prefill, decode, max_waiting_for_decode=1)
        first = gen.generate.remote(REQUEST)
        it = first.__aiter__()
        task = asyncio.create_task(it.__anext__())
        await asyncio.sleep(0)
        assert gen.queue.num_waiting == 1
        with pytest.raises(errors.APIError) as info:
            await gen.generate.remote(REQUEST).__aiter__().__anext__()
        assert info.value.status == 429
        gate.set()
        assert (await task).new_token_ids == [11]
        first.cancel()  # the client went away after its first token
        await asyncio.sleep(0)
        assert gen.queue.num_waiting == 0
        assert [c[0] for c in prefill.calls] == ["prefill", "release_kv"]
        # Both calls cancelled: the prefill's, and the decode half's own call.
        assert all(getattr(r, "_call", r).cancelled for r in first._calls)
        await it.aclose()

    asyncio.run(main())


def test_a_migrated_request_goes_to_the_decode_pool_as_a_plain_generate() -> None:
    prefill, decode = _pools(_out([11]), HANDLE, [_out([14], True, "length")])
    gen = DisaggregatedGenerate(prefill, decode)
    migrated = GenerateRequest("r-0", [5, 6, 7, 11], SamplingParams(max_tokens=2), num_resumed_tokens=1)
    outs = asyncio.run(_collect(gen, migrated))
    assert [o.new_token_ids for o in outs] == [[14]] and not prefill.calls
    assert [c[0] for c in decode.calls] == ["generate", "outputs"]  # batched, as a mixed pool's


# -- the application ---------------------------------------------------------------------------
def test_disaggregated_app_has_two_pools_and_the_prefill_router() -> None:
    config = KVServeConfig.from_dict({
        "model": {"path": "/models/x", "served_model_name": "x"},
        "engine": {"device": "cpu"},
        "disaggregation": {
            "prefill": {"num_replicas": 2, "num_cpus": 0.5},
            "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "role": "decode"}},
            "max_waiting_for_decode": 7,
        },
    })
    app = build_app(config)
    ingress = app._bound_deployment
    prefill_app = ingress.init_kwargs["prefill_worker"]
    decode_app = ingress.init_args[0]
    assert ingress.init_kwargs["max_waiting_for_decode"] == 7
    prefill_dep, decode_dep = prefill_app._bound_deployment, decode_app._bound_deployment
    assert (prefill_dep.name, decode_dep.name) == (PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT)
    assert prefill_dep.num_replicas == 2
    assert decode_dep._deployment_config.autoscaling_config.max_replicas == 3
    prefill_router = prefill_dep._deployment_config.request_router_config
    decode_router = decode_dep._deployment_config.request_router_config
    assert prefill_router.request_router_class == decode_router.request_router_class == POLICY_ROUTER
    assert prefill_router.request_router_kwargs == decode_router.request_router_kwargs


def test_disaggregation_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="disaggregation.prefill.num_replicas"):
        KVServeConfig.from_dict({"disaggregation": {"prefill": {"num_replicas": 0}}})
    with pytest.raises(ConfigError, match="did you mean 'decode'"):
        KVServeConfig.from_dict({"disaggregation": {"decod": {}}})
