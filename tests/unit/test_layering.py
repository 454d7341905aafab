"""The layering rules of docs/architecture.md: router/ sees worker/ only through the
torch-free worker/api.py, the ingress process never imports torch, and router/'s two
subpackages meet only at router/routing/__init__.py's public surface: the frontend imports
the routing package itself, never its modules, and routing never imports the frontend."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_WORKER_MODULES = {"worker.api"}


def imports_of(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import of `package` in a file, at any depth (lazy imports in
    functions count too). `from pkg import name` counts as `pkg.name`: the name may be a
    module; the surface test below tells a module from a re-exported name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from worker import api` names the module in the alias.
            modules = [f"{node.module}.{a.name}" for a in node.names] if node.module == package else [node.module]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m == package or m.startswith(package + ".")]
    return found


def worker_imports(path: Path) -> list[tuple[int, str]]:
    return imports_of(path, "worker")


def routing_surface() -> set[str]:
    """The names router/routing/__init__.py exports to the frontend."""
    import router.routing

    return {f"router.routing.{name}" for name in router.routing.__all__}


def test_router_imports_only_worker_api() -> None:
    files = sorted((ROOT / "router").rglob("*.py"))
    assert files, "router/*.py not found"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in worker_imports(path)
        if module not in ALLOWED_WORKER_MODULES
    ]
    assert not offenders, "router/ may import only worker/api.py from worker/:\n" + "\n".join(offenders)


def test_frontend_sees_routing_only_through_its_surface() -> None:
    files = sorted((ROOT / "router" / "frontend").rglob("*.py"))
    assert len(files) > 10, "router/frontend/*.py not found"
    surface = routing_surface()
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imports_of(path, "router.routing")
        if module != "router.routing" and module not in surface
    ]
    assert not offenders, (
        "router/frontend/ may import only router.routing's public surface (router/routing/__init__.py):\n"
        + "\n".join(offenders)
    )


def test_routing_never_imports_the_frontend() -> None:
    files = sorted((ROOT / "router" / "routing").rglob("*.py"))
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imports_of(path, "router.frontend")
    ]
    assert not offenders, "router/routing/ must not import router/frontend/:\n" + "\n".join(offenders)


def test_the_surface_check_catches_a_module_import(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from router.routing import Ticket\nfrom router.routing.ranking import x\n"
                    "from router.routing import sessions\n")
    found = [m for _, m in imports_of(path, "router.routing")]
    assert found == ["router.routing.Ticket", "router.routing.ranking", "router.routing.sessions"]
    surface = routing_surface()
    assert [m for m in found if m not in surface] == ["router.routing.ranking", "router.routing.sessions"]


def test_architecture_doc_exists() -> None:
    assert (ROOT / "docs" / "architecture.md").is_file(), "docs/architecture.md states these rules"


def test_the_walk_sees_imports_in_functions(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from worker.engine import Engine\nimport worker.api\nfrom worker import replica\n")
    assert sorted(m for _, m in worker_imports(path)) == ["worker.api", "worker.engine", "worker.replica"]


@pytest.mark.parametrize(
    "module", ["worker.api", "router.frontend.ingress", "router.frontend.grpc_api.servicer", "router.routing.serve_router", "router.frontend.disagg"]
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
