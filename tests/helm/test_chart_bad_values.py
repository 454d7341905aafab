"""Bad values fail `helm install/template` with a message that names the problem:
values.schema.json for what JSON Schema can say, the templates' `fail` (in
templates/_helpers.tpl, "kvserve.validate") for cross-field rules. Each `fail` is also
checked with the schema removed, so that the template check stands on its own."""
from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import merge

POOL = {"name": "gpu", "role": "mixed", "replicas": 1, "minReplicas": 1, "maxReplicas": 4, "gpusPerPod": 1}


def pool(**overrides: Any) -> dict[str, Any]:
    return {**POOL, **overrides}


# (id, values, substrings the error must contain). Rejected by values.schema.json.
SCHEMA_CASES = [
    ("negative replicas", {"pools": [pool(replicas=-1)]}, ["/pools/0/replicas", "minimum"]),
    ("negative maxReplicas", {"pools": [pool(maxReplicas=-2)]}, ["/pools/0/maxReplicas", "minimum"]),
    ("zero GPUs per pod", {"pools": [pool(gpusPerPod=0)]}, ["/pools/0/gpusPerPod", "minimum"]),
    ("TP not dividing GPUs per pod",
     {"kvserve": {"workers": {"tensor_parallel_size": 2, "num_gpus": 2}}, "pools": [pool(gpusPerPod=3)]},
     ["/pools/0/gpusPerPod", "multipleOf", "3", "2"]),
    ("TP below one", {"kvserve": {"workers": {"tensor_parallel_size": 0}}},
     ["/kvserve/workers/tensor_parallel_size", "minimum"]),
    # The kvserve block is KVServeConfig's schema (cluster/helm_schema.py): a typo anywhere
    # in it fails the install, not a pod later.
    ("typo in the kvserve block", {"kvserve": {"engine": {"max_num_seq": 8}}},
     ["/kvserve/engine", "additional properties", "max_num_seq"]),
    ("typo at the top of the kvserve block", {"kvserve": {"worker": {"num_gpus": 1}}},
     ["/kvserve", "additional properties", "worker"]),
    ("kvserve value not in its Literal", {"kvserve": {"engine": {"dtype": "fp8"}}}, ["/kvserve/engine/dtype"]),
    ("kvserve byte size not a size", {"kvserve": {"engine": {"kv_cache_bytes": "lots"}}},
     ["/kvserve/engine/kv_cache_bytes"]),
    ("kvserve autoscaling typo", {"kvserve": {"workers": {"autoscaling": {"max_replica": 3}}}},
     ["/kvserve/workers/autoscaling", "max_replica"]),
    ("unknown role", {"pools": [pool(role="both")]}, ["/pools/0/role"]),
    ("no pools", {"pools": []}, ["/pools", "minItems"]),
    ("top-level typo", {"pool": [POOL]}, ["additional properties", "pool"]),
    ("typo in a section", {"autoscaling": {"enable": True}}, ["/autoscaling", "enable"]),
    ("API keys in values", {"apiKeys": {"keys": ["sk-123"]}}, ["/apiKeys", "keys"]),
    ("Redis password in values", {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379",
                                                        "redisPassword": "hunter2"}},
     ["/gcsFaultTolerance", "redisPassword"]),
    ("Ray token in values", {"rayAuth": {"mode": "secret", "token": "abc"}}, ["/rayAuth", "token"]),
    ("Ray auth switched off", {"rayAuth": {"mode": "disabled"}}, ["/rayAuth/mode"]),
    ("root user", {"securityContext": {"runAsUser": 0}}, ["/securityContext/runAsUser", "minimum"]),
    ("dashboard exposed as a service type", {"service": {"http": {"type": "ExternalName"}}}, ["/service/http/type"]),
    ("bad Redis address", {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis"}},
     ["/gcsFaultTolerance/redisAddress"]),
    ("old Ray without token auth", {"rayVersion": "2.40.0"}, ["/rayVersion"]),
    ("state store password in the URL", {"kvserve": {"state": {"redis_url": "redis://:hunter2@redis:6379/0"}}},
     ["/kvserve/state/redis_url"]),
    ("state store URL not redis", {"kvserve": {"state": {"redis_url": "http://redis:6379"}}},
     ["/kvserve/state/redis_url"]),
    ("state store password in values", {"stateStore": {"redisPassword": "hunter2"}}, ["/stateStore", "redisPassword"]),
    ("pool name not a DNS label", {"pools": [pool(name="GPU_Pool")]}, ["/pools/0/name"]),
]

# Rejected by the templates' `fail` (cross-field rules).
FAIL_CASES = [
    ("min above max", {"pools": [pool(minReplicas=3, maxReplicas=2, replicas=2)]},
     ["pools[0] (gpu): minReplicas=3 is greater than maxReplicas=2"]),
    ("replicas outside bounds", {"pools": [pool(replicas=9)]},
     ["pools[0] (gpu): replicas=9 must lie in [minReplicas=1, maxReplicas=4]"]),
    ("duplicate pool names", {"pools": [pool(), pool()]}, ['pools: the name "gpu" is used twice']),
    ("more ingress replicas than ingress pods", {"kvserve": {"ingress": {"autoscaling": None, "num_replicas": 5}}},
     ["kvserve.ingress.num_replicas=5 is more than ingressGroup.maxReplicas=4"]),
    ("ingress scaling past the ingress pods", {"kvserve": {"ingress": {"autoscaling": {"max_replicas": 5}}}},
     ["kvserve.ingress.autoscaling.max_replicas=5 is more than ingressGroup.maxReplicas=4"]),
    ("a pool named like the ingress group", {"pools": [pool(name="ingress")]},
     ['pools: the name "ingress" is the ingress group\'s']),
    ("mixed with prefill", {"pools": [pool(), pool(name="p", role="prefill"), pool(name="d", role="decode")]},
     ["a 'mixed' pool cannot be combined with 'prefill'/'decode' pools"]),
    ("prefill without decode", {"pools": [pool(name="p", role="prefill")]},
     ["disaggregated serving needs both a 'prefill' and a 'decode' pool"]),
    ("disaggregated pools without the config", {"pools": [pool(name="p", role="prefill"), pool(name="d", role="decode")]},
     ["'prefill'/'decode' pools need kvserve.disaggregation"]),
    ("disaggregation config on a mixed pool", {"kvserve": {"disaggregation": {"prefill": {}, "decode": {}}}},
     ["kvserve.disaggregation is set but pools has a 'mixed' pool"]),
    ("decode TP not dividing its pool's GPUs",
     {"kvserve": {"disaggregation": {"prefill": {}, "decode": {"tensor_parallel_size": 2, "num_gpus": 2}}},
      "pools": [pool(name="p", role="prefill"), pool(name="d", role="decode", gpusPerPod=3)]},
     ["pools[1] (d): gpusPerPod=3 is not a multiple of kvserve.disaggregation.decode.tensor_parallel_size=2"]),
    ("replica needs more GPUs than a pod has", {"kvserve": {"workers": {"num_gpus": 2}}},
     ["kvserve.workers.num_gpus=2 is more than any pool's gpusPerPod (1)"]),
    ("fewer GPUs than TP ranks",
     {"kvserve": {"workers": {"tensor_parallel_size": 2, "num_gpus": 1}}, "pools": [pool(gpusPerPod=2)]},
     ["kvserve.workers.num_gpus=1 is less than tensor_parallel_size=2"]),
    ("model outside the mounted volume", {"kvserve": {"model": {"path": "/data/other"}}},
     ['kvserve.model.path="/data/other" does not lie under modelSource.mountPath="/models/model"']),
    ("model shorthand outside the volume", {"kvserve": {"model": "meta-llama/Llama-3.2-1B"}},
     ['kvserve.model.path="meta-llama/Llama-3.2-1B" does not lie under']),
    ("PVC without a claim", {"modelSource": {"pvc": {"claimName": ""}}},
     ["modelSource.pvc.claimName is empty"]),
    ("hostPath without a path", {"modelSource": {"type": "hostPath"}}, ["modelSource.hostPath.path is empty"]),
    ("GCS FT without Redis", {"gcsFaultTolerance": {"enabled": True}}, ["gcsFaultTolerance.redisAddress is empty"]),
    ("token secret mode without a secret", {"rayAuth": {"mode": "secret"}}, ["rayAuth.existingSecret is empty"]),
    ("a pool for a model that is not served",
     {"kvserve": {"model": None, "models": [{"name": "a", "path": "/models/model/a"}]},
      "pools": [pool(), pool(name="b", model="b")]},
     ['pools[1] (b): model "b" is not the name of one of kvserve.models']),
    ("a pool's model without kvserve.models", {"pools": [pool(model="a")]},
     ["pools[0] (gpu): `model` names one of kvserve.models, which is not set"]),
    ("a disaggregated model without its prefill pool",
     {"kvserve": {"model": None, "models": [
         {"name": "a", "path": "/models/model/a"},
         {"name": "b", "path": "/models/model/b", "disaggregation": {"prefill": {}, "decode": {}}}]},
      "pools": [pool(), pool(name="bd", model="b", role="decode")]},
     ['model "b" has no "prefill" pool']),
    ("a model's TP not dividing its pool's GPUs",
     {"kvserve": {"model": None, "models": [
         {"name": "a", "path": "/models/model/a", "workers": {"tensor_parallel_size": 2, "num_gpus": 2}}]},
      "pools": [pool(model="a", gpusPerPod=3)]},
     ['pools (gpu): gpusPerPod=3 is not a multiple of model "a"\'s tensor_parallel_size=2']),
    ("a model outside the mounted volume",
     {"kvserve": {"model": None, "models": [{"name": "a", "path": "/data/a"}]}},
     ['kvserve.models[0].path="/data/a" does not lie under modelSource.mountPath="/models/model"']),
    ("state store password without a URL", {"stateStore": {"redisPasswordSecret": {"name": "redis-pw"}}},
     ["stateStore.redisPasswordSecret.name is set but kvserve.state.redis_url is empty"]),
    ("state store password with no variable",
     {"stateStore": {"redisPasswordSecret": {"name": "redis-pw"}},
      "kvserve": {"state": {"redis_url": "redis://redis:6379", "redis_password_env": None}}},
     ["kvserve.state.redis_password_env is null"]),
]

# The template `fail` for the rule the schema also states (TP vs GPUs per pod).
TEMPLATE_ONLY_CASES = [
    ("TP not dividing GPUs per pod (template check)",
     {"kvserve": {"workers": {"tensor_parallel_size": 2, "num_gpus": 2}}, "pools": [pool(gpusPerPod=3)]},
     ["pools[0] (gpu): gpusPerPod=3 is not a multiple of kvserve.workers.tensor_parallel_size=2"]),
]

ALL = ([(i, v, m, False) for i, v, m in SCHEMA_CASES + FAIL_CASES]
       + [(i + " (no schema)", v, m, True) for i, v, m in FAIL_CASES + TEMPLATE_ONLY_CASES])


@pytest.fixture(scope="module")
def errors(render_errors: Any) -> dict[str, str | None]:
    return dict(zip([case[0] for case in ALL], render_errors([(values, skip) for _, values, _, skip in ALL])))


@pytest.mark.parametrize(("case_id", "expected"), [(c[0], c[2]) for c in ALL], ids=[c[0] for c in ALL])
def test_bad_values_fail_with_a_clear_message(errors: dict[str, str | None], case_id: str, expected: list[str]) -> None:
    error = errors[case_id]
    assert error is not None, f"{case_id}: the chart rendered; it should have refused these values"
    for part in expected:
        assert part in error, f"{case_id}: {part!r} not in the error:\n{error}"


def test_good_values_next_to_the_bad_ones_render(render_errors: Any) -> None:
    """The boundary cases just inside the rules render (so the rules are not too wide)."""
    good = [
        {"pools": [pool(replicas=0, minReplicas=0)]},
        {"kvserve": {"workers": {"tensor_parallel_size": 2, "num_gpus": 2}}, "pools": [pool(gpusPerPod=2)]},
        {"kvserve": {"model": {"path": "/models/model/sub/dir"}}},
        {"kvserve": {"model": "/models/model"}},
        {"kvserve": {"engine": {"kv_cache_bytes": "256MiB", "num_blocks": None, "dtype": "bfloat16"},
                     "ingress": {"max_body_bytes": 4194304}}},
        {"modelSource": {"type": "none"}, "kvserve": {"model": "meta-llama/Llama-3.2-1B"}},
        {"pools": [pool(name="p", role="prefill"), pool(name="d", role="decode")],
         "kvserve": {"disaggregation": {"prefill": {}, "decode": {}}}},
        {"pools": [pool(name="p", role="prefill"), pool(name="d", role="decode", gpusPerPod=4)],
         "kvserve": {"disaggregation": {"prefill": {}, "decode": {"tensor_parallel_size": 4, "num_gpus": 4}}}},
        merge({}, {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"}}),
        {"kvserve": {"state": {"redis_url": "rediss://default@redis.ns.svc:6380"}}},
        {"kvserve": {"state": {"redis_url": "redis://[fd00::1]:6379/0", "redis_password_env": "REDIS_PW"}},
         "stateStore": {"redisPasswordSecret": {"name": "redis-pw"}}},
    ]
    assert render_errors([(v, False) for v in good]) == [None] * len(good)
