"""A missing dependency, said loudly with what to install.

kvserve's features all rest on required dependencies (pyproject.toml), so an ImportError
means a broken install; instead of dropping the feature without a word, the code that
needs the module fails with this message at the point the user asks for the feature.
"""
from __future__ import annotations

from worker.api import MissingDependencyError

# Import name -> the pip distribution that provides it, where they differ.
_DISTRIBUTIONS = {
    "grpc": "grpcio",
    "grpc_tools": "grpcio-tools",
    "google": "protobuf",
    "yaml": "pyyaml",
    "ray": "'ray[serve]'",
    # The OpenTelemetry SDK and OTLP exporters of tracing (cluster/tracing.py).
    "opentelemetry": "'kvserve[otel]'",
}


def install_hint(error: ImportError) -> str:
    module = (error.name or "").split(".")[0]
    if not module or module in ("protos", "router", "cluster", "worker", "kv"):
        # kvserve's own module (or one without a name): the install itself is incomplete.
        return "reinstall kvserve: pip install -e . (from the repository root)"
    return f"pip install {_DISTRIBUTIONS.get(module, module)}"


def missing(feature: str, error: ImportError) -> MissingDependencyError:
    """The error to raise (or print) when `feature` needs what `error` could not import."""
    return MissingDependencyError(f"{feature} is unavailable: {error}. Install it: {install_hint(error)}", name=error.name)
