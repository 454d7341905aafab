"""Starting a local, single-machine Ray cluster that is really local.

Two things go wrong with a plain `ray.init(num_cpus=...)` on a shared machine:

- It is not always a NEW cluster: with no address, Ray looks at $RAY_ADDRESS and then at
  `<ray temp dir>/ray_current_cluster` (written by the last `ray start` or test cluster on
  this machine) and connects to that one; with num_cpus given it then dies with
  "When connecting to an existing cluster, num_cpus and num_gpus must not be provided",
  and without them it would serve on somebody else's cluster. `address="local"` is Ray's
  way to always start a new one.
- Ray's own servers (GCS, raylet, object manager, core workers, agents) listen on every
  interface and on the node's external address. Ray binds them to loopback only when the
  node's IP is 127.0.0.1, which `_node_ip_address="127.0.0.1"` cannot ask for (Ray turns
  a loopback address into the external one, services.resolve_ip_for_localhost). The one
  switch Ray reads for that is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ("no multi-node
  cluster": get_node_ip_address() is then 127.0.0.1, what Ray does on macOS/Windows); Ray
  reads it into ray_constants.ENABLE_RAY_CLUSTER when it is first imported, so it is set
  here before that and checked after.

Serve's HTTP proxy binds `http.host` (127.0.0.1 by default) and its gRPC proxy every
interface; neither depends on this (cluster/serve_exposure.py:listen_warnings says so at start-up).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

# Ray's switch for "this machine is the whole cluster": loopback node IP and servers.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_IP = "127.0.0.1"


def keep_ray_on_loopback() -> None:
    """Set Ray's loopback switch for this process and every Ray process it starts (they
    inherit the environment). Must run before `import ray` to take effect; callers check
    with `ray_is_on_loopback()`."""
    os.environ[LOOPBACK_ENV] = "0"


def ray_is_on_loopback() -> bool:
    """Whether the imported Ray will give a new local node the IP 127.0.0.1."""
    from ray._private import ray_constants  # private: the constant Ray read at import

    return not ray_constants.ENABLE_RAY_CLUSTER


# Ray 2.60 turns token auth on for the clusters it starts (the token in ~/.ray/auth_token),
# but a driver that joins by an explicit address never turns it on by itself and is refused
# with InvalidAuthToken. Do what Ray does for address="auto": token mode when a token is
# there and RAY_AUTH_MODE is unset (an explicit RAY_AUTH_MODE always wins).
def use_token_auth_if_available(environ: MutableMapping[str, str] = os.environ, home: Path | None = None) -> bool:
    if "RAY_AUTH_MODE" in environ:
        return environ["RAY_AUTH_MODE"].lower() == "token"
    token_path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or (home or Path.home()) / ".ray" / "auth_token")
    if environ.get("RAY_AUTH_TOKEN") or token_path.is_file():
        environ["RAY_AUTH_MODE"] = "token"
        return True
    return False


def start_local_ray(**init_kwargs: Any) -> dict[str, Any]:
    """`ray.init` of a NEW single-node cluster whose traffic stays on loopback, whatever
    $RAY_ADDRESS or ray_current_cluster say. Returns the node's address info."""
    keep_ray_on_loopback()
    import ray

    if not ray_is_on_loopback():
        # Ray was imported before the switch was set (a library imported it first): its
        # constant is already read. Patching it keeps the node on loopback all the same.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    init_kwargs.pop("address", None)
    context = ray.init(address="local", **init_kwargs)
    return dict(context.address_info)


# -- where `kvserve status` finds the local cluster `kvserve serve` started ---------------------
# Ray itself records only clusters started with `ray start` (ray_current_cluster); a local
# cluster of `kvserve serve` (address="local") is recorded here, per user, while it runs.
def local_cluster_record_path() -> Path:
    return Path(tempfile.gettempdir()) / f"kvserve-{os.getuid()}" / "local_cluster.json"


def remember_local_cluster(address_info: dict[str, Any], app_name: str) -> Path:
    """Record the GCS address and app of the local cluster this process started."""
    path = local_cluster_record_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    record = {"address": address_info.get("gcs_address") or address_info["address"], "app_name": app_name,
              "pid": os.getpid()}
    path.write_text(json.dumps(record))
    return path


def forget_local_cluster(path: Path | None) -> None:
    """Remove the record at shutdown, unless another `kvserve serve` has replaced it."""
    if path is None:
        return
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def read_local_cluster() -> dict[str, Any] | None:
    """The record of the running local `kvserve serve` cluster, None when there is none. A
    record whose process has exited is stale (its cluster went with it): None too."""
    try:
        record = json.loads(local_cluster_record_path().read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(record)
