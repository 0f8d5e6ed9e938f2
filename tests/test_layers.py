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


#: What an engine adapter running the policy in-process must not load: the gRPC server
#: stack (health and reflection services included) and prometheus, unless its metrics
#: endpoint is on.
SERVER_STACK = ("scheduler_service.server", "grpc_health", "grpc_reflection", "prometheus_client")


@pytest.mark.parametrize("module", ["engine_adapter.vllm", "engine_adapter.inprocess", "engine_adapter.vllm.observe"])
def test_in_process_adapter_loads_no_server(module: str) -> None:
    """The vLLM adapter's package, the in-process planner and the adapter's observability
    module (prometheus_client is imported when the metrics endpoint starts)."""
    assert _loaded_after(module, *SERVER_STACK) == []


#: The vLLM adapter's modules that import nothing of vLLM (vLLM itself loads prometheus_client).
ADAPTER_PLAIN = ("engine_adapter.vllm", "engine_adapter.vllm.settings", "engine_adapter.vllm.observe",
                 "engine_adapter.vllm.fit", "engine_adapter.vllm.pipeline", "engine_adapter.vllm.stats",
                 "engine_adapter.vllm.effects", "engine_adapter.vllm.live", "engine_adapter.vllm.snapshot",
                 "engine_adapter.vllm.decision")


@pytest.mark.parametrize("module", ["engine_adapter.vllm.live", "engine_adapter.inprocess",
                                    "engine_adapter.vllm.decision", "engine_adapter.vllm.pipeline"])
def test_the_in_process_path_imports_no_grpc_and_nothing_of_the_server(module: str) -> None:
    """The modules an engine with the policy in process runs on: importing them loads no
    gRPC, client or remote planner (the remote path imports them when it builds its core)."""
    assert _loaded_after(module, "grpc", "scheduler_service.server", "scheduler_service.client",
                         "engine_adapter.remote") == []


def test_an_in_process_engine_deciding_loads_no_grpc() -> None:
    """In a fresh process: a vLLM adapter's core built in process, a decision taken and a
    report handed over load no gRPC, client or remote planner, and nothing of the server
    package (the predictor registry the in-process planner refits with stands apart:
    test_the_predictor_registry_stands_apart_from_the_grpc_server)."""
    code = """if True:
        import sys
        from engine_adapter.core import IterationSample
        from engine_adapter.vllm.live import LiveCore
        from engine_adapter.vllm.settings import SettingsWatcher, VllmAdapterSettings
        from engine_adapter.vllm.snapshot import SloDefaults, SnapshotBuilder
        from scheduler_service.core import Request, Snapshot
        import numpy as np
        live = LiveCore(SettingsWatcher(VllmAdapterSettings(policy="slidingserve")), "m|h|tp1",
                        SnapshotBuilder(SloDefaults(), "m|h|tp1"))
        snap = Snapshot.from_requests([Request("a", 0.0, 40, ttft_slo=1.0, tbt_slo=0.1), Request("d", 0.0, 8, computed_tokens=8, output_tokens=3, ttft_slo=1.0, tbt_slo=0.1)], now=1.0,
                                      max_batch_tokens=512, max_num_seqs=8)
        core = live.get()
        assert core.decide(snap).plan is not None
        core.report(IterationSample(np.array([40, 1]), np.array([0, 10]), 12.0))
        core.flush()
        live.close()
        watched = ("grpc", "scheduler_service.server", "scheduler_service.client", "engine_adapter.remote")
        print(",".join(sorted(m for m in sys.modules for w in watched if m == w or m.startswith(w + "."))))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_prometheus_loads_only_when_the_adapters_metrics_endpoint_is_on() -> None:
    """In a fresh process: the adapter's modules, a core built and a decision collected load
    no prometheus_client (nor vLLM); the metrics endpoint starting does.  In the scheduler
    module (which needs vLLM) prometheus_client is imported only inside observe.py's functions."""
    code = """if True:
        import sys
        import {mods}
        from engine_adapter.vllm.live import LiveCore
        from engine_adapter.vllm.settings import SettingsWatcher, VllmAdapterSettings
        from engine_adapter.vllm.snapshot import SloDefaults, SnapshotBuilder
        from engine_adapter.vllm.stats import AdapterStats
        live = LiveCore(SettingsWatcher(VllmAdapterSettings(policy="vllm-fcfs")), "m|h|tp1",
                        SnapshotBuilder(SloDefaults(), "m|h|tp1"))
        live.get()
        stats = AdapterStats()
        core, fields = live.stats()
        stats.as_dict(core, live.retired, **fields)
        loaded = lambda: sorted(m for m in sys.modules if m.split(".")[0] in ("prometheus_client", "vllm"))
        before = loaded()
        from engine_adapter.vllm.observe import MetricsEndpoint
        ep = MetricsEndpoint(lambda: stats.as_dict({{}}), dict, "127.0.0.1", 0)
        ep.close()
        live.close()
        print(before, "prometheus_client" in loaded())
    """.format(mods=", ".join(ADAPTER_PLAIN))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr
    adapter = Path(__file__).resolve().parents[1] / "engine_adapter" / "vllm"
    for path in sorted(adapter.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "prometheus_client" for n in names):
                assert path.name == "observe.py" and id(node) not in top, f"{path.name}:{node.lineno}"


def test_the_predictor_registry_stands_apart_from_the_grpc_server() -> None:
    """The in-process planner refits with the service's registry (``scheduler_service.predictors``):
    importing it loads nothing of the server, gRPC or prometheus."""
    assert _loaded_after("scheduler_service.predictors", *SERVER_STACK, "grpc") == []


def test_the_server_package_loads_its_names_on_first_use() -> None:
    assert _loaded_after("scheduler_service.server", *SERVER_STACK, "grpc") == ["scheduler_service.server"]
    import scheduler_service.server as server

    assert all(getattr(server, name) is not None for name in server.__all__)


def test_cli_imports_the_server_only_in_the_commands_that_run_it() -> None:
    """``slidingserve plan`` (and every command but ``serve`` and ``token``) runs without the
    server: clients/cli.py imports it inside those commands only."""
    path = Path(__file__).resolve().parents[1] / "clients" / "cli.py"
    top = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert [n for n in names if n.startswith("scheduler_service.server")] == []


def test_the_cli_loads_no_server_until_a_command_runs_one() -> None:
    """Everything ``slidingserve plan`` loads (the CLI with its bench and live subcommands)."""
    assert _loaded_after("clients.cli", "scheduler_service.server", "prometheus_client") == []


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


#: The packages searched for import circles (generated code is left out: it imports only itself).
CIRCLE_ROOTS = ("scheduler_service", "engine_adapter", "clients")
GENERATED = "scheduler_service/gen/"


def _type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports_run(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run: at the top, in functions, in branches; not the bodies of
    ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and _type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours that importing it or calling it can import first.

    ``import a.b.c`` and ``from a.b import c`` run ``a``, ``a.b`` (and ``a.b.c`` when it is
    a module) except the packages of the importing module itself (they ran before it);
    ``from a.b import name`` of a name that is not a module needs ``a.b`` to have run, even
    when it is the importing module's own package.  Relative imports are resolved."""
    root = Path(__file__).resolve().parents[1]
    files: dict[str, Path] = {}
    for d in CIRCLE_ROOTS:
        for path in (root / d).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(GENERATED):
                files[rel[:-3].replace("/", ".").removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        ran = set(_prefixes(mod))
        deps = graph.setdefault(mod, set())
        for node in _imports_run(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    deps.update(p for p in _prefixes(alias.name) if p in files and p not in ran)
                continue
            base = ".".join(pkg.split(".")[: pkg.count(".") + 2 - node.level]) if node.level else ""
            target = ".".join(x for x in (base, node.module or "") if x)
            deps.update(p for p in _prefixes(target) if p in files and p not in ran)
            for alias in node.names:
                if f"{target}.{alias.name}" in files:
                    deps.add(f"{target}.{alias.name}")
                elif target in files and target != mod:
                    deps.add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """One circle (``a -> b -> ... -> a``) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):  # Tarjan's algorithm, without recursion
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group: set[str] = set()
                    while v not in group:
                        group.add(stack.pop())
                    on_stack -= group
                    if len(group) > 1:
                        groups.append(group)
    out = []
    for group in groups:  # the shortest way from its first module back to it, for the message
        first = min(group)
        paths = {first: (first,)}
        queue = [first]
        while queue:
            v = queue.pop(0)
            if first in graph[v]:
                out.append(" -> ".join((*paths[v], first)) + f" ({len(group)} modules in the knot)")
                break
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = (*paths[v], w)
                    queue.append(w)
    return out


def test_no_import_circles() -> None:
    """No module imports, at any depth (deferred imports in functions too), one that imports
    it back: a circle works only in the order it was first tried, and the lowest module of
    one would know the highest (the kernels would know every policy)."""
    circles = _circles(_import_graph())
    assert not circles, "import circles:\n" + "\n".join(circles)


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


#: The policy modules: they reach the hot path through ``kernels.ops()`` only.
POLICY_MODULES = ("slidingserve", "batch", "chunker", "constructor", "sorter")
#: What the kernels package shares with them besides: a layout, a constant, the id order.
SHARED = ("QueueView", "MAX_BOUNDARIES", "id_rank")


@pytest.mark.parametrize("module", POLICY_MODULES)
def test_policy_modules_never_branch_on_the_kernel_backend(module: str) -> None:
    """One dispatch: a policy module calls ``kernels.ops().<operation>(...)`` and never asks
    which backend runs (no ``kernels.jit``, ``kernels.backend``, the facade's ``name``, the
    compiled module or the facade classes); the facade, ``kernels/_ops.py``, gathers their arguments."""
    path = Path(__file__).resolve().parents[1] / "scheduler_service" / "core" / f"{module}.py"
    text = path.read_text()
    bad = [word for word in ("jit(", "kernels.jit", "kernels.backend", "_compiled", "Ops(",
                             "MAX_LATE_SET", ".k.") if word in text]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels":
            if node.attr not in ("ops", *SHARED):
                bad.append(f"kernels.{node.attr}")
        if (isinstance(node, ast.Attribute) and node.attr in ("name", "k") and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "ops"):
            bad.append(f"kernels.ops().{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module:
            bad += [f"from {node.module} import {a.name}" for a in node.names if a.name not in SHARED]
    assert bad == [], f"{module}.py branches on the kernel backend: {bad}"


def test_the_kernels_facade_imports_no_policy_module() -> None:
    """The facade, the kernels and the rule codes stand below the policies: at run time
    (deferred imports too) they import none of them."""
    graph = _import_graph()
    policies = {f"scheduler_service.core.{m}" for m in POLICY_MODULES}
    for mod in ("scheduler_service.core.kernels", "scheduler_service.core.kernels._ops",
                "scheduler_service.core.kernels._compiled", "scheduler_service.core.rule_codes"):
        assert graph[mod] & policies == set(), mod
