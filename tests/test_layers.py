"""The layers of the house: what importing one part must not load.

The client stands on the wire layer (``scheduler_service.wire``), never on the server: an
engine that only talks to the service must not load the server package or prometheus.

Three floors, no import upward: ``scheduler_service`` (core, wire, generated code, server,
client) at the bottom, ``engine_adapter`` (adapter core, planners, vLLM scheduler class,
simulator, data, faults) in the middle, ``clients`` (CLI, bench harness, workloads) on top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


def _loaded_after(module: str, *watched: str) -> list[str]:
    code = (f"import sys, {module}; "
            f"print(','.join(sorted({{m for m in sys.modules for w in {watched!r} "
            f"if m == w or m.startswith(w + '.')}})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("module", ["scheduler_service.client", "clients.client"])
def test_client_does_not_load_the_server(module: str) -> None:
    """``clients.client`` is the first release's name for the client, kept for its users."""
    assert _loaded_after(module, "scheduler_service.server", "prometheus_client") == []


def test_the_first_release_name_is_the_same_client() -> None:
    import clients.client as old
    import scheduler_service.client as new

    assert all(getattr(old, n) is getattr(new, n) for n in new.__all__)


def test_client_stands_on_wire_and_generated_code_only() -> None:
    loaded = _loaded_after("scheduler_service.client", "scheduler_service", "clients", "engine_adapter",
                           "prometheus_client")
    assert [m for m in loaded if not m.startswith(("scheduler_service.core", "scheduler_service.gen",
                                                   "scheduler_service.wire", "scheduler_service.client",
                                                   "scheduler_service.settings"))
            and m != "scheduler_service"] == []


@pytest.mark.parametrize("module", ["scheduler_service.wire", "scheduler_service.wire.convert",
                                    "scheduler_service.wire.status"])
def test_wire_stands_on_core_and_generated_code_only(module: str) -> None:
    loaded = _loaded_after(module, "scheduler_service", "clients", "engine_adapter", "prometheus_client")
    assert [m for m in loaded if not m.startswith(("scheduler_service.core", "scheduler_service.gen",
                                                   "scheduler_service.wire"))
            and m != "scheduler_service"] == []


@pytest.mark.parametrize("module", ["engine_adapter.core", "engine_adapter.remote", "engine_adapter.sim.engine",
                                    "engine_adapter.sim.groundtruth", "engine_adapter.data.traces",
                                    "engine_adapter.faults"])
def test_adapter_core_and_simulator_stand_below_the_clients(module: str) -> None:
    """The adapter core is handed its planner (the remote one stands on the client, which is
    below the adapter); the simulator reads its data from ``engine_adapter.data``: none of
    them imports the clients nor the server."""
    assert _loaded_after(module, "clients", "scheduler_service.server", "tests") == []


@pytest.mark.parametrize("module", ["scheduler_service.core", "scheduler_service.client"])
def test_numba_loads_with_the_first_decision_not_with_the_core(module: str) -> None:
    """The compiled kernels import numba on first use (or at the server's warm-up): an
    engine's client and the CLI stand on the core and must not pay for it."""
    assert _loaded_after(module, "numba", "llvmlite") == []


#: The one module of the core that may import numba.
KERNEL_MODULE = "scheduler_service/core/kernels/_compiled.py"


def test_core_imports_numpy_and_the_standard_library_only() -> None:
    """The policy core is numpy and the standard library; scipy and scikit-learn only
    inside the functions that fit predictors (deferred imports), numba only in the
    compiled-kernel module."""
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted((root / "scheduler_service" / "core").rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                pkg = name.split(".")[0]
                if (pkg in sys.stdlib_module_names or pkg == "numpy"
                        or (pkg == "numba" and rel == KERNEL_MODULE)
                        or (pkg in ("scipy", "sklearn") and id(node) not in top)):
                    continue
                bad.append(f"{rel}:{node.lineno} imports {name}")
    assert bad == []


EDGES = ("scheduler_service/wire", "scheduler_service/server", "engine_adapter", "clients")


def _module_imports() -> dict[str, set[str]]:
    """Module-level imports among the edge modules (the core and generated code are leaves)."""
    root = Path(__file__).resolve().parents[1]
    files = {str(p.relative_to(root))[:-3].replace("/", ".").removesuffix(".__init__"): p
             for d in EDGES for p in (root / d).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps = graph.setdefault(mod, set())
        for node in ast.parse(path.read_text()).body:  # top level only: what importing runs
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1]) if node.level else ""
                target = ".".join(x for x in (base, node.module or "") if x)
                names = [target, *(f"{target}.{a.name}" for a in node.names)]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
    return graph


def test_no_import_circles_at_the_edges() -> None:
    graph = _module_imports()
    done: set[str] = set()

    def visit(m: str, stack: tuple[str, ...]) -> None:
        assert m not in stack, f"import circle: {' -> '.join((*stack, m))}"
        if m not in done:
            for d in sorted(graph.get(m, ())):
                visit(d, (*stack, m))
            done.add(m)

    for m in sorted(graph):
        visit(m, ())


#: What each floor must never import (at the top of a module or inside a function); the
#: benchmarks stand on the package, never on the tests.
FLOORS = {"scheduler_service": ("engine_adapter", "clients", "benchmarks", "tests"),
          "engine_adapter": ("clients", "benchmarks", "tests"),
          "clients": ("benchmarks", "tests"),
          "benchmarks": ("tests",)}


def _all_imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import in ``path``, wherever it stands (relative ones stay in the package)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_no_import_upward(floor: str) -> None:
    root = Path(__file__).resolve().parents[1]
    above = FLOORS[floor]
    bad = [f"{p.relative_to(root)}:{line} imports {name}"
           for p in sorted((root / floor).rglob("*.py"))
           for line, name in _all_imports(p) if name.split(".")[0] in above]
    assert bad == []
