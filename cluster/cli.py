"""The `kvserve` command.

    kvserve serve                       # local Ray + the whole app on the embedded model
    kvserve serve --model DIR --num-workers 2 --port 8001
    kvserve serve --config kvserve.yaml # the same schema as serve deploy / Helm
    kvserve serve --tensor-parallel-size 2 --disaggregate --prefill-workers 1 --decode-workers 2
    kvserve serve --device sim:h200 --model-shape llama-3-8b --num-workers 16   # simulated GPUs
    kvserve config [--config FILE]      # print the effective configuration as YAML
    kvserve calibrate                   # fit a device profile of this machine (worker/sim/)
    kvserve status [--address HOST:PORT] [--json]   # pools, replicas per node, KV, queues

Subcommands live in a table of "module:function" registrars, imported lazily; each adds
its own argparse subparser and sets `func`. Another command (e.g. `kvserve bench ...`,
a gRPC client) is one more line in SUBCOMMANDS. A command whose module does not import
(a broken install) is still listed; running it says what failed and what to install.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import ConfigError, KVServeConfig
from cluster.models_config import model_views
from cluster.listen_config import GRPCSection, HTTPSection
from cluster.lora_config import parse_lora_modules
from cluster.deps import MissingDependencyError, missing
from cluster.serve_exposure import (direct_ingress, direct_ingress_off_reason, endpoint_lines, grpc_proxy_env,
                                    listen_warnings)
from cluster.serve_env import DirectIngress
from worker.model_config import UnsupportedModelError, check_local_model

# name -> "module:register_function"; register(subparsers) adds the parser, sets func.
SUBCOMMANDS: dict[str, str] = {
    "serve": "cluster.cli:register_serve",
    "config": "cluster.cli:register_config",
    "complete": "cluster.grpc_cli:register",
    "bench": "cluster.bench_serve:register",
    "simulate": "cluster.sim.cli:register",
    "calibrate": "cluster.calibrate:register",
    "status": "cluster.status:register",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM serving cluster on Ray Serve.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, target in SUBCOMMANDS.items():
        module_name, function_name = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            register_unavailable(subparsers, name, missing(f"`kvserve {name}`", e))
            continue
        getattr(module, function_name)(subparsers)
    return parser


def register_unavailable(subparsers: Any, name: str, error: MissingDependencyError) -> None:
    """A command that cannot run here: it takes any arguments and fails with `error`."""
    # No option prefix: every argument, `--flag`s included, lands in `args` (argparse would
    # otherwise reject the command's real flags before `fail` can explain).
    parser = subparsers.add_parser(
        name, help=f"(unavailable: {error.name or 'a module'} does not import)", add_help=False, prefix_chars="\0"
    )
    parser.add_argument("args", nargs="*")

    def fail(args: argparse.Namespace) -> int:
        print(f"kvserve: {error}", file=sys.stderr)
        return 2

    parser.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    except (UnsupportedModelError, MissingDependencyError) as e:  # a checkpoint or feature that cannot run here
        print(f"kvserve: {e}", file=sys.stderr)
        return 2


# -- shared config flags ------------------------------------------------------------------
def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML file in the KVServeConfig schema")
    parser.add_argument("--model", metavar="PATH", help="model directory, .gguf file or Hub id (default: embedded kvserve-tiny)")
    parser.add_argument("--served-model-name", metavar="NAME", help="the model name clients send")
    parser.add_argument("--num-workers", type=int, metavar="N", help="worker replicas")
    parser.add_argument("--host", help=f"HTTP host (default {HTTPSection().host})")
    parser.add_argument("--port", type=int, help=f"HTTP port (default {HTTPSection().port})")
    parser.add_argument("--grpc-port", type=int, help=f"gRPC port (default {GRPCSection().port})")
    front = parser.add_mutually_exclusive_group()
    front.add_argument("--direct-ingress", action="store_true",
                       help="insist on HAProxy straight to the ingress replicas (the default wherever it can "
                            "run; an error where it cannot) (http.direct_ingress; docs/operations.md)")
    front.add_argument("--serve-proxy", action="store_true",
                       help="Serve's HTTP and gRPC proxies in front instead of direct ingress "
                            "(http.direct_ingress: false)")
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N",
                        help="ranks (devices) per worker replica; every pool when disaggregated")
    parser.add_argument("--disaggregate", action="store_true",
                        help="separate prefill and decode worker pools (each starts as a copy of `workers`)")
    parser.add_argument("--device", metavar="DEVICE",
                        help="auto | cpu | cuda | sim:<profile> (simulated: h200, h100, a100-80gb, l4 or a profile JSON)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"),
                        help="the KV cache's element type: auto (the model's) or fp8 (e4m3, half of bf16's bytes)")
    parser.add_argument("--model-shape", metavar="SHAPE",
                        help="sim device: the model it simulates (llama-3-8b, llama-3-70b, qwen3-32b, deepseek-v3 or a config.json)")
    parser.add_argument("--time-dilation", type=float, metavar="X", help="sim device: wall seconds per modelled second")
    parser.add_argument("--prefill-workers", type=int, metavar="N", help="prefill pool replicas (implies --disaggregate)")
    parser.add_argument("--decode-workers", type=int, metavar="N", help="decode pool replicas (implies --disaggregate)")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) served under NAME (vLLM's flag)")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (loaded at run time too)")
    parser.add_argument("--max-loras", type=int, metavar="N", help="adapters a step can mix per worker replica")
    parser.add_argument("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank served")


def config_from_args(args: argparse.Namespace) -> KVServeConfig:
    config = KVServeConfig.from_yaml(args.config) if args.config else KVServeConfig()
    overrides: dict[str, Any] = {
        "model.path": args.model,
        "model.served_model_name": args.served_model_name,
        "workers.num_replicas": args.num_workers,
        "workers.tensor_parallel_size": args.tensor_parallel_size,
        "http.host": args.host,
        "http.port": args.port,
        "grpc.port": args.grpc_port,
        "engine.device": args.device,
        "engine.model_shape": args.model_shape,
        "engine.kv_cache_dtype": getattr(args, "kv_cache_dtype", None),
        "engine.time_dilation": args.time_dilation,
        "lora.modules": _lora_modules(args),
        "lora.enable": True if args.enable_lora else None,
        "lora.max_loras": args.max_loras,
        "lora.max_lora_rank": args.max_lora_rank,
    }
    if getattr(args, "no_grpc", False):
        overrides["grpc.enabled"] = False
    if getattr(args, "grpc_public", False):
        overrides["grpc.public"] = True
    if getattr(args, "direct_ingress", False):
        overrides["http.direct_ingress"] = True
    if getattr(args, "serve_proxy", False):
        overrides["http.direct_ingress"] = False
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        config = config.with_overrides(overrides)
    disaggregate = args.disaggregate or args.prefill_workers is not None or args.decode_workers is not None
    return with_disaggregation(config, args) if disaggregate else config


def _lora_modules(args: argparse.Namespace) -> dict[str, str] | None:
    if not args.lora_modules:
        return None
    try:
        return parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def with_disaggregation(config: KVServeConfig, args: argparse.Namespace) -> KVServeConfig:
    """Declare prefill and decode pools (copies of `workers`, each autoscaling on its own
    role's signal) unless the config file already does; then apply the pool flags."""
    if config.disaggregation is None:
        pools = {}
        for role in ("prefill", "decode"):
            pool = config.workers.model_dump()
            if pool["autoscaling"] is not None:
                pool["autoscaling"]["role"] = role
            pools[role] = pool
        config = config.with_overrides({"disaggregation": pools})
    overrides = {
        "disaggregation.prefill.num_replicas": args.prefill_workers,
        "disaggregation.decode.num_replicas": args.decode_workers,
        "disaggregation.prefill.tensor_parallel_size": args.tensor_parallel_size,
        "disaggregation.decode.tensor_parallel_size": args.tensor_parallel_size,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return config.with_overrides(overrides) if overrides else config


# -- kvserve config -----------------------------------------------------------------------
def register_config(subparsers: Any) -> None:
    parser = subparsers.add_parser("config", help="print the effective configuration as YAML")
    add_config_flags(parser)
    parser.set_defaults(func=run_config)


def run_config(args: argparse.Namespace) -> int:
    import yaml

    print(yaml.safe_dump(config_from_args(args).model_dump(), sort_keys=False), end="")
    return 0


# -- kvserve serve ------------------------------------------------------------------------
def register_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="run the serving cluster (local Ray unless --address)")
    add_config_flags(parser)
    parser.add_argument("--address", help="an existing Ray cluster to join (default: start a local one)")
    parser.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--dashboard", action="store_true", help="start the Ray dashboard (local cluster)")
    parser.add_argument("--no-grpc", action="store_true",
                        help="do not start the gRPC proxy (Serve's listens on every interface)")
    parser.add_argument("--grpc-public", action="store_true",
                        help="answer gRPC clients on other machines even without API keys "
                             "(default: loopback only unless keys are set)")
    parser.set_defaults(func=run_serve)


def local_num_cpus(config: KVServeConfig) -> int:
    """Logical CPUs for a local cluster: the machine's, or what the replicas ask for when
    that is more (they are scheduling units; on a small machine the replicas share cores
    rather than wait forever for a CPU that does not exist)."""
    from cluster.app import worker_resources

    wanted = config.ingress.max_num_replicas() * config.ingress.num_cpus
    for view in model_views(config):  # every model's pools
        d = view.config.disaggregation
        for pool in [view.config.workers] if d is None else [d.prefill, d.decode]:
            replicas = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
            wanted += replicas * worker_resources(view.config.model_copy(update={"workers": pool}))["num_cpus"]
    return max(os.cpu_count() or 1, math.ceil(wanted))


def drain_ingress(app_name: str, timeout_s: float) -> None:
    """Graceful shutdown, first half: every ingress replica answers new requests 503 while
    the running ones finish, up to `timeout_s` (then serve.shutdown cuts what is left)."""
    from ray import serve

    from cluster.app import INGRESS_DEPLOYMENT

    try:
        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name)
        deadline = time.monotonic() + timeout_s
        method = "begin_drain"
        while True:
            results = handle.broadcast(method).results(timeout_s=10, return_exceptions=True)
            method = "num_in_flight"
            in_flight = sum(r for r in results if isinstance(r, int))
            if in_flight == 0 or time.monotonic() >= deadline:
                break
            print(f"kvserve: draining: {in_flight} request(s) in flight", flush=True)
            time.sleep(0.5)
        if in_flight:
            print(f"kvserve: drain timeout ({timeout_s:g} s): cutting {in_flight} request(s)", flush=True)
    except Exception as e:  # the app never came up, or is gone already: nothing to drain
        print(f"kvserve: drain skipped: {type(e).__name__}: {e}", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    paths = []
    for view in model_views(config):  # every served model
        engine_config = view.config.engine_config()  # fails early (and readably) on a missing model
        # ... and on a checkpoint the workers would refuse (quantized, another architecture).
        check_local_model(engine_config.model.model, engine_config.model.trust_remote_code)
        paths.append(engine_config.model.model)
    from cluster.local_ray import forget_local_cluster, keep_ray_on_loopback

    if args.address is None:
        keep_ray_on_loopback()  # before Ray is imported: it reads the switch then

    import ray
    from ray import serve

    from router.frontend.grpc_api.health import APP_NAME_ENV

    ingress = _http_ingress(config, starts_cluster=args.address is None)
    # Serve's gRPC proxy reads its TLS settings from the node's environment
    # (router/frontend/grpc_api/tls.py): a local cluster inherits this process's.
    # Likewise its exposure and message-size cap (router/frontend/grpc_api/exposure.py).
    os.environ.update(grpc_proxy_env(config))
    os.environ[APP_NAME_ENV] = config.app_name  # the app the proxy's health service probes
    record = _join_ray(args, config, ingress.direct)
    stop = threading.Event()

    def request_stop(signum: int, frame: Any) -> None:
        stop.set()

    # After ray.init, which installs its own SIGTERM handler (a stack dump, then exit):
    # both signals end the wait below, and the shutdown runs in order.
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        _serve_until_stopped(config, ", ".join(paths), ingress, stop)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            forget_local_cluster(record)
            if ingress.haproxy_dir is not None:
                shutil.rmtree(ingress.haproxy_dir, ignore_errors=True)
    return 0


@dataclass(frozen=True)
class HttpIngress:
    """How HTTP reaches the ingress: Serve's direct ingress (HAProxy), or Serve's proxies
    (`direct` None, `off_reason` saying why when that was left to kvserve)."""

    direct: DirectIngress | None
    off_reason: str | None
    haproxy_dir: Path | None  # HAProxy's private files, removed at shutdown


def _http_ingress(config: KVServeConfig, starts_cluster: bool) -> HttpIngress:
    from cluster.serve_env import haproxy_binary, private_direct_ingress

    direct = direct_ingress(config, starts_cluster=starts_cluster)
    # Why Serve's proxies serve, when that was left to kvserve (the banner says it).
    off_reason = (direct_ingress_off_reason(config, starts_cluster=starts_cluster)
                  if direct is None and config.http.direct_ingress is None else None)
    haproxy_dir = None
    if direct is not None and starts_cluster:
        # The cluster starts here, so HAProxy runs on this machine: its files in a
        # directory only this user can enter, its side listeners on the HTTP host
        # (cluster/serve_env.py private_direct_ingress).
        binary = haproxy_binary()
        assert binary is not None  # direct_ingress found one
        direct = private_direct_ingress(direct, config.http.host, binary)
        haproxy_dir = direct.files_dir
    return HttpIngress(direct, off_reason, haproxy_dir)


def _join_ray(args: argparse.Namespace, config: KVServeConfig, direct: DirectIngress | None) -> Path | None:
    """Ray for `kvserve serve`: a new local cluster (returns its record for `kvserve
    status`, cluster/local_ray.py), or the one at --address (returns None)."""
    import ray

    from cluster.local_ray import remember_local_cluster, start_local_ray
    from cluster.serve_env import job_runtime_env

    if args.address is not None:
        ray.init(address=args.address, log_to_driver=False, runtime_env=job_runtime_env(direct_ingress=direct))
        return None
    # Always a NEW cluster of its own, with Ray's traffic on loopback (cluster/local_ray.py),
    # never whatever $RAY_ADDRESS or /tmp/ray/ray_current_cluster point at.
    # Replicas import kvserve from the same place as this process (a source checkout
    # works without installing it).
    root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    address_info = start_local_ray(
        log_to_driver=False,
        include_dashboard=args.dashboard,
        num_cpus=args.num_cpus or local_num_cpus(config),
        runtime_env=job_runtime_env({"PYTHONPATH": pythonpath}, direct_ingress=direct),
    )
    return remember_local_cluster(address_info, config.app_name)


def _serve_until_stopped(config: KVServeConfig, model: str, ingress: HttpIngress, stop: threading.Event) -> None:
    """Serve and the app started (`model`: the checkpoint the workers load), the banner
    printed; then waits for `stop` and drains the ingress."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.app import build_app, grpc_servicer
    from cluster.serve_env import controller_options

    servicer = grpc_servicer() if config.grpc.enabled else None
    serve.start(
        http_options=HTTPOptions(host=config.http.host, port=config.http.port),
        grpc_options=gRPCOptions(port=config.grpc.port, grpc_servicer_functions=[servicer] if servicer else []),
        controller_options=controller_options(direct_ingress=ingress.direct),
    )
    print(f"kvserve: loading {model} on {config.workers.num_replicas} worker(s) ...", flush=True)
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix, blocking=False)
    names = [view.name for view in model_views(config)]
    print(f"kvserve: serving model{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}", flush=True)
    for line in endpoint_lines(config, ingress.direct, ingress.off_reason):
        print(f"kvserve: {line}", flush=True)
    for line in listen_warnings(config, ingress.direct):
        print(f"kvserve: WARNING: {line}", file=sys.stderr, flush=True)
    print("kvserve: Ctrl-C to stop", flush=True)
    while not stop.wait(1.0):
        pass
    print("kvserve: shutting down ...", flush=True)
    drain_ingress(config.app_name, config.workers.drain_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
