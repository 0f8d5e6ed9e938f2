"""Pin the public surface of the policy core."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import scheduler_service.core as core

EXPECTED = [
    "Allocation",
    "BatchLatencyPredictor",
    "FieldViolation",
    "LinearModel",
    "Plan",
    "Policy",
    "Rejection",
    "Request",
    "Snapshot",
    "ValidationError",
    "batch_features",
    "default_predictor",
    "evaluate",
    "fit_predictor",
    "plan_violations",
    "registry",
]


def test_all_is_pinned() -> None:
    assert sorted(core.__all__) == EXPECTED
    for name in core.__all__:
        assert hasattr(core, name), name


def test_validation_error_is_a_value_error() -> None:
    assert issubclass(core.ValidationError, ValueError)


def test_core_imports_neither_grpc_nor_vllm_nor_torch() -> None:
    code = ("import sys, scheduler_service.core as c; c.registry.names(); "
            "bad = [m for m in ('grpc', 'vllm', 'torch', 'google.protobuf') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


#: Imported where fitting needs them: about a second at start-up that decisions, the CLI
#: and health checks would otherwise pay (see core/predictor.py).
DEFERRED = {"scipy", "sklearn"}


def test_core_starts_without_the_fitting_libraries() -> None:
    code = ("import sys, scheduler_service.core as c; c.registry.names(); "
            "print(','.join(m for m in ('scipy', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_core_modules_import_at_the_top_and_in_no_circle() -> None:
    """No import inside a function and no cycle among the core's modules
    (policies register through the registry's one list, not by import side
    effect)."""
    graph: dict[str, set[str]] = {}
    for path in Path(core.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)
                         and not (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in DEFERRED)]
                assert not inner, f"{path.name}:{inner} imports inside {fn.name}()"
        deps = graph.setdefault(path.stem, set())
        for n in tree.body:
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                deps.update([n.module.split(".")[0]] if n.module else [a.name for a in n.names])
    graph.pop("__init__")
    done: set[str] = set()

    def visit(m: str, stack: tuple[str, ...]) -> None:
        assert m not in stack, f"import circle: {' -> '.join((*stack, m))}"
        if m not in done:
            for d in graph.get(m, ()):
                visit(d, (*stack, m))
            done.add(m)

    for m in graph:
        visit(m, ())


def test_plan_violations_reports_each_problem() -> None:
    from tests.factories import decoding, make_snapshot, waiting

    snap = make_snapshot([decoding("d"), waiting("w", 10)], max_batch_tokens=8, max_num_seqs=2, free_kv_tokens=6)
    good = core.Plan("p", "1", "v", "p", 6, 0.0, (core.Allocation("d", 1), core.Allocation("w", 5)))
    assert core.plan_violations(snap, good) == []
    bad = core.Plan("p", "1", "v", "p", 13, 0.0, (
        core.Allocation("d", 2), core.Allocation("w", 11), core.Allocation("x", 1), core.Allocation("w", 1)))
    problems = core.plan_violations(snap, bad)
    text = " | ".join(problems)
    for needle in ("'d' gets 2", "'w' gets 11", "unknown request 'x'", "'w' allocated twice",
                   "exceed max_batch_tokens", "exceed free_kv_tokens"):
        assert needle in text, (needle, problems)
