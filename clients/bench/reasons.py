"""The ``reasons`` experiment: why violated requests waited.

Each main policy runs to completion at a fixed rate (``BenchConfig.reasons_factor`` × the
reference rate) with the simulator's reason history on (``EngineConfig.keep_reasons``):
every plan is explained (``scheduler_service.core.reasons``) and each iteration's duration
is charged to the reason code of every request it leaves waiting.  Summed over the
requests that violated their SLO (and, for comparison, over those that met it), the
seconds per code give the share of their waiting time each reason took.

Reason runs need the engine built with the flag, so they do not go through
:func:`~clients.bench.runner.run`; :func:`run_reason_jobs` runs them inline or in spawned
worker processes (the same predictor hand-over as the other jobs).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimResult, SimulatedEngine
from engine_adapter.sim.groundtruth import PROFILES, load_ground_truth
from scheduler_service.core.plan import CODES

from .runner import RunSpec, install_predictors, profile_predictor, quiet_logs

__all__ = ["GROUPS", "reason_run", "reason_seconds", "reasons_experiment", "run_reason_jobs", "simulate_with_reasons",
           "summarize_reasons"]

#: The request groups whose waiting time is broken down.
GROUPS = ("violated", "met")


def simulate_with_reasons(spec: RunSpec) -> tuple[SimulatedEngine, SimResult]:
    """One in-process run of ``spec`` with the reason history kept."""
    quiet_logs()
    predictor = profile_predictor(spec.profile)
    workload = make_workload(spec.workload, spec.n_requests, spec.rate, seed=spec.seed, burst=spec.burst,
                             slo=spec.slo, classes=spec.classes)
    profile = PROFILES[spec.profile]
    settings = AdapterSettings(policy=spec.policy, params=dict(spec.params), profile=profile.key,
                               deadline_ms=spec.deadline_ms, shed_after=spec.shed_after, report_inline=True)
    adapter = AdapterCore(InProcessBackend(settings, predictor), settings, predictor)
    try:
        config = EngineConfig(noise_seed=spec.seed, keep_reasons=True)
        engine = SimulatedEngine(workload, load_ground_truth(spec.profile), profile, adapter, config)
        result = engine.run()
    finally:
        adapter.close()
    return engine, result


def reason_seconds(result: SimResult, mask: np.ndarray) -> dict[str, float]:
    """Code → seconds the requests in ``mask`` spent waiting for it, in code order."""
    secs = result.reason_seconds or {}
    return {c: float(secs[c][mask].sum()) for c in CODES if c in secs and secs[c][mask].any()}


def reason_run(spec: RunSpec) -> dict[str, Any]:
    """One reason run (picklable in and out): per group, the requests and their seconds
    waiting per code."""
    _, result = simulate_with_reasons(spec)
    violated = result.violated
    return {
        "policy": spec.name, "base_policy": spec.policy, "seed": spec.seed, "rate_rps": spec.rate,
        "requests": result.n_requests, "violation_rate": result.violation_rate,
        "groups": {g: {"requests": int(m.sum()), "seconds": reason_seconds(result, m)}
                   for g, m in (("violated", violated), ("met", ~violated))},
    }


def run_reason_jobs(specs: Sequence[RunSpec], *, workers: int | None = 1,
                    on_done: Callable[[RunSpec, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """:func:`reason_run` over ``specs``, results in their order; ``workers`` > 1: in
    spawned processes."""
    n = min(workers or 1, len(specs))
    if n <= 1:
        out = []
        for s in specs:
            out.append(reason_run(s))
            if on_done:
                on_done(s, out[-1])
        return out
    predictors = {p: profile_predictor(p).to_json() for p in sorted({s.profile for s in specs})}
    results: list[dict[str, Any]] = [{}] * len(specs)
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=install_predictors,
                                initargs=(predictors,)) as pool:
        futures = {pool.submit(reason_run, s): i for i, s in enumerate(specs)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_done:
                on_done(specs[i], results[i])
    return results


def summarize_reasons(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs (its seeds): per group, the requests, their mean waiting seconds
    and each code's share of their waiting time (summing to 1 where they waited)."""
    first = runs[0]
    row: dict[str, Any] = {"policy": first["policy"], "base_policy": first["base_policy"],
                           "rate_rps": first["rate_rps"], "seeds": sorted(r["seed"] for r in runs),
                           "violation_rate": float(np.mean([r["violation_rate"] for r in runs]))}
    for g in GROUPS:
        n = sum(r["groups"][g]["requests"] for r in runs)
        secs: dict[str, float] = {}
        for r in runs:
            for c, s in r["groups"][g]["seconds"].items():
                secs[c] = secs.get(c, 0.0) + s
        total = sum(secs.values())
        row[g] = {"requests": n, "waited_s_mean": total / n if n else 0.0,
                  "share": {c: secs[c] / total for c in CODES if c in secs} if total > 0 else {}}
    return row


def reasons_experiment(specs: Sequence[RunSpec], order: Sequence[str], *, workers: int | None, note: str,
                       progress: Callable[[RunSpec, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``specs`` (policies × seeds) and summarize per policy, in ``order``."""
    runs = run_reason_jobs([dataclasses.replace(s, stop_violation_fraction=None) for s in specs],
                           workers=workers, on_done=progress)
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_policy.setdefault(r["policy"], []).append(r)
    return {"note": note, "rows": [summarize_reasons(by_policy[p]) for p in order if p in by_policy]}
