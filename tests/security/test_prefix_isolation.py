"""One tenant cannot learn another's prompts through the prefix cache (issue 30,
"Isolation"): vLLM's `cache_salt` and per-key isolation seed the root of the block-hash
chain, so differently salted prompts share no block, `cached_tokens` shows no hit from
another tenant, and the router still finds where a salted prefix lives."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kv.block_hash import ROOT_HASH, hash_full_blocks, root_hash
from router.frontend.auth import ApiKeys, Principal, hash_key, key_id_of
from router.routing import RequestProfile
from tests.support.scheduler_helpers import make_scheduler, step
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress, collect, request
from tests.unit.router.frontend.test_pipeline import inputs
from router.frontend.openai_api import protocol as p
from worker.api import MAX_CACHE_SALT_CHARS, SamplingParams, SamplingParamsError
from worker.sequence import Sequence

PROMPT = list(range(100, 113))  # 3 full blocks of 4, and one token over


def run_one(sched: Any, rid: str, salt: str | None) -> Sequence:
    seq = Sequence(rid, list(PROMPT), SamplingParams(max_tokens=1, cache_salt=salt))
    sched.add(seq)
    while not seq.is_finished:
        step(sched)
    return seq


def test_differently_salted_prompts_share_no_cached_block() -> None:
    # Finding: the prefix cache was shared across keys, so cached_tokens told one tenant
    # that another had sent the same prefix.
    sched = make_scheduler(num_blocks=32, block_size=4)
    run_one(sched, "a", "tenant-a")
    assert run_one(sched, "b", "tenant-b").num_cached_tokens == 0  # another tenant: no hit
    assert run_one(sched, "c", None).num_cached_tokens == 0  # unsalted: no hit on a salted prefix
    assert run_one(sched, "a2", "tenant-a").num_cached_tokens == 12  # the same tenant: its own hit
    assert run_one(sched, "c2", None).num_cached_tokens == 12


def test_the_salt_seeds_only_the_chain_root() -> None:
    assert root_hash(()) == ROOT_HASH  # unsalted hashes are unchanged
    salted = root_hash(("tenant-a",))
    assert salted != ROOT_HASH and root_hash(("tenant-a", "")) != salted  # keys are length-framed
    assert root_hash(("ab", "c")) != root_hash(("a", "bc"))
    assert hash_full_blocks(PROMPT, 4, root=salted)[0] != hash_full_blocks(PROMPT, 4)[0]


def test_a_salted_prefix_is_routable_to_where_it_lives() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    run_one(sched, "a", "tenant-a")
    reported = frozenset(sched.kv.cached_block_hashes(64))
    salted = RequestProfile(list(PROMPT), 1, hash_root=root_hash(("tenant-a",)))
    assert salted.cached_blocks(4, reported) == 3
    assert RequestProfile(list(PROMPT), 1).cached_blocks(4, reported) == 0
    assert RequestProfile(list(PROMPT), 1, hash_root=root_hash(("tenant-b",))).cached_blocks(4, reported) == 0


def test_cache_salt_is_bounded() -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams(cache_salt="")
    with pytest.raises(SamplingParamsError):
        SamplingParams(cache_salt="x" * 10_000)
    with pytest.raises(Exception):  # the HTTP field: 400 at validation
        p.CompletionRequest.model_validate({"model": "m", "prompt": "x", "cache_salt": "x" * (MAX_CACHE_SALT_CHARS + 1)})
    assert p.CompletionRequest.model_validate({"model": "m", "prompt": "x", "cache_salt": "s"}).cache_salt == "s"


async def test_per_key_isolation_salts_every_request_with_its_key() -> None:
    keys = ApiKeys([hash_key("k1"), hash_key("k2")])
    fake = FakeIngress(max_queued_requests=8, api_keys=keys)
    fake.pipeline.settings = dataclasses.replace(fake.pipeline.settings, isolate_prefix_cache_per_key=True)
    one, two = Principal(key_id_of(hash_key("k1"))), Principal(key_id_of(hash_key("k2")))
    for principal, rid in ((one, "r1"), (two, "r2"), (one, "r3")):
        stream = await fake.pipeline.start(principal, 1, 10, inputs(4, 1), rid, 0.0)
        [e async for e in stream]
    salts = [call.request.params.cache_salt for call in fake.worker.calls]
    assert salts[0] is not None and salts[0] == salts[2] != salts[1]
    # A client's own salt cannot name another key's partition: it is framed with its own key.
    forged = inputs(4, 1)
    stream = await fake.pipeline.start(two, 1, 10, lambda n: [dataclasses.replace(i, params=dataclasses.replace(
        i.params, cache_salt=salts[0])) for i in forged(n)], "r4", 0.0)
    [e async for e in stream]
    assert fake.worker.calls[-1].request.params.cache_salt not in (salts[0], salts[1])


async def test_grpc_carries_cache_salt() -> None:
    fake = FakeIngress()
    await collect(fake, request(prompt="hello", max_tokens=1, cache_salt="s-1"))
    assert fake.worker.calls[-1].request.params.cache_salt == "s-1"


def test_chart_isolates_keys_by_default() -> None:
    # The chart is multi-tenant (API keys required): per-key isolation is on unless turned off.
    from tests.helm.chart import Rendered, render_job, require_helm, run_jobs

    require_helm()
    off = {"kvserve": {"ingress": {"isolate_prefix_cache_per_key": False}}}
    default, opted_out = run_jobs([render_job({}), render_job(off)])
    assert default["ok"] and opted_out["ok"], (default.get("error"), opted_out.get("error"))
    for result, values, expected in ((default, {}, True), (opted_out, off, False)):
        (app,) = Rendered(values, result["manifests"]).serve_config["applications"]
        assert app["args"]["ingress"]["isolate_prefix_cache_per_key"] is expected
