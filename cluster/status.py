"""`kvserve status`: the pools, replicas per node, KV usage, queue depths and autoscaling
targets of a running kvserve app, as a table or as JSON (`--json`).

It connects to a running Ray cluster (`--address`, default: the local cluster a running
`kvserve serve` started, cluster/local_ray.py) and only reads; it never starts a cluster
and changes nothing. Its sources:

- Serve's controller: the app's deployments (the ingress and the worker pools: `worker`,
  or `prefill` and `decode`), their status, running and target replica counts, autoscaling
  config and state, and each replica's node (router/serve_internals.serve_instance_details);
- every worker replica's `stats`: the engine snapshot that its RoutingStats (what the
  KV-headroom router ranks by) and its autoscaling metrics are taken from, gathered with
  one DeploymentHandle.broadcast per pool, as the ingress's /metrics does;
- every ingress replica's `num_in_flight`: the requests it holds (its 429 bound counts them).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any


DEFAULT_APP_NAME = "kvserve"  # KVServeConfig.app_name's default
STATS_TIMEOUT_S = 10.0
# Autoscaling policy arguments shown as the pool's targets (cluster/autoscaling.py's PoolTargets).
_TARGET_KEYS = ("role", "target_waiting_per_replica", "target_waiting_prompt_tokens_per_replica",
                "kv_usage_ceiling", "scale_to_zero")


class StatusError(RuntimeError):
    """Nothing to show: no cluster at the address, no Serve on it, no such app."""


@dataclass(frozen=True)
class ReplicaStatus:
    pool: str
    replica_id: str
    state: str  # Serve's replica state: RUNNING, STARTING, STOPPING, ...
    node_id: str
    node_ip: str
    pid: int | None
    # Engine stats (worker pools) as the replica reported them; None: it did not answer.
    kv_used_blocks: int | None = None
    kv_total_blocks: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    num_waiting_prompt_tokens: int | None = None
    tokens_per_s: float | None = None
    num_preemptions: int | None = None

    @property
    def kv_usage(self) -> float | None:
        if not self.kv_total_blocks or self.kv_used_blocks is None:
            return None
        return self.kv_used_blocks / self.kv_total_blocks


@dataclass(frozen=True)
class PoolStatus:
    name: str
    role: str  # ingress | worker (a mixed pool) | prefill | decode
    status: str  # Serve's deployment status: HEALTHY, UPDATING, UNHEALTHY, ...
    message: str
    num_running_replicas: int
    target_num_replicas: int
    # min_replicas, max_replicas, the policy's targets, and Serve's scaling_status; None: fixed.
    autoscaling: dict[str, Any] | None
    num_in_flight: int | None = None  # ingress: requests held by its replicas
    kv_used_blocks: int | None = None  # worker pools: sums over the replicas that answered
    kv_total_blocks: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    # The served model whose pool it is, by its slug (cluster/models_config.py); "" for the
    # ingress and for the pools of a single-model app.
    model: str = ""


@dataclass(frozen=True)
class ClusterStatus:
    address: str
    app_name: str
    app_status: str
    pools: list[PoolStatus] = field(default_factory=list)
    replicas: list[ReplicaStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the pools, and the replicas grouped by node."""
        nodes: dict[str, dict[str, Any]] = {}
        for replica in self.replicas:
            node = nodes.setdefault(replica.node_id, {"node_ip": replica.node_ip, "replicas": []})
            node["replicas"].append({**asdict(replica), "kv_usage": replica.kv_usage})
        return {"address": self.address, "app_name": self.app_name, "app_status": self.app_status,
                "pools": [asdict(pool) for pool in self.pools], "nodes": nodes}


# -- gathering (Ray connected) -------------------------------------------------------------------
def gather(address: str, app_name: str, timeout_s: float = STATS_TIMEOUT_S) -> ClusterStatus:
    from cluster.app import INGRESS_DEPLOYMENT
    from router.serve_internals import serve_instance_details

    try:
        details = serve_instance_details()
    except Exception as e:  # RayServeException: no controller on this cluster
        raise StatusError(f"no Serve instance runs on the Ray cluster at {address}: {e}") from None
    applications = details.get("applications") or {}
    app = applications.get(app_name)
    if app is None:
        names = ", ".join(sorted(applications)) or "none"
        raise StatusError(f"no application {app_name!r} on the cluster at {address} (applications: {names}); "
                          f"pass --app NAME")
    pools, replicas = [], []
    # The ingress first, then the worker pools by name.
    for name, deployment in sorted((app.get("deployments") or {}).items(), key=lambda kv: (kv[0] != INGRESS_DEPLOYMENT, kv[0])):
        role, model = pool_role(name)
        members = [_replica(name, r) for r in deployment.get("replicas") or []]
        in_flight = None
        if role == "ingress":
            in_flight = sum(r for r in _broadcast(name, app_name, "num_in_flight", timeout_s) if isinstance(r, int))
        else:
            members = _with_stats(members, _broadcast(name, app_name, "stats", timeout_s))
        pools.append(replace(_pool(name, role, deployment, members, in_flight), model=model))
        replicas += members
    replicas.sort(key=lambda r: (r.node_ip, r.node_id, r.pool, r.replica_id))
    return ClusterStatus(address, app_name, _text(app.get("status")), pools, replicas)


def pool_role(deployment: str) -> tuple[str, str]:
    """(role, model slug) of one of the app's deployments: `ingress`; `worker`, `prefill`,
    `decode` (one model); `<role>-<slug>` (one of several models: cluster/models_config.py)."""
    from cluster.app import INGRESS_DEPLOYMENT  # Ray and Serve: imported only once connected
    from cluster.models_config import POOL_ROLES  # beside it, as the rest of this module's lazy imports

    if deployment == INGRESS_DEPLOYMENT:
        return "ingress", ""
    role, _, slug = deployment.partition("-")
    if role in POOL_ROLES:
        return role, slug
    return "worker", ""


def _text(value: Any) -> str:
    """A field of Serve's details as text (its enums are str enums: their value)."""
    return "" if value is None else str(getattr(value, "value", value))


def _broadcast(deployment: str, app_name: str, method: str, timeout_s: float) -> list[Any]:
    """`method` of every replica of the deployment; the ones that fail are left out."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle(deployment, app_name)
        results = handle.broadcast(method).results(timeout_s=timeout_s, return_exceptions=True)
    except Exception:  # no replica running yet, or the deployment is being deleted
        return []
    return [r for r in results if not isinstance(r, BaseException)]


def _replica(pool: str, details: dict[str, Any]) -> ReplicaStatus:
    return ReplicaStatus(pool=pool, replica_id=_text(details.get("replica_id")), state=_text(details.get("state")),
                         node_id=str(details.get("node_id") or ""), node_ip=str(details.get("node_ip") or ""),
                         pid=details.get("pid"))


def _with_stats(members: list[ReplicaStatus], stats: list[Any]) -> list[ReplicaStatus]:
    """Each replica with the stats it reported (matched by replica id; absent: unchanged)."""
    by_id = {s.get("replica_id"): s for s in stats if isinstance(s, dict)}
    out = []
    for replica in members:
        s = by_id.get(replica.replica_id)
        if s is None:
            out.append(replica)
            continue
        total = int(s.get("total_blocks", 0))
        out.append(replace(
            replica, kv_used_blocks=total - int(s.get("free_blocks", 0)), kv_total_blocks=total,
            num_running=int(s.get("num_running", 0)), num_waiting=int(s.get("num_waiting", 0)),
            num_waiting_prompt_tokens=int(s.get("num_waiting_prompt_tokens", 0)),
            tokens_per_s=float(s.get("tokens_per_s", 0.0)), num_preemptions=int(s.get("num_preemptions", 0)),
        ))
    return out


def _pool(name: str, role: str, d: dict[str, Any], members: list[ReplicaStatus], in_flight: int | None) -> PoolStatus:
    answered = [r for r in members if r.kv_total_blocks is not None]

    def total(attribute: str) -> int | None:
        return sum(getattr(r, attribute) for r in answered) if answered else None

    return PoolStatus(
        name=name, role=role, status=_text(d.get("status")), message=str(d.get("message") or ""),
        num_running_replicas=sum(1 for r in members if r.state == "RUNNING"),
        target_num_replicas=int(d.get("target_num_replicas", 0)),
        autoscaling=_autoscaling(d), num_in_flight=in_flight,
        kv_used_blocks=total("kv_used_blocks"), kv_total_blocks=total("kv_total_blocks"),
        num_running=total("num_running"), num_waiting=total("num_waiting"),
    )


def _autoscaling(d: dict[str, Any]) -> dict[str, Any] | None:
    config = (d.get("deployment_config") or {}).get("autoscaling_config")
    if not config:
        return None
    policy = config.get("policy") or {}
    kwargs = policy.get("policy_kwargs") or {} if isinstance(policy, dict) else {}
    out: dict[str, Any] = {"min_replicas": config.get("min_replicas"), "max_replicas": config.get("max_replicas")}
    out.update({k: kwargs[k] for k in _TARGET_KEYS if k in kwargs})
    if not any(k.startswith("target_") for k in kwargs):  # Serve's own policy: ongoing requests
        out["target_ongoing_requests"] = config.get("target_ongoing_requests")
    detail = d.get("autoscaling_detail") or {}
    if detail.get("scaling_status"):
        out["scaling_status"] = _text(detail["scaling_status"])
    return out


# -- the table ------------------------------------------------------------------------------------
def render(status: ClusterStatus) -> str:
    lines = [f"app {status.app_name!r}: {status.app_status or 'unknown'} (Ray cluster at {status.address})", ""]
    pool_rows = [("POOL", "ROLE", "STATUS", "REPLICAS", "KV USED", "RUNNING", "WAITING", "IN FLIGHT", "AUTOSCALING")]
    for p in status.pools:
        pool_rows.append((
            p.name, p.role, p.status, f"{p.num_running_replicas}/{p.target_num_replicas}",
            _kv(p.kv_used_blocks, p.kv_total_blocks), _n(p.num_running), _n(p.num_waiting), _n(p.num_in_flight),
            _autoscaling_text(p.autoscaling),
        ))
    if any(p.model for p in status.pools):  # several models: which model each pool serves
        pool_rows = [(*row[:2], "MODEL" if i == 0 else status.pools[i - 1].model or "-", *row[2:])
                     for i, row in enumerate(pool_rows)]
    lines += _table(pool_rows)
    lines.append("")
    rows = [("NODE", "REPLICA", "POOL", "STATE", "KV USED", "RUNNING", "WAITING", "WAITING TOKENS", "TOKENS/S", "PREEMPTIONS")]
    for r in status.replicas:
        node = f"{r.node_ip} ({r.node_id[:8]})" if r.node_id else r.node_ip or "?"
        rows.append((
            node, r.replica_id, r.pool, r.state, _kv(r.kv_used_blocks, r.kv_total_blocks), _n(r.num_running),
            _n(r.num_waiting), _n(r.num_waiting_prompt_tokens),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}", _n(r.num_preemptions),
        ))
    lines += _table(rows)
    unhealthy = [p for p in status.pools if p.message and p.status not in ("HEALTHY",)]
    lines += [f"{p.name}: {p.message}" for p in unhealthy]
    return "\n".join(lines)


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _kv(used: int | None, total: int | None) -> str:
    if used is None or not total:
        return "-"
    return f"{used}/{total} ({100.0 * used / total:.1f}%)"


def _autoscaling_text(a: dict[str, Any] | None) -> str:
    if a is None:
        return "fixed"
    parts = [f"{a.get('min_replicas')}..{a.get('max_replicas')} replicas"]
    parts += [f"{k}={v}" for k, v in a.items() if k not in ("min_replicas", "max_replicas", "scaling_status")]
    if "scaling_status" in a:
        parts.append(a["scaling_status"])
    return ", ".join(parts)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# -- the command ----------------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="pools, replicas per node, KV usage, queues and autoscaling of a running app")
    parser.add_argument("--address", help="the Ray cluster's GCS address, HOST:PORT, or `auto` (the cluster "
                                          "`ray start` started on this machine, e.g. a KubeRay head pod); "
                                          "default: the local cluster a running `kvserve serve` started")
    parser.add_argument("--app", help=f"the application's name (default: the local one's, else {DEFAULT_APP_NAME!r})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--timeout", type=float, default=STATS_TIMEOUT_S, help="seconds to wait for the replicas' stats")
    parser.set_defaults(func=run_status)


def resolve_target(address: str | None, app: str | None) -> tuple[str, str]:
    """(GCS address, app name) from the flags, else from the running local `kvserve serve`."""
    from cluster.local_ray import local_cluster_record_path, read_local_cluster

    if address is not None:
        if address.strip().lower() == "local":  # Ray would START a cluster for "local"
            raise StatusError("--address local would start a new cluster; give the running cluster's HOST:PORT")
        return address, app or DEFAULT_APP_NAME
    record = read_local_cluster()
    if record is None:
        raise StatusError(f"no running `kvserve serve` local cluster (nothing live recorded in "
                          f"{local_cluster_record_path()}); pass --address HOST:PORT of a running Ray cluster")
    return str(record["address"]), app or str(record.get("app_name") or DEFAULT_APP_NAME)


def connect(address: str) -> None:
    """Join the running cluster as a driver (never starts one: an address that does not
    answer is an error). A loopback cluster (kvserve serve's local one) is joined from
    loopback, as its node registered itself (cluster/local_ray.py)."""
    from cluster.local_ray import LOOPBACK_IP, keep_ray_on_loopback, use_token_auth_if_available

    host = address.rsplit(":", 1)[0].strip("[]")
    if host in (LOOPBACK_IP, "localhost"):
        keep_ray_on_loopback()
    use_token_auth_if_available()
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise StatusError(f"cannot connect to a Ray cluster at {address}: {e}") from None


def run_status(args: argparse.Namespace) -> int:
    try:
        address, app_name = resolve_target(args.address, args.app)
        connect(address)
        try:
            status = gather(address, app_name, args.timeout)
        finally:
            import ray

            ray.shutdown()  # this driver only; the cluster runs on
    except StatusError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status.to_dict(), indent=2) if args.json else render(status))
    return 0
