"""The layering rules that DESIGN.md states: router/ sees worker/ only through the
torch-free worker/api.py, and the ingress process never imports torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_WORKER_MODULES = {"worker.api"}


def worker_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of worker/ in a file, at any depth (lazy imports in
    functions count too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from worker import api` names the module in the alias.
            modules = [f"{node.module}.{a.name}" for a in node.names] if node.module == "worker" else [node.module]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m == "worker" or m.startswith("worker.")]
    return found


def test_router_imports_only_worker_api() -> None:
    files = sorted((ROOT / "router").glob("*.py"))
    assert files, "router/*.py not found"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in worker_imports(path)
        if module not in ALLOWED_WORKER_MODULES
    ]
    assert not offenders, "router/ may import only worker/api.py from worker/:\n" + "\n".join(offenders)


def test_the_walk_sees_imports_in_functions(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from worker.engine import Engine\nimport worker.api\nfrom worker import replica\n")
    assert sorted(m for _, m in worker_imports(path)) == ["worker.api", "worker.engine", "worker.replica"]


@pytest.mark.parametrize(
    "module", ["worker.api", "router.ingress", "router.grpc_servicer", "router.request_router", "router.disagg"]
)
def test_importing_the_ingress_does_not_import_torch(module: str) -> None:
    """In a fresh interpreter: this process may have imported torch already."""
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in ('torch', 'worker.engine', 'worker.replica') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} loaded torch or the engine:\n{result.stderr[-2000:]}"
