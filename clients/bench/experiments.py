"""The ``bench`` experiments, as two parallel phases.

Phase 1 — goodput searches, one job per (variant, seed):

* ``goodput``  the policies given (default: the four main ones);
* ``window``   ``slidingserve`` with SlidingChunker window k = 1..4;
* ``ablation`` Table 4: ``sarathi-edf`` → ``+sc`` → ``+sc+mlps`` → ``slidingserve``;
* ``margin``   ``slidingserve`` with margin 1.0, 1.05, 1.1 (default), 1.2.

Variants that are the same (policy, parameters) — ``slidingserve`` and
``slidingserve[window=2]`` — share one search.

Phase 2 — fixed-rate runs to completion (no early stop), one job per (policy, seed), at rates
relative to the *reference rate* = the best baseline's mean goodput (the most a user gets today
without SlidingServe):

* reference: every main policy at the reference rate; its TTFT/TBT samples make the CDF plots,
  so every policy is compared at the same load;
* ``overload`` at 2× each policy's *own* goodput (how gracefully each one degrades past its own
  capacity) and at 2× the reference rate (the same absolute load for all);
* ``burst``   0.8× the reference rate with a 3× burst of 10 s starting a quarter of the way
  into the arrivals (a transient overload a provisioned deployment sees);
* ``load``    1.5× the reference rate, so that violations and recompute preemptions per 1,000
  requests can be read at 1×, 1.5× and 2× for every policy (implies ``overload``);
* ``classes`` the class mix ``interactive-batch`` (critical / standard / sheddable batch) at 1×,
  1.5×, 2× and 3×, every policy plus ``vllm-priority`` (vLLM's own way to serve priorities):
  SLO attainment per class, rejections, weighted goodput;
* ``reasons`` every main policy at ``reasons_factor`` (1.5) × the reference rate with the
  simulator's reason history on: the share of violated (and met) requests' waiting time
  spent in each reason code (:mod:`clients.bench.reasons`).

``overload``, ``burst``, ``load``, ``classes`` and ``reasons`` need phase 1's main goodput, so
they imply ``goodput``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clients.workloads import CLASS_MIXES, Burst, SLOConfig
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE
from scheduler_service.core import registry

from .executor import Job, run_jobs
from .goodput import DEFAULT_TOLERANCE, TARGET_VIOLATION, GoodputSpec, initial_guess, summarize_seeds
from .reasons import reasons_experiment
from .runner import MAIN_POLICIES, OURS, RunSpec

__all__ = ["ABLATION", "EXPERIMENTS", "MARGINS", "WINDOWS", "BenchConfig", "Variant",
           "plan_variants", "run_bench"]

EXPERIMENTS = ("goodput", "overload", "burst", "load", "window", "ablation", "margin", "classes", "reasons")
ABLATION = ("sarathi-edf", "sarathi-edf+sc", "sarathi-edf+sc+mlps", "slidingserve")
WINDOWS = (1, 2, 3, 4)
MARGINS = ("1.0", "1.05", "1.1", "1.2")
#: Multiples of the reference rate of the ``classes`` experiment.
CLASS_FACTORS = (1.0, 1.5, 2.0, 3.0)
#: The baseline that serves classes the way vLLM's own priority policy does; the
#: ``classes`` experiment adds it to the compared policies.
CLASS_BASELINE = "vllm-priority"
#: ``progress(label, total)`` returns the per-job callback of one phase; None shows none.
Progress = Callable[[str, int], Callable[[Job, dict[str, Any]], None]] | None
#: Fixed-rate runs by experiment tag, then policy.
Grouped = Mapping[str, Mapping[str, list[dict[str, Any]]]]


@dataclass(frozen=True, slots=True)
class Variant:
    """A policy with parameter overrides, under a display label."""

    label: str
    policy: str
    params: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.policy, self.params


@dataclass(frozen=True, slots=True)
class BenchConfig:
    workload: str = "mixed-v1"
    profile: str = DEFAULT_PROFILE
    policies: tuple[str, ...] = MAIN_POLICIES
    transport: str = "inproc"
    n_requests: int = 1000
    seeds: int = 3
    first_seed: int = 0
    tolerance: float = DEFAULT_TOLERANCE
    experiments: tuple[str, ...] = ("goodput",)
    #: policy → {key: value} overrides, applied wherever that policy runs.
    params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    workers: int | None = None
    executor: str = "process"
    deadline_ms: float = 20.0
    #: The engine's wait bound (``--shed-after``; AdapterSettings.shed_after, 0 = off).
    shed_after: float = 0.0
    overload_factor: float = 2.0
    burst_base_fraction: float = 0.8
    burst_multiplier: float = 3.0
    burst_duration_s: float = 10.0
    #: Class mix of the ``classes`` experiment (:data:`~clients.workloads.CLASS_MIXES`).
    class_mix: str = "interactive-batch"
    #: How requests are judged (and planned for): ``"formula1"`` or ``"tpot"`` (TTFT and
    #: mean time per output token, as ``vllm bench serve --goodput`` counts).
    slo_definition: str = "formula1"
    #: Rate of the ``reasons`` experiment, as a multiple of the reference rate (the ``load``
    #: experiment's 1.5x: every policy, SlidingServe too, then has violated requests).
    reasons_factor: float = 1.5

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.seeds))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["params"] = {k: dict(v) for k, v in self.params.items()}
        return d


def _canon(policy: str, params: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Overrides without those equal to the policy's defaults, sorted: two spellings
    of one configuration must share one search."""
    defaults = {p["name"]: str(p["default"]).lower() for p in registry.describe(policy)["params"]}
    return tuple(sorted((k, str(v)) for k, v in params.items() if defaults.get(k) != str(v).lower()))


def _with_implied(experiments: tuple[str, ...]) -> set[str]:
    """``experiments`` and those ``load`` needs: its 1x and 2x runs are ``goodput``'s and ``overload``'s."""
    exps = set(experiments)
    return exps | {"goodput", "overload"} if "load" in exps else exps


def plan_variants(cfg: BenchConfig) -> dict[str, list[Variant]]:
    """The variants each goodput-type experiment compares, by experiment."""
    exps = _with_implied(cfg.experiments)

    def variant(policy: str, label: str = "", **extra: str) -> Variant:
        params = {**cfg.params.get(policy, {}), **extra}
        return Variant(label or policy, policy, _canon(policy, params))

    out: dict[str, list[Variant]] = {}
    if exps & {"goodput", "overload", "burst", "load", "classes", "reasons"}:
        out["goodput"] = [variant(p) for p in cfg.policies]
    if "window" in exps:
        out["window"] = [variant(OURS, f"{OURS}[window={k}]", window=str(k)) for k in WINDOWS]
    if "ablation" in exps:
        out["ablation"] = [variant(p) for p in ABLATION]
    if "margin" in exps:
        out["margin"] = [variant(OURS, f"{OURS}[margin={m}]", margin=m) for m in MARGINS]
    return out


def _base_spec(cfg: BenchConfig, v: Variant, seed: int, rate: float) -> RunSpec:
    return RunSpec(policy=v.policy, workload=cfg.workload, rate=rate, seed=seed, n_requests=cfg.n_requests,
                   profile=cfg.profile, transport=cfg.transport, params=v.params, label=v.label,
                   deadline_ms=cfg.deadline_ms, shed_after=cfg.shed_after,
                   slo=SLOConfig(definition=cfg.slo_definition))


def _mean(values: Iterable[float]) -> float:
    return float(np.mean(list(values)))


def _aggregate_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of a fixed-rate run's headline numbers, plus per-seed violation rates."""
    runs = sorted(runs, key=lambda r: r["seed"])

    def mean(k: str) -> float:
        vals = [r[k] for r in runs if r[k] == r[k]]  # NaN when a run produced no sample
        return float(np.mean(vals)) if vals else float("nan")

    return {
        "policy": runs[0]["policy"],
        "rate_rps": runs[0]["rate_rps"],
        "seeds": [r["seed"] for r in runs],
        "violation_rate": mean("violation_rate"),
        "violation_rate_by_seed": [r["violation_rate"] for r in runs],
        "completed_fraction": _mean(r["completed"] / r["requests"] for r in runs),
        **{k: mean(k) for k in ("ttft_p50_s", "ttft_p99_s")},
        "ttft_max_s": max((r["ttft_max_s"] for r in runs if r["ttft_max_s"] == r["ttft_max_s"]),
                          default=float("nan")),
        **{k: mean(k) for k in ("rejected", "tbt_p50_s", "tbt_p99_s", "throughput_rps", "preemptions",
                                "decision_us_p50", "decision_us_p99")},
        "fallback_decisions": int(sum(r["fallback_decisions"] for r in runs)),
        "burst": runs[0].get("burst"),
    }


def run_bench(cfg: BenchConfig, progress: Progress = None) -> dict[str, Any]:
    """Run the configured experiments; a JSON-ready dict."""
    t0 = time.perf_counter()
    by_exp = plan_variants(cfg)
    guess = initial_guess(cfg.workload, cfg.profile)
    unique: dict[Any, Variant] = {}
    for v in itertools.chain.from_iterable(by_exp.values()):
        unique.setdefault(v.key, v)
    keys = [v.key for v in unique.values() for _ in cfg.seed_list]
    searches = run_jobs(
        [GoodputSpec(_base_spec(cfg, v, seed, guess), guess=guess, tolerance=cfg.tolerance)
         for v in unique.values() for seed in cfg.seed_list],
        workers=cfg.workers, executor=cfg.executor,
        on_done=progress("goodput searches", len(keys)) if progress else None)
    by_key: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for key, res in zip(keys, searches, strict=True):
        by_key[key].append(res)

    out: dict[str, Any] = {
        "settings": cfg.to_dict(),
        "target_violation": TARGET_VIOLATION,
        "tolerance": cfg.tolerance,
        "search": (f"start {guess:.3f} rps, ×1.5 bracketing, bisection until (hi-lo)/lo <= "
                   f"{cfg.tolerance:g}; goodput = highest passing rate; probes stop early once "
                   f">{TARGET_VIOLATION:.0%} violate"),
        "initial_guess_rps": guess,
        "slo": dataclasses.asdict(SLOConfig(definition=cfg.slo_definition)),
    }
    for exp, vs in by_exp.items():
        out[exp] = [summarize_seeds(by_key[v.key]) | {"policy": v.label, "base_policy": v.policy,
                                                      "params": dict(v.params)} for v in vs]
    out["searches"] = searches
    if out.get("goodput"):
        out.update(_phase2(cfg, out["goodput"], _with_implied(cfg.experiments), progress))
    out["wall_s"] = time.perf_counter() - t0
    return out


def _reference(main: list[dict[str, Any]]) -> tuple[float, str]:
    baselines = [r for r in main if r["base_policy"] != OURS]
    if baselines:
        best = max(baselines, key=lambda r: r["goodput_rps"])
        return best["goodput_rps"], f"best baseline's mean goodput ({best['policy']})"
    low = min(main, key=lambda r: r["goodput_rps"])
    return low["goodput_rps"], f"lowest mean goodput among the policies ({low['policy']})"


def _phase2(cfg: BenchConfig, main: list[dict[str, Any]], exps: set[str], progress: Progress
            ) -> dict[str, Any]:
    ref, basis = _reference(main)
    out: dict[str, Any] = {"reference": {"rate_rps": ref, "basis": basis}}
    if ref <= 0:
        out["reference"]["note"] = "no baseline passed at any rate: fixed-rate runs skipped"
        return out
    variants = {r["policy"]: Variant(r["policy"], r["base_policy"], tuple(sorted(r["params"].items())))
                for r in main}
    jobs, tags = _phase2_jobs(cfg, main, exps, variants, ref)
    results = run_jobs(jobs, workers=cfg.workers, executor=cfg.executor,
                       on_done=progress("fixed-rate runs", len(jobs)) if progress else None)
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for tag, res in zip(tags, results, strict=True):
        grouped[tag][res["policy"]].append(res)
    out.update(_phase2_sections(cfg, exps, grouped, [r["policy"] for r in main], ref, basis))
    if "reasons" in exps:
        out["reasons"] = _reasons(cfg, list(variants.values()), ref, basis, progress)
    out["runs"] = [{k: v for k, v in r.items() if not k.endswith("_samples_s") and k != "classes"}
                   | {"experiment": t} for t, r in zip(tags, results, strict=True)]
    return out


def _phase2_jobs(cfg: BenchConfig, main: list[dict[str, Any]], exps: set[str], variants: dict[str, Variant],
                 ref: float) -> tuple[list[Job], list[str]]:
    """The fixed-rate runs of the experiments in ``exps``, each with its experiment's tag."""
    jobs: list[Job] = []
    tags: list[str] = []

    def add(tag: str, v: Variant, rate: float, **kw: Any) -> None:
        for seed in cfg.seed_list:
            jobs.append(dataclasses.replace(_base_spec(cfg, v, seed, rate), **kw))
            tags.append(tag)

    for r in main:
        v = variants[r["policy"]]
        if "goodput" in exps:
            add("reference", v, ref, keep_latencies=True)
        if "overload" in exps:
            if r["goodput_rps"] > 0:
                add("overload_own", v, cfg.overload_factor * r["goodput_rps"])
            add("overload_common", v, cfg.overload_factor * ref)
        if "load" in exps:
            add("load", v, 1.5 * ref)
        if "burst" in exps:
            add("burst", v, cfg.burst_base_fraction * ref, burst=_burst(cfg, ref))
    if "classes" in exps:
        for v in _class_variants(cfg, variants):
            for f in CLASS_FACTORS:
                add(f"classes {f:g}x", v, f * ref, classes=cfg.class_mix)
    return jobs, tags


def _burst(cfg: BenchConfig, ref: float) -> Burst:
    """``burst``'s extra arrivals, from a quarter of the way into those at its base rate."""
    start_s = 0.25 * cfg.n_requests / (cfg.burst_base_fraction * ref)
    return Burst(start_s=start_s, duration_s=cfg.burst_duration_s, multiplier=cfg.burst_multiplier)


def _phase2_sections(cfg: BenchConfig, exps: set[str], grouped: Grouped, order: list[str], ref: float,
                     basis: str) -> dict[str, Any]:
    """The report's sections of the fixed-rate experiments, from their runs by tag and policy."""
    out: dict[str, Any] = {}

    def rows(tag: str) -> list[dict[str, Any]]:
        return [_aggregate_runs(grouped[tag][p]) for p in order if grouped[tag].get(p)]

    if "goodput" in exps:
        out["at_reference"] = rows("reference")
        out["latency_samples"] = {
            p: {"ttft_s": [x for r in grouped["reference"][p] for x in r["ttft_samples_s"]],
                "tbt_s": [x for r in grouped["reference"][p] for x in r["tbt_samples_s"]]}
            for p in order if grouped["reference"].get(p)
        }
    if "overload" in exps:
        out["overload"] = {
            "note": (f"violation rate of runs to completion at {cfg.overload_factor:g}x each policy's own "
                     f"mean goodput (own) and at {cfg.overload_factor:g}x the reference rate {ref:.3f} rps "
                     f"= {basis} (common)"),
            "own": rows("overload_own"),
            "common": rows("overload_common"),
        }
    if "burst" in exps:
        out["burst"] = {
            "note": (f"base {cfg.burst_base_fraction * ref:.3f} rps = {cfg.burst_base_fraction:g}x the "
                     f"reference rate ({basis}), {cfg.burst_multiplier:g}x burst for "
                     f"{cfg.burst_duration_s:g} s from {_burst(cfg, ref).start_s:.1f} s"),
            "rows": rows("burst"),
        }
    if "load" in exps:
        out["load"] = _load_section(cfg, grouped, order, ref, basis)
    if "classes" in exps:
        out["classes"] = _class_rows(cfg, grouped, ref, basis)
    return out


def _load_section(cfg: BenchConfig, grouped: Grouped, order: list[str], ref: float, basis: str
                  ) -> dict[str, Any]:
    """Preemptions and violations per 1,000 requests at 1x, 1.5x and the overload factor."""
    by_factor = {1.0: grouped["reference"], 1.5: grouped["load"],
                 cfg.overload_factor: grouped["overload_common"]}

    def cell(f: float, runs: list[dict[str, Any]]) -> dict[str, float]:
        return {"rate_rps": f * ref, "violations_per_1000": 1000 * _mean(r["violation_rate"] for r in runs),
                "preemptions_per_1000": 1000 * _mean(r["preemptions"] / r["requests"] for r in runs)}

    return {
        "note": f"runs to completion at 1x, 1.5x and {cfg.overload_factor:g}x the reference rate "
                f"{ref:.3f} rps = {basis}; preemptions and violated requests per 1,000 requests, "
                "mean over seeds",
        "rows": [{"policy": p, **{f"{f:g}x": cell(f, by_factor[f][p]) for f in sorted(by_factor)
                                  if by_factor[f].get(p)}} for p in order],
    }


def _reasons(cfg: BenchConfig, variants: list[Variant], ref: float, basis: str, progress: Progress
             ) -> dict[str, Any]:
    """The ``reasons`` experiment at ``cfg.reasons_factor`` × the reference rate."""
    rate = cfg.reasons_factor * ref
    specs = [_base_spec(cfg, v, seed, rate) for v in variants for seed in cfg.seed_list]
    note = (f"runs to completion at {cfg.reasons_factor:g}x the reference rate {ref:.3f} rps = {basis}, "
            "every plan explained; share of the waiting time (iterations a request was in the system and "
            "not fully served) spent per reason code, summed over seeds")
    return reasons_experiment(specs, [v.label for v in variants], workers=cfg.workers, note=note,
                              progress=progress("reason runs", len(specs)) if progress else None)


def _class_variants(cfg: BenchConfig, variants: Mapping[str, Variant]) -> list[Variant]:
    """The compared policies, with vLLM's priority baseline beside vLLM's default."""
    out = list(variants.values())
    if CLASS_BASELINE not in variants:
        params = _canon(CLASS_BASELINE, cfg.params.get(CLASS_BASELINE, {}))
        at = next((k + 1 for k, v in enumerate(out) if v.policy == "vllm-fcfs"), 0)
        out.insert(at, Variant(CLASS_BASELINE, CLASS_BASELINE, params))
    return out


def _class_rows(cfg: BenchConfig, grouped: Grouped, ref: float, basis: str) -> dict[str, Any]:
    """Per policy and load: each class's SLO attainment and rejections, the weighted goodput."""
    mix = CLASS_MIXES[cfg.class_mix]
    rows = []
    for p in grouped[f"classes {CLASS_FACTORS[0]:g}x"]:
        row: dict[str, Any] = {"policy": p}
        for f in CLASS_FACTORS:
            if runs := grouped[f"classes {f:g}x"].get(p):
                row[f"{f:g}x"] = {
                    "rate_rps": f * ref,
                    "weighted_goodput_rps": _mean(r["weighted_goodput_rps"] for r in runs),
                    "classes": {c.name: {
                        "attainment": _mean(r["classes"][c.name]["attainment"] for r in runs),
                        "attainment_by_seed": [r["classes"][c.name]["attainment"] for r in runs],
                        "rejected_per_1000": 1000 * _mean(r["classes"][c.name]["rejected"] / r["requests"]
                                                          for r in runs),
                    } for c in mix.classes},
                }
        rows.append(row)
    desc = ", ".join(f"{c.name} {c.fraction:.0%} (priority {c.priority}"
                     f"{', sheddable' if c.sheddable else ''}"
                     f"{f', TTFT x{c.ttft_scale:g}' if c.ttft_scale != 1 else ''}"
                     f"{f', TBT x{c.tbt_scale:g}' if c.tbt_scale != 1 else ''}"
                     f"{f', end to end {c.e2e_s:g} s' if c.e2e_s else ''}, weight {c.weight:g})"
                     for c in mix.classes)
    return {"note": (f"class mix {cfg.class_mix}: {desc}; runs to completion at "
                     f"{', '.join(f'{f:g}x' for f in CLASS_FACTORS)} the reference rate {ref:.3f} rps = "
                     f"{basis}; "
                     "SLO attainment per class and weighted goodput (weight x met requests per second), "
                     "mean over seeds"),
            "mix": cfg.class_mix, "factors": list(CLASS_FACTORS), "classes": [c.name for c in mix.classes],
            "rows": rows}
