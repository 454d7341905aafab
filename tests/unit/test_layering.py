"""The layering rules of docs/architecture.md: router/ sees worker/ only through the
torch-free worker/api.py, the ingress process never imports torch, and router/'s two
subpackages meet only at router/routing/__init__.py's public surface: the frontend imports
the routing package itself, never its modules, and routing never imports the frontend.
No two files of kv/ worker/ router/ cluster/ import each other, directly or round a
cycle, and no function there is 80 lines or longer."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# worker/api.py, and the torch-free adapter identity (a content digest of an adapter's files,
# computed by the ingress for configured adapters exactly as the workers compute it).
ALLOWED_WORKER_MODULES = {"worker.api", "worker.lora.identity"}


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
    path.write_text("def f():\n    from worker.engine.core import Engine\nimport worker.api\nfrom worker import sequence\n")
    assert sorted(m for _, m in worker_imports(path)) == ["worker.api", "worker.engine.core", "worker.sequence"]


@pytest.mark.parametrize(
    "module", ["worker.api", "router.frontend.ingress", "router.frontend.grpc_api.servicer", "router.routing.serve_router", "router.frontend.disagg"]
)
def test_importing_the_ingress_does_not_import_torch(module: str) -> None:
    """In a fresh interpreter: this process may have imported torch already."""
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in ('torch', 'worker.engine.core', 'worker.serving.replica') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} loaded torch or the engine:\n{result.stderr[-2000:]}"


# -- file-level import cycles -----------------------------------------------------------------
# A cycle between files of the product packages is a cycle of concepts: one of them owns
# something the other needs. Imports at any depth count (a lazy import in a function is
# still a dependency); imports under `if TYPE_CHECKING:` do not (annotations only). A
# package's __init__ importing its own submodules is no cycle of concepts: those edges are
# left out. Generated protobuf stubs are not read.
CYCLE_ROOTS = ("kv", "worker", "router", "cluster", "protos")

# Cycles that exist on this branch and are being removed by the worker/ restructuring
# (issue 45). Only worker/ cycles may be listed, and a listed one that is gone must be
# deleted from here (test_allowed_cycles_still_exist): the list only shrinks.
ALLOWED_CYCLES: set[frozenset[str]] = set()  # none: a new cycle fails test_no_import_cycles


def product_modules(root: Path = ROOT, packages: tuple[str, ...] = CYCLE_ROOTS) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for statement in node.body for n in ast.walk(statement))
    return skipped


def module_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The product modules a file imports (at any depth, TYPE_CHECKING blocks aside): for
    `from a.b import c`, a.b.c when c is a module, else a.b; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
                break
    return found


def import_cycles(root: Path = ROOT, packages: tuple[str, ...] = CYCLE_ROOTS) -> list[frozenset[str]]:
    """The strongly connected sets of more than one file in the import graph (Tarjan's
    algorithm, iterative)."""
    modules = product_modules(root, packages)
    graph = {name: sorted(t for t in module_imports(path, name, modules) if not t.startswith(name + "."))
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = graph[node]
            if i < len(edges):
                work.append((node, i + 1))
                target = edges[i]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if work:  # back in the caller: it takes the callee's low link
                caller = work[-1][0]
                low[caller] = min(low[caller], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(frozenset(members))
    return cycles


def test_no_import_cycles_between_files() -> None:
    cycles = import_cycles()
    assert all(len(c) > 1 for c in cycles)
    new = [" <-> ".join(sorted(c)) for c in cycles if c not in ALLOWED_CYCLES]
    assert not new, ("import cycles between files of kv/ worker/ router/ cluster/ (move the shared type where both "
                     "can import it, or pass a callback):\n" + "\n".join(new))


def test_allowed_cycles_still_exist() -> None:
    assert all(all(m.startswith("worker.") for m in c) for c in ALLOWED_CYCLES), "only worker/ cycles are allowed"
    gone = [" <-> ".join(sorted(c)) for c in ALLOWED_CYCLES - set(import_cycles())]
    assert not gone, "these cycles are gone: delete them from ALLOWED_CYCLES:\n" + "\n".join(gone)


def test_the_cycle_check_sees_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "kv"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kv import a\n")  # a package importing its child: no cycle
    (pkg / "a.py").write_text("from kv.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from kv import a\n")  # lazy: a <-> b
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nfrom . import d\n"
                                      "if TYPE_CHECKING:\n    from kv.a import A\n")
    (pkg / "sub" / "d.py").write_text("from .c import C\n")  # relative: c <-> d
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kv.f import F\n")
    (pkg / "f.py").write_text("from kv.e import E\n")  # e -> f under TYPE_CHECKING only: no cycle
    cycles = import_cycles(tmp_path, ("kv",))
    assert sorted(sorted(c) for c in cycles) == [["kv.a", "kv.b"], ["kv.sub.c", "kv.sub.d"]]


# -- function length ---------------------------------------------------------------------------
# A function of 80 lines or more (from its `def` to its last line) does several things:
# split it on its concept boundaries.
MAX_FUNCTION_LINES = 80
LENGTH_ROOTS = ("kv", "worker", "router", "cluster")

# Functions of worker/ at the limit or past it on this branch, being split by the worker/
# restructuring (issue 45); "path:function". Only worker/ ones may be listed, and the list
# only shrinks (test_allowed_long_functions_are_still_long).
ALLOWED_LONG_FUNCTIONS: set[str] = set()


def long_functions(root: Path = ROOT, packages: tuple[str, ...] = LENGTH_ROOTS) -> dict[str, int]:
    """'path:function' -> lines, for every function of `packages` of MAX_FUNCTION_LINES or more."""
    found: dict[str, int] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines >= MAX_FUNCTION_LINES:
                        found[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_is_80_lines_or_longer() -> None:
    long = {k: n for k, n in long_functions().items() if k not in ALLOWED_LONG_FUNCTIONS}
    assert not long, (f"functions of {MAX_FUNCTION_LINES} lines or more (split them on their concept boundaries):\n"
                      + "\n".join(f"{k}: {n} lines" for k, n in sorted(long.items())))


def test_allowed_long_functions_are_still_long() -> None:
    assert all(k.startswith("worker/") for k in ALLOWED_LONG_FUNCTIONS), "only worker/ functions are allowed"
    gone = sorted(ALLOWED_LONG_FUNCTIONS - set(long_functions()))
    assert not gone, "these are shorter now (or gone): delete them from ALLOWED_LONG_FUNCTIONS:\n" + "\n".join(gone)


def test_the_length_check_counts_from_def_to_last_line(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "kv" / "m.py").write_text(f"def long():\n{body}\n\nasync def short():\n{body[:-len(body.splitlines()[-1]) - 1]}")
    assert long_functions(tmp_path, ("kv",)) == {"kv/m.py:long": MAX_FUNCTION_LINES}


@pytest.mark.parametrize("package,limit", [("worker", 12), ("router/frontend", 16)])
def test_packages_stay_grouped(package: str, limit: int) -> None:
    """A package with many flat modules hides its architecture: past the limit, group the
    new modules in a subpackage of the concept they serve (docs/architecture.md)."""
    flat = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(flat) <= limit, f"{package}/ has {len(flat)} top-level modules (at most {limit}): {flat}"


def uncommented_function_imports(root: Path = ROOT, packages: tuple[str, ...] = ("worker", "kv")) -> list[str]:
    """`path:line` of every import inside a function with no comment on its line or the line
    before: a function-level import must say what it keeps out (torch from the ingress, an
    optional dependency, ...); any other import belongs at the top of the module."""
    found: list[str] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for fn in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        said = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
                        if "#" not in said:
                            found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return sorted(set(found))


def test_function_level_imports_say_why() -> None:
    missing = uncommented_function_imports()
    assert not missing, ("function-level imports without a comment saying why (move them to the top of the "
                         "module, or say what they keep out):\n" + "\n".join(missing))


def test_the_import_check_sees_imports_in_functions(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "m.py").write_text(
        "import os\n\n\ndef f():\n    import json\n    # torch: kept out of the ingress\n    import torch\n"
        "    import re  # optional\n"
    )
    assert uncommented_function_imports(tmp_path, ("kv",)) == ["kv/m.py:5"]
