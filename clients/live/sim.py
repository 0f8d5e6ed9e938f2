"""Sim-to-real: the live sweep's workloads replayed in the simulated engine, with the live
engine's own cost model as the ground truth.

The ground truth is the predictor the scheduling service fitted on the live engine's
iteration reports during the sweep (``engine_predictor.json``), times mean-one lognormal
noise; the simulated engine has the live run's token budget and sequence limit.  Every
configuration's policy replays the same requests at the same arrival times (vLLM's own
scheduler as ``vllm-fcfs``, the project's model of it), starting, like the live engine,
from the bundled default predictor and refitting online.  The records have the live runs'
keys, so the report puts the two curves side by side.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES
from scheduler_service.core import BatchLatencyPredictor, default_predictor

from .measure import RequestResult, summarize
from .runner import Config, LiveSpec
from .workload import make_requests

__all__ = ["FittedTruth", "cost_structure", "simulate_sweep"]


class FittedTruth:
    """Iteration latency (ms) from a predictor fitted on a live engine, with mean-one
    lognormal noise of spread ``noise_sigma`` (the simulated engine's ground-truth interface)."""

    def __init__(self, predictor: BatchLatencyPredictor, noise_sigma: float = 0.15) -> None:
        self.predictor = predictor
        self.noise_sigma = float(noise_sigma)

    def iteration_ms(self, c: np.ndarray, u: np.ndarray, rng: np.random.Generator | None = None) -> float:
        c = np.asarray(c, dtype=np.int64)
        u = np.asarray(u, dtype=np.int64)
        live = c > 0
        if not live.any():
            return 0.0
        t = max(float(self.predictor.predict_batch_ms(c[live], u[live])), 0.05)
        if rng is not None:
            s = self.noise_sigma
            t *= math.exp(s * rng.standard_normal() - 0.5 * s * s)
        return t


def cost_structure(p: BatchLatencyPredictor) -> dict[str, float]:
    """What an iteration of the engine costs, read off a fitted predictor (ms): a lone
    decode on a 256-token context, each more decode, each prefill token of a 256 → 512 chunk,
    a 512-token prefill alone."""
    one = float(p.predict_batch_ms(np.array([1]), np.array([256])))
    many = float(p.predict_batch_ms(np.ones(32, np.int64), np.full(32, 256)))
    p256 = float(p.predict_batch_ms(np.array([256]), np.array([0])))
    p512 = float(p.predict_batch_ms(np.array([512]), np.array([0])))
    return {"one_decode_ms": one, "per_decode_ms": (many - one) / 31, "per_prefill_token_ms": (p512 - p256) / 256,
            "prefill_512_ms": p512}


def _policy(c: Config) -> tuple[str, dict[str, str]]:
    return ("vllm-fcfs", {}) if c.mode == "native" else (c.policy, dict(c.params))


def simulate_run(spec: LiveSpec, c: Config, rate: float, seed: int, truth: FittedTruth) -> dict[str, Any]:
    reqs = make_requests(spec.workload, rate, seed)
    n = len(reqs)
    slo = spec.slo
    w = Workload(arrival=np.array([r.at_s for r in reqs]),
                 prompt_tokens=np.array([len(r.prompt) for r in reqs], np.int64),
                 output_tokens=np.array([r.output_len for r in reqs], np.int64),
                 ttft_slo=np.full(n, slo.ttft_ms / 1e3), tbt_slo=np.full(n, slo.tbt_ms / 1e3),
                 protected=np.zeros(n, bool), name=f"live-{rate:g}-{seed}",
                 tpot_slo=np.full(n, slo.tbt_ms / 1e3) if c.objective == "tpot" else None)
    policy, params = _policy(c)
    settings = AdapterSettings(policy=policy, params=params, profile=DEFAULT_PROFILE, report_inline=True)
    pred = default_predictor()
    adapter = AdapterCore(InProcessBackend(settings, pred), settings, pred)
    profile = dataclasses.replace(PROFILES[DEFAULT_PROFILE], key="live-sim")
    cfg = EngineConfig(max_batch_tokens=spec.engine.max_num_batched_tokens, max_num_seqs=spec.engine.max_num_seqs,
                       noise_seed=seed)
    try:
        eng = SimulatedEngine(w, truth, profile, adapter, cfg)  # type: ignore[arg-type]
        eng.run()
    finally:
        adapter.close()
    results = []
    for r in reqs:
        if r.warmup:
            continue
        i = r.index
        res = RequestResult(i, float(w.arrival[i]), r.output_len)
        if eng.done[i] and not eng.rejected[i] and not math.isnan(eng.first_token[i]):
            res.token_times = _token_times(float(eng.first_token[i]), float(eng.last_token[i]), r.output_len)
        else:
            res.error = "not finished in the simulation"
        results.append(res)
    s = summarize(results, slo)
    # formula (1) from the engine's own per-token check (token times in between are not kept)
    f1 = sum(1 for r in reqs if not r.warmup and eng.done[r.index] and not eng.rejected[r.index]
             and not eng.late_f1[r.index]) / len(results)
    return {"config": c.label, "mode": c.mode, "policy": policy, "rate": rate, "seed": seed,
            **{**s.to_dict(), "attain_f1": f1}, "source": "sim"}


def _token_times(first: float, last: float, n: int) -> list[float]:
    """The first and last token exact, evenly spread between: enough for TTFT and TPOT."""
    return list(np.linspace(first, last, n)) if n > 1 else [first]


def simulate_sweep(spec: LiveSpec, predictor: BatchLatencyPredictor, noise_sigma: float,
                   configs: Sequence[Config] | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> list[dict[str, Any]]:
    from clients.bench.runner import quiet_logs

    quiet_logs()  # one refit log line per few hundred iterations otherwise
    truth = FittedTruth(predictor, noise_sigma)
    todo = [(rate, seed, c) for rate, seed, c in spec.order() if configs is None or c in configs]
    out = []
    for i, (rate, seed, c) in enumerate(todo, 1):
        out.append(simulate_run(spec, c, rate, seed, truth))
        if progress is not None:
            progress(i, len(todo), f"{c.label} at {rate:g} req/s, seed {seed} (simulated)")
    return out
