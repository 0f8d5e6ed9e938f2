"""The simulator's reason history (``EngineConfig.keep_reasons``) and the bench's
``reasons`` experiment (issue 24: "why did request r7 wait?").

Reasons explain; they never decide: a run with the history on is the same run as with it
off, every explained plan passes the plan check, and no request is charged more waiting
than the time it spent in the system.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.bench.experiments import EXPERIMENTS, BenchConfig, Variant, _reasons
from clients.bench.plots import write_plots
from clients.bench.reasons import GROUPS, reason_run, summarize_reasons
from clients.bench.report import format_report, reasons_table
from clients.bench.runner import RunSpec, profile_predictor, quiet_logs
from clients.cli import main
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimResult, SimulatedEngine
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from scheduler_service.core import plan_violations
from scheduler_service.core.plan import CODES

KEY = DEFAULT_PROFILE
POLICIES = ("vllm-fcfs", "sarathi-edf", "qoserve", "slidingserve")


@pytest.fixture(scope="module", autouse=True)
def _quiet() -> None:
    quiet_logs()


def _run(policy: str, keep: bool, *, n: int = 120, rate: float = 6.0, seed: int = 1,
         hook: Any = None) -> tuple[SimulatedEngine, SimResult]:
    w = make_workload("mixed-v1", n, rate, seed=seed)
    pred = profile_predictor(KEY)
    settings = AdapterSettings(policy=policy, profile=KEY, report_inline=True)
    adapter = AdapterCore(InProcessBackend(settings, pred), settings, pred)
    try:
        eng = SimulatedEngine(w, load_ground_truth(KEY), PROFILES[KEY], adapter,
                              EngineConfig(noise_seed=seed, keep_reasons=keep))
        eng.on_iteration = hook
        return eng, eng.run()
    finally:
        adapter.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_reasons_pass_the_check_and_change_nothing(policy: str) -> None:
    checked = {"plans": 0, "reasons": 0}

    def hook(eng: SimulatedEngine, snap: Any, decision: Any) -> None:
        assert plan_violations(snap, decision.plan) == []
        checked["plans"] += 1
        checked["reasons"] += len(decision.plan.reasons)

    eng, on = _run(policy, True, hook=hook)
    _, off = _run(policy, False)
    assert checked["plans"] > 0 and checked["reasons"] > 0  # loaded: requests waited
    assert eng.unexplained_plans == 0
    np.testing.assert_array_equal(on.violated, off.violated)
    np.testing.assert_array_equal(on.ttft_s, off.ttft_s)
    np.testing.assert_array_equal(on.tbt_s, off.tbt_s)
    assert (on.completed, on.iterations, on.preemptions, on.sim_time_s) == \
        (off.completed, off.iterations, off.preemptions, off.sim_time_s)
    assert off.reason_seconds is None and off.last_reason is None
    assert on.reason_seconds and set(on.reason_seconds) <= set(CODES)


@pytest.mark.parametrize("policy", ["vllm-fcfs", "slidingserve"])
def test_seconds_by_reason_fit_in_the_time_in_the_system(policy: str) -> None:
    eng, res = _run(policy, True, rate=8.0)
    assert res.reason_seconds is not None and res.last_reason is not None
    waited = np.sum(list(res.reason_seconds.values()), axis=0)
    assert waited.shape == (res.n_requests,) and (waited >= 0).all() and waited.sum() > 0
    end = np.where(eng.done & ~eng.rejected, eng.last_token, eng.clock)
    in_system = end - eng.w.arrival
    assert (waited <= in_system + 1e-9).all()
    # a request never charged has no last code, and one charged has one
    charged = waited > 0
    assert all(res.last_reason[i] for i in np.flatnonzero(charged))


def _fake_runs() -> list[dict[str, Any]]:
    return [{"policy": "p", "base_policy": "p", "seed": s, "rate_rps": 1.0, "requests": 10, "violation_rate": 0.3,
             "groups": {"violated": {"requests": 3, "seconds": {"kv": 1.0 + s, "behind": 2.0}},
                        "met": {"requests": 7, "seconds": {"behind": 0.5}}}} for s in (0, 1)]


def test_summary_shares_sum_to_one() -> None:
    row = summarize_reasons(_fake_runs())
    assert row["violated"]["share"] == pytest.approx({"kv": 3 / 7, "behind": 4 / 7})
    assert row["met"]["share"] == {"behind": 1.0}
    assert row["violated"]["requests"] == 6 and row["violated"]["waited_s_mean"] == pytest.approx(7 / 6)


def test_reasons_experiment_table_and_plot(tmp_path: Path) -> None:
    cfg = BenchConfig(n_requests=60, seeds=1, workers=1, experiments=("reasons",))
    variants = [Variant(p, p) for p in ("vllm-fcfs", "slidingserve")]
    out = _reasons(cfg, variants, 7.0, "test rate", None)
    rows = out["rows"]
    assert [r["policy"] for r in rows] == ["vllm-fcfs", "slidingserve"]
    for r in rows:
        for g in GROUPS:
            if r[g]["share"]:
                assert sum(r[g]["share"].values()) == pytest.approx(1.0)
    assert any(r["violated"]["share"] for r in rows)
    table = reasons_table(rows)
    assert "vllm-fcfs" in table and "mean s waiting" in table
    res = {"settings": cfg.to_dict(), "reasons": out, "target_violation": 0.01, "tolerance": 0.1, "wall_s": 1.0}
    assert "Why violated requests waited" in format_report(res)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "reasons.png") in write_plots(res, tmp_path)
    assert (tmp_path / "reasons.png").stat().st_size > 0


def test_reason_run_is_picklable_summary() -> None:
    r = reason_run(RunSpec(policy="sarathi-edf", workload="mixed-v1", rate=7.0, seed=0, n_requests=40))
    assert r["groups"]["violated"]["requests"] + r["groups"]["met"]["requests"] == 40
    assert all(isinstance(v, float) for g in GROUPS for v in r["groups"][g]["seconds"].values())


def test_cli_accepts_reasons_and_rejects_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    assert "reasons" in EXPERIMENTS
    assert main(["bench", "--quiet", "--experiments", "reasons,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown experiment 'nope'" in err and "reasons" in err and "\n" not in err


def test_cli_runs_the_reasons_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--quiet", "--experiments", "reasons", "--policies", "vllm-fcfs,slidingserve",
               "--requests", "30", "--seeds", "1", "--tolerance", "0.4", "--jobs", "1", "--out", str(tmp_path)])
    assert rc == 0
    assert "Why violated requests waited" in capsys.readouterr().out
