"""Goodput: the highest Poisson request rate at which at most 1% of requests violate their SLO.

The search, for one (policy, workload, profile, seed):

1. start from a guess derived from the profile's ground truth and the
   workload's mean lengths (:func:`initial_guess`), so every profile and
   workload starts near its own capacity rather than at a fixed number;
2. bracket: multiply the rate by 1.5 while probes pass (or divide while they
   fail) until one passing and one failing rate are known;
3. bisect until ``(hi − lo) / lo ≤ tolerance`` (default 5%).

The reported goodput is ``lo``, the highest rate whose probe *passed*: the
true threshold lies in ``[lo, hi]`` and ``hi ≤ lo·(1 + tolerance)``.
Each probe runs with ``stop_violation_fraction`` = the target, so a failing
probe stops as soon as the target is exceeded, which is most of the search's
saving.  Every seed draws its own workload sample and latency noise; the same
seed is reused across the rates of one search (common random numbers), which
keeps pass/fail close to monotone in the rate, as bisection assumes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from clients.workloads import make_workload
from engine_adapter.sim.groundtruth import load_ground_truth

from .runner import RunSpec, run

__all__ = [
    "GoodputSpec",
    "Probe",
    "SearchResult",
    "goodput_job",
    "initial_guess",
    "search_goodput",
    "summarize_seeds",
]

TARGET_VIOLATION = 0.01
DEFAULT_TOLERANCE = 0.05
GROWTH = 1.5


@dataclass(frozen=True, slots=True)
class Probe:
    rate: float
    violation_rate: float
    passed: bool
    #: The run stopped once the target was exceeded.  Its violation_rate then counts
    #: every unfinished request as violated: all it says is "above the target".
    stopped_early: bool = False
    wall_s: float = 0.0
    iterations: int = 0
    fallback_decisions: int = 0


@dataclass(frozen=True, slots=True)
class SearchResult:
    #: Highest passing rate (0.0 when no probe passed).
    goodput_rps: float
    lo: float | None
    hi: float | None
    converged: bool
    probes: tuple[Probe, ...]


def search_goodput(probe: Callable[[float], Probe], guess: float, tolerance: float = DEFAULT_TOLERANCE,
                   growth: float = GROWTH, max_probes: int = 40, min_rate: float | None = None,
                   max_rate: float | None = None) -> SearchResult:
    """Exponential bracketing from ``guess`` (×/÷ ``growth``), then bisection until the
    bracket is within ``tolerance`` relative to its lower end.

    Gives up (``converged=False``) after ``max_probes`` probes, when even
    ``min_rate`` (default guess/1000) fails — a configuration no rate
    satisfies — or when ``max_rate`` (default 100 × guess) passes: a trace so
    short that the policy serves it within its SLOs even when every request
    arrives at once has no finite goodput, and the search reports the cap.
    """
    if guess <= 0 or tolerance <= 0 or growth <= 1:
        raise ValueError("guess and tolerance must be > 0 and growth > 1")
    floor = guess / 1000 if min_rate is None else min_rate
    cap = guess * 100 if max_rate is None else max_rate
    lo: float | None = None
    hi: float | None = None
    probes: list[Probe] = []
    rate = guess
    converged = False
    while len(probes) < max_probes:
        p = probe(rate)
        probes.append(p)
        if p.passed:
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        if lo is None:
            assert hi is not None
            if hi <= floor:
                break
            rate = max(hi / growth, floor)
        elif hi is None:
            if lo >= cap:
                break
            rate = min(lo * growth, cap)
        elif hi - lo <= tolerance * lo:
            converged = True
            break
        else:
            rate = (lo + hi) / 2
    return SearchResult(lo or 0.0, lo, hi, converged, tuple(probes))


def initial_guess(workload: str, profile: str, factor: float = 1.3) -> float:
    """A capacity estimate from the ground truth, times ``factor``.

    Per request: its mean prompt at the per-token cost of a full 2,048-token
    prefill iteration, plus its mean output at the per-token cost of a
    64-request decode iteration at mid-generation context.  Real decode
    batches are often larger, so this underestimates capacity; ``factor``
    lifts it so that the first probe lands a little *above* goodput (on
    mixed-v1 / A100 TP2 the estimate is 2.7 rps and goodput about 3): a failing
    probe stops early and is cheap, a passing one at low rate runs a long
    trace of near-empty iterations.  Only the number of probes depends on the
    guess, not the result.
    """
    w = make_workload(workload, 2000, 1.0, seed=0)
    gt = load_ground_truth(profile)
    prompt, output = float(np.mean(w.prompt_tokens)), float(np.mean(w.output_tokens))
    prefill_ms = gt.iteration_ms(np.array([2048]), np.array([0])) / 2048
    ctx = min(prompt + output / 2, gt.profile.max_model_len - 1)
    batch = 64
    decode_ms = gt.iteration_ms(np.ones(batch, dtype=np.int64), np.full(batch, int(ctx))) / batch
    return factor * 1000.0 / (prompt * prefill_ms + output * decode_ms)


@dataclass(frozen=True, slots=True)
class GoodputSpec:
    """One goodput search (one seed); ``run.rate`` is ignored."""

    run: RunSpec
    guess: float
    tolerance: float = DEFAULT_TOLERANCE
    target: float = TARGET_VIOLATION
    max_probes: int = 40


def _probe_fn(spec: GoodputSpec) -> Callable[[float], Probe]:
    template = dataclasses.replace(spec.run, stop_violation_fraction=spec.target, keep_latencies=False)

    def probe(rate: float) -> Probe:
        s = run(template.with_rate(rate))
        return Probe(
            rate=rate,
            violation_rate=s["violation_rate"],
            passed=s["violation_rate"] <= spec.target + 1e-12,
            stopped_early=s["stopped_early"],
            wall_s=s["wall_s"],
            iterations=s["iterations"],
            fallback_decisions=s["fallback_decisions"],
        )

    return probe


def goodput_job(spec: GoodputSpec) -> dict[str, Any]:
    """Run one search; a JSON-ready dict with the probes."""
    t0 = time.perf_counter()
    res = search_goodput(_probe_fn(spec), spec.guess, spec.tolerance, max_probes=spec.max_probes)
    r = spec.run
    return {
        "policy": r.name,
        "base_policy": r.policy,
        "params": dict(r.params),
        "workload": r.workload,
        "profile": r.profile,
        "transport": r.transport,
        "n_requests": r.n_requests,
        "seed": r.seed,
        "goodput_rps": res.goodput_rps,
        "bracket": [res.lo, res.hi],
        "converged": res.converged,
        "tolerance": spec.tolerance,
        "target_violation": spec.target,
        "guess_rps": spec.guess,
        "probes": [dataclasses.asdict(p) for p in res.probes],
        "wall_s": time.perf_counter() - t0,
    }


def summarize_seeds(searches: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate the searches of one variant over seeds: mean, per-seed, std, min/max."""
    if not searches:
        raise ValueError("no searches to summarize")
    searches = sorted(searches, key=lambda s: s["seed"])
    g = np.array([s["goodput_rps"] for s in searches], dtype=np.float64)
    first = searches[0]
    return {
        "policy": first["policy"],
        "base_policy": first["base_policy"],
        "params": first["params"],
        "workload": first["workload"],
        "profile": first["profile"],
        "transport": first["transport"],
        "n_requests": first["n_requests"],
        "seeds": [s["seed"] for s in searches],
        "goodput_rps": float(g.mean()),
        "goodput_rps_by_seed": [float(x) for x in g],
        "goodput_rps_std": float(g.std(ddof=1)) if len(g) > 1 else 0.0,
        "goodput_rps_min": float(g.min()),
        "goodput_rps_max": float(g.max()),
        "converged": all(s["converged"] for s in searches),
        "tolerance": first["tolerance"],
        "target_violation": first["target_violation"],
        "probes": sum(len(s["probes"]) for s in searches),
        "fallback_decisions": sum(p["fallback_decisions"] for s in searches for p in s["probes"]),
        "search_wall_s": sum(s["wall_s"] for s in searches),
    }
