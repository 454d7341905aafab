"""KV-headroom routing through real Ray Serve replicas (a fake engine, tests/integration/fake_worker.py).

Calls go through a DeploymentHandle made in this driver process, so the router instance
(router.routing.serve_router.PolicyRouter, built by Serve from the deployment's
RequestRouterConfig) runs here, on the handle's router thread; the tests read its view
(`routing_view()`) to wait for conditions instead of sleeping.
"""
from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import ray
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from kv.block_hash import hash_full_blocks  # noqa: E402
from tests.integration.fake_worker import CONTROL_NAMESPACE, FakeControl, FakeWorker  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from router.serve_internals import request_router_of  # noqa: E402
from worker.api import GenerateRequest, SamplingParams  # noqa: E402

# A test that hangs (a stream that never ends) fails on its own instead of eating the session.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROUTER_CLASS = "router.routing.serve_router:PolicyRouter"
STATS_PERIOD_S = 0.5
BLOCK_SIZE = 16
WAIT_S = 60.0  # every wait below (tests/integration/waiting.py)
POLL_S = 0.02  # the router's view changes within a stats period (0.5 s): poll often

@dataclass
class Fleet:
    app_name: str
    handle: Any  # DeploymentHandle
    control: Any  # ActorHandle[FakeControl]
    num_replicas: int

    @property
    def router(self) -> Any:
        # The handle's request router in this process (Serve internals, through their
        # adapter). Initialised by the handle's first call.
        return request_router_of(self.handle)

    def view(self) -> dict[str, dict[str, Any]]:
        return self.router.routing_view()

    def ordinal_of(self) -> dict[str, int]:
        return {rid: o for o, rid in ray.get(self.control.replica_ids.remote()).items()}

    def set_state(self, ordinal: int, **state: Any) -> int:
        return ray.get(self.control.set_state.remote(ordinal, **state))

    def wait_seen(self, version: int) -> dict[str, dict[str, Any]]:
        """Until the router holds a report built from control state >= version from every replica."""

        def seen() -> dict[str, dict[str, Any]] | None:
            view = self.view()
            if len(view) == self.num_replicas and all(v["stats"].get("version", -1) >= version for v in view.values()):
                return view
            return None

        return wait_until(
            seen, WAIT_S, POLL_S, message=f"the router to see state version {version} from {self.num_replicas} replicas"
        )

    def wait_idle(self) -> None:
        """Until this router has no outstanding request (every completion hook fired)."""
        wait_until(
            lambda: all(v["outstanding"] == 0 for v in self.view().values()), WAIT_S, POLL_S,
            message="all requests to complete",
        )

    def reset(self) -> None:
        ray.get(self.control.release.remote())
        self.wait_idle()
        version = 0
        for ordinal in range(self.num_replicas):
            version = self.set_state(ordinal, free_blocks=1000, total_blocks=1000, prefix_hashes=[], num_waiting=0, freeze_stats=False)
        wait_until(
            lambda: not ray.get(self.control.frozen.remote()), WAIT_S, POLL_S,
            message="replicas to unfreeze their stats",
        )
        self.wait_seen(version)

    def start(self, request: GenerateRequest) -> Any:
        return self.handle.options(stream=True).generate.remote(request)


def make_request(prompt: list[int], *, max_tokens: int = 8, hold: bool = False) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, extra={"hold": True} if hold else {})
    return GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params)


def first_items(streams: list[Any]) -> list[dict[str, Any]]:
    """The first item of every stream: where it landed (the replica yields it on arrival)."""
    return [next(stream) for stream in streams]


def drain(streams: list[Any]) -> None:
    for stream in streams:
        for _ in stream:
            pass


def deploy(app_name: str, num_replicas: int, **router_kwargs: Any) -> Fleet:
    control_name = f"{app_name}-control"
    control = FakeControl.options(name=control_name, namespace=CONTROL_NAMESPACE).remote()
    kwargs = {"stats_period_s": STATS_PERIOD_S, **router_kwargs}
    deployment = serve.deployment(FakeWorker).options(
        name="fake_worker",
        num_replicas=num_replicas,
        max_ongoing_requests=1000,
        health_check_period_s=1.0,
        health_check_timeout_s=5.0,
        ray_actor_options={"num_cpus": 0.1},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=STATS_PERIOD_S,
        ),
    )
    handle = serve.run(
        deployment.bind(control_name, block_size=BLOCK_SIZE), name=app_name, route_prefix=f"/{app_name}"
    )
    fleet = Fleet(app_name, handle, control, num_replicas)
    handle.stats.remote().result(timeout_s=WAIT_S)  # initialises the handle's router here
    wait_until(
        lambda: len(ray.get(control.replica_ids.remote())) == num_replicas, WAIT_S, POLL_S,
        message="replicas to register",
    )
    fleet.wait_seen(0)
    return fleet


def teardown(fleet: Fleet) -> None:
    try:
        ray.get(fleet.control.release.remote())
    finally:
        serve.delete(fleet.app_name)
        ray.kill(fleet.control)


@pytest.fixture(scope="module")
def fleet(serve_cluster: Any) -> Iterator[Fleet]:
    # Stats stay "fresh" for 20 periods here: the burst test freezes reports on purpose.
    # A load gate of 16 (default 4): the affinity test sends a burst of 10 same-prefix
    # requests that should all stick; the default's cap on such bursts is unit-tested.
    f = deploy(f"routing-{uuid.uuid4().hex[:6]}", 3, stale_after_periods=20.0, load_gate_threshold=16.0)
    try:
        yield f
    finally:
        teardown(f)


@pytest.fixture
def clean_fleet(fleet: Fleet) -> Iterator[Fleet]:
    fleet.reset()
    yield fleet
    fleet.reset()


# ---------------------------------------------------------------------------------------


def test_custom_router_runs_in_the_driver_handle(clean_fleet: Fleet) -> None:
    router = clean_fleet.router
    assert type(router).__name__ == "PolicyRouter"
    assert router.params.stats_period_s == STATS_PERIOD_S
    view = clean_fleet.view()
    assert len(view) == 3
    assert {v["stats"]["ordinal"] for v in view.values()} == {0, 1, 2}
    # A call without token ids (stats) is routed by power-of-two.
    before = router.num_decisions_by_mode["pow2"]
    clean_fleet.handle.stats.remote().result(timeout_s=WAIT_S)
    assert router.num_decisions_by_mode["pow2"] == before + 1


def test_burst_spreads_in_proportion_to_headroom(clean_fleet: Fleet) -> None:
    fleet = clean_fleet
    headroom = {0: 100, 1: 200, 2: 300}  # idle replicas of these sizes (a busy one's used blocks are its requests')
    version = 0
    for ordinal, free in headroom.items():
        version = fleet.set_state(ordinal, free_blocks=free, total_blocks=free)
    fleet.wait_seen(version)
    # Freeze the reports: the whole burst is routed on this one report per replica, so
    # only the router's dispatch-time reservations can keep it from herding on replica 2.
    version = 0
    for ordinal in headroom:
        version = fleet.set_state(ordinal, freeze_stats=True)
    frozen = wait_until(
        lambda: (f := ray.get(fleet.control.frozen.remote())) and len(f) == 3 and f, WAIT_S, POLL_S,
        message="replicas to freeze stats",
    )
    ordinal_of = fleet.ordinal_of()
    wait_until(
        lambda: all(v["stats"]["timestamp"] == frozen[ordinal_of[rid]] for rid, v in fleet.view().items()),
        WAIT_S, POLL_S,
        message="the router to hold the frozen reports",
    )
    router = fleet.router
    routed_before = router.num_hook_calls["routed"]
    modes_before = Counter(router.num_decisions_by_mode)

    started = time.monotonic()
    streams = [fleet.start(make_request([7] * 8, hold=True)) for _ in range(200)]  # 1 block each
    submit_s = time.monotonic() - started
    landed = Counter(item["ordinal"] for item in first_items(streams))
    print(f"200 requests submitted in {submit_s * 1000:.0f} ms; landed {dict(sorted(landed.items()))}")

    # 200 of 600 blocks: each replica keeps 2/3 of its headroom (33.3 / 66.7 / 100).
    assert sum(landed.values()) == 200
    assert abs(landed[0] - 33) <= 1 and abs(landed[1] - 67) <= 1 and abs(landed[2] - 100) <= 1, landed
    # Reports never changed during the burst, and the policy ran in headroom mode throughout.
    assert all(v["stats"]["timestamp"] == frozen[ordinal_of[rid]] for rid, v in fleet.view().items())
    modes = Counter(router.num_decisions_by_mode)
    modes.subtract(modes_before)
    assert modes["headroom"] >= 200 and modes["pow2"] == 0 and modes["load_gate"] == 0, modes
    # Serve reported every accepted request through on_request_routed.
    assert router.num_hook_calls["routed"] - routed_before == 200
    # The reservations are this router's only knowledge of the burst.
    view = fleet.view()
    assert sum(v["unreflected_blocks"] for v in view.values()) == 200
    ray.get(fleet.control.release.remote())
    drain(streams)
    fleet.wait_idle()  # on_request_completed fired for every stream


def test_replica_without_headroom_receives_nothing(clean_fleet: Fleet) -> None:
    fleet = clean_fleet
    fleet.set_state(0, free_blocks=0)
    fleet.set_state(1, free_blocks=200)
    fleet.wait_seen(fleet.set_state(2, free_blocks=200))
    streams = [fleet.start(make_request([3] * 8, hold=True)) for _ in range(30)]
    landed = Counter(item["ordinal"] for item in first_items(streams))
    assert landed[0] == 0, landed
    assert landed[1] + landed[2] == 30 and min(landed[1], landed[2]) >= 10, landed
    ray.get(fleet.control.release.remote())
    drain(streams)
    fleet.wait_idle()

    # Headroom back: replica 0 is used again (it was the headroom, nothing else).
    fleet.wait_seen(fleet.set_state(0, free_blocks=200))
    streams = [fleet.start(make_request([3] * 8, hold=True)) for _ in range(30)]
    landed = Counter(item["ordinal"] for item in first_items(streams))
    assert landed[0] >= 5, landed
    ray.get(fleet.control.release.remote())
    drain(streams)


def test_shared_prefix_goes_to_the_replica_that_caches_it(clean_fleet: Fleet) -> None:
    fleet = clean_fleet
    prefix = list(range(1, 513))  # 32 full blocks
    fleet.wait_seen(fleet.set_state(1, prefix_hashes=hash_full_blocks(prefix, BLOCK_SIZE)))

    def send(pfx: list[int], n: int) -> tuple[Counter[int], list[Any]]:
        streams = [fleet.start(make_request(pfx + [20_000 + i] * 8, hold=True)) for i in range(n)]
        items = first_items(streams)
        return Counter(item["ordinal"] for item in items), streams

    # Affinity while the cached replica has headroom (1 block there, 33 elsewhere).
    landed, held = send(prefix, 10)
    assert landed == {1: 10}, landed

    # It runs out of headroom: the same prefix now goes elsewhere.
    fleet.wait_seen(fleet.set_state(1, free_blocks=5))  # 5 - 10 held -> reports 0 free
    landed, more = send(prefix, 6)
    assert landed[1] == 0 and sum(landed.values()) == 6, landed
    held += more
    ray.get(fleet.control.release.remote())
    drain(held)
    fleet.wait_idle()

    # Two more prefixes, cached only on replica 1 (the others learned the first one above).
    prefix_b, prefix_c = list(range(5000, 5512)), list(range(9000, 9512))
    cached_bc = hash_full_blocks(prefix_b, BLOCK_SIZE) + hash_full_blocks(prefix_c, BLOCK_SIZE)
    fleet.set_state(1, free_blocks=1000, num_waiting=40, prefix_hashes=cached_bc)
    fleet.wait_seen(fleet.set_state(0, num_waiting=0))
    # Overloaded (40 waiting there, none elsewhere): the load gate beats affinity.
    gate_before = fleet.router.num_decisions_by_mode["load_gate"]
    landed, held = send(prefix_b, 6)
    assert landed[1] == 0, landed
    assert fleet.router.num_decisions_by_mode["load_gate"] - gate_before >= 6
    ray.get(fleet.control.release.remote())
    drain(held)
    fleet.wait_idle()
    # Queue drained: affinity is back (prefix_c: replicas 0 and 2 never saw it).
    fleet.wait_seen(fleet.set_state(1, num_waiting=0))
    landed, held = send(prefix_c, 6)
    assert landed == {1: 6}, landed
    ray.get(fleet.control.release.remote())
    drain(held)


def test_killed_replica_stops_being_chosen(serve_cluster: Any) -> None:
    fleet = deploy(f"routing-kill-{uuid.uuid4().hex[:6]}", 2)
    try:
        ordinal_of = fleet.ordinal_of()
        victim_id = next(rid for rid, o in ordinal_of.items() if o == 0)
        victim = ray.get(fleet.control.actor.remote(0))
        ray.kill(victim, no_restart=True)
        killed_at = time.monotonic()

        # Right away (its last report is still fresh, so the router may rank the dead
        # replica first): every request still succeeds, none on the dead replica ...
        streams = [fleet.start(make_request([5] * 8)) for _ in range(20)]
        results = [list(stream) for stream in streams]
        assert all(len(r) == 2 and r[-1]["done"] for r in results)
        assert all(r[0]["ordinal"] != 0 for r in results)
        # ... and the first call that met the dead actor made the router drop it
        # (on_replica_actor_died), without waiting for a stats period or Serve's health
        # check: by the time this traffic is answered it is gone from the router's view.
        assert victim_id not in fleet.view(), "the router still holds the killed replica"
        print(f"killed replica dropped from the router within {time.monotonic() - killed_at:.2f} s "
              f"(stats period {STATS_PERIOD_S} s)")
        # ... and Serve replaces it; once the replacement has reported (until then it
        # ranks after every fresh replica with headroom), it gets traffic.
        wait_until(
            lambda: len(v := fleet.view()) == 2 and all("timestamp" in x["stats"] for x in v.values()),
            WAIT_S, POLL_S,
            message="a replacement replica with stats",
        )
        streams = [fleet.start(make_request([6] * 8, hold=True)) for _ in range(20)]
        landed = Counter(item["ordinal"] for item in first_items(streams))
        assert landed[0] == 0 and sum(landed.values()) == 20, landed
        assert landed[2] > 0, landed  # the replacement registered as ordinal 2
        ray.get(fleet.control.release.remote())
        drain(streams)
    finally:
        teardown(fleet)
