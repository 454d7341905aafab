"""The chart gives the KV tiers volumes they fit in (issue 48, finding 5): the disk tier an
emptyDir of its own, sized to its bound plus an eighth and requested as ephemeral storage
(the only writable path was a 20 Gi /tmp shared with Ray's logs, while the tier defaults to
16 GiB, so kubelet evicted the pod); the shared store a PVC and its key from a Secret."""
from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import CHART, KUBE_VERSION, NAMESPACE, Rendered, render_job, require_helm, run_jobs, with_api_keys

DISK = "/var/cache/kvserve"
SHARED = "/mnt/kv-shared"
MI = 1024**2


def _engine(**engine: Any) -> dict[str, Any]:
    return {"kvserve": {"engine": {"device": "cuda", "host_kv_cache_bytes": "8GiB", **engine}}}


CASES: dict[str, dict[str, Any]] = {
    "default_bound": _engine(disk_kv_cache_dir=DISK),
    "gib_string": _engine(disk_kv_cache_dir=DISK, disk_kv_cache_bytes="100GiB"),
    "integer": _engine(disk_kv_cache_dir=DISK, disk_kv_cache_bytes=1073741824),
    "decimal": _engine(disk_kv_cache_dir=DISK, disk_kv_cache_bytes="500MB"),
    "shared": {**_engine(shared_kv_store_dir=SHARED),
               "kvTiers": {"sharedStore": {"claimName": "kv-shared", "keySecret": {"name": "kv-store-key"}}}},
}
BOUNDS = {"default_bound": 16 * 1024**3, "gib_string": 100 * 1024**3, "integer": 1024**3, "decimal": 500 * 10**6}


@pytest.fixture(scope="module")
def tiers() -> dict[str, Rendered]:
    require_helm()
    results = run_jobs([render_job(v) for v in CASES.values()])
    out = {}
    for (name, values), result in zip(CASES.items(), results):
        assert result["ok"], f"{name}: {result.get('error')}"
        out[name] = Rendered(values, result["manifests"])
    checks = run_jobs([{"op": "validate", "documents": r.docs, "kube_version": KUBE_VERSION} for r in out.values()])
    for name, check in zip(out, checks):
        assert check["ok"], check.get("error")
        assert not [e for doc in check["results"] for e in doc["errors"]], name
    lints = run_jobs([{"op": "lint", "chart": str(CHART), "values": with_api_keys(v), "strict": True,
                       "namespace": NAMESPACE, "kube_version": f"v{KUBE_VERSION}"} for v in CASES.values()])
    for name, lint in zip(out, lints):
        assert lint["ok"] and not lint["report"]["errors"], (name, lint)
    return out


def _pool(r: Rendered) -> dict[str, Any]:
    (pool,) = [t for name, t in r.pod_templates() if name == "gpu"]
    return pool["spec"]


def _mi(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2])


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_the_disk_tier_gets_a_volume_it_fits_in(tiers: dict[str, Rendered], case: str) -> None:
    spec = _pool(tiers[case])
    volumes = {v["name"]: v for v in spec["volumes"]}
    size = _mi(volumes["kv-disk-tier"]["emptyDir"]["sizeLimit"])
    bound = BOUNDS[case]
    assert bound * 1.125 <= size * MI < bound * 1.125 + MI  # the bound, an eighth of slack, rounded up
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[DISK] == "kv-disk-tier" and mounts["/tmp"] == "tmp"  # its own, not Ray's /tmp
    assert _mi(container["resources"]["requests"]["ephemeral-storage"]) == size  # scheduled where it fits


def test_no_tier_volumes_without_tiers(rendered: dict[str, Rendered]) -> None:
    for _, template in rendered["default"].pod_templates():
        names = {v["name"] for v in template["spec"]["volumes"]}
        assert not names & {"kv-disk-tier", "kv-shared-store"}


def test_the_shared_store_mounts_its_claim_and_its_key(tiers: dict[str, Rendered]) -> None:
    spec = _pool(tiers["shared"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kv-shared-store"]["persistentVolumeClaim"]["claimName"] == "kv-shared"
    (container,) = spec["containers"]
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]}[SHARED] == "kv-shared-store"
    env = {e["name"]: e for e in container["env"]}
    assert env["KVSERVE_KV_STORE_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kv-store-key", "key": "kv-store-key"}


def test_tier_settings_the_chart_cannot_serve_are_refused(render_errors: Any) -> None:
    shared = _engine(shared_kv_store_dir=SHARED)
    errors = render_errors([
        (_engine(disk_kv_cache_dir="/tmp"), False),
        (_engine(disk_kv_cache_dir="/models/model/kv"), False),
        (_engine(disk_kv_cache_dir="relative/kv"), False),
        (shared, False),
        ({**shared, "kvTiers": {"sharedStore": {"claimName": "kv-shared"}}}, False),
    ])
    assert "overlaps" in errors[0] and "overlaps" in errors[1]
    assert "absolute path" in errors[2]
    assert "claimName is empty" in errors[3]
    assert "keySecret.name is empty" in errors[4]
