"""Offline profiling sweep: time random batches on the ground truth, fit the predictor.

This is what Vidur and the paper do before serving: run a few thousand
synthetic batches on the GPU, record (batch, measured latency), and fit the
seven-feature linear model (formulas (4)–(6), docs/architecture.md).  Here the
"GPU" is :class:`~engine_adapter.sim.groundtruth.GroundTruth` with its noise;
the predictor only ever sees features and noisy latencies, never the model
behind them.

Batch mix (equal thirds, so every scenario model has plenty of samples):

* decode-only: 1–256 decodes;
* prefill-only: 1–4 prefill chunks (one most often), chunk sizes log-uniform in
  2–4096 (decodes are the c = 1 case), half of them starting from an empty
  cache, the others continuing after up to max_model_len − c cached tokens;
* mixed: both of the above in one batch.

Decode contexts are uniform in 0–4096 (clipped to the model's context).  The
total prefill tokens of a batch are capped at 4096, like a vLLM/Sarathi
``max_num_batched_tokens`` budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_service.core import BatchLatencyPredictor, batch_features, evaluate, fit_predictor

from .groundtruth import DEFAULT_PROFILE, GroundTruth, load_ground_truth

__all__ = [
    "ProfilingData",
    "fit_profile_predictor",
    "profile_predictor_with_holdout",
    "profiling_sweep",
    "random_batches",
]

MAX_DECODES = 256
MAX_CONTEXT = 4096
MAX_CHUNK = 4096
MAX_PREFILL_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class ProfilingData:
    """Samples of a sweep: features (N, 7), scenario codes (N,), latencies (N,) in ms."""

    features: np.ndarray
    scenario: np.ndarray
    latency_ms: np.ndarray

    def __len__(self) -> int:
        return len(self.latency_ms)


def _prefills(rng: np.random.Generator, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    k = int(rng.choice([1, 1, 1, 2, 3, 4]))
    c = np.exp(rng.uniform(np.log(2), np.log(MAX_CHUNK), k)).astype(np.int64)
    c = np.clip(c, 2, max_len - 1)
    # Budget cap: keep chunks in order until 4096 tokens, truncating the last one.
    room = MAX_PREFILL_TOKENS - np.concatenate(([0], np.cumsum(c)[:-1]))
    c = np.minimum(c, room)
    c = c[c >= 2]
    fresh = rng.random(len(c)) < 0.5
    u = np.where(fresh, 0, rng.integers(0, np.maximum(max_len - c, 1)))
    return c, u


def _decodes(rng: np.random.Generator, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(1, MAX_DECODES + 1))
    u = rng.integers(0, min(MAX_CONTEXT, max_len - 1) + 1, n)
    return np.ones(n, dtype=np.int64), u


def random_batches(n: int, rng: np.random.Generator, max_model_len: int = MAX_CONTEXT
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """n random batches (c, u), cycling decode-only, prefill-only and mixed."""
    out = []
    for i in range(n):
        kind = i % 3
        parts = []
        if kind != 1:
            parts.append(_decodes(rng, max_model_len))
        if kind != 0:
            parts.append(_prefills(rng, max_model_len))
        c = np.concatenate([p[0] for p in parts])
        u = np.concatenate([p[1] for p in parts])
        out.append((c, u))
    return out


def profiling_sweep(gt: GroundTruth | str = DEFAULT_PROFILE, n: int = 3000, seed: int = 0) -> ProfilingData:
    """Time n random batches on the ground truth with its noise (seeded)."""
    if isinstance(gt, str):
        gt = load_ground_truth(gt)
    rng = np.random.default_rng(seed)
    batches = random_batches(n, rng, gt.profile.max_model_len)
    lat = gt.batch_ms(batches, rng)
    feats = np.empty((n, 7))
    scen = np.empty(n, dtype=np.int8)
    for i, (c, u) in enumerate(batches):
        feats[i], scen[i] = batch_features(c, u)
    return ProfilingData(feats, scen, lat)


def fit_profile_predictor(key: str = DEFAULT_PROFILE, n: int = 3000, seed: int = 0) -> BatchLatencyPredictor:
    """Fit the seven-feature predictor from a seeded profiling sweep of ``key``."""
    data = profiling_sweep(key, n=n, seed=seed)
    return fit_predictor(
        data.features, data.scenario, data.latency_ms,
        meta={"source": "profiling-sweep", "profile": key, "n": n, "seed": seed},
    )


def profile_predictor_with_holdout(
    key: str = DEFAULT_PROFILE, n: int = 3000, seed: int = 0
) -> tuple[BatchLatencyPredictor, dict[str, dict[str, float]]]:
    """:func:`fit_profile_predictor` plus its errors on a second sweep (seed + 1)
    of the same size; the errors are recorded in the predictor's ``meta``."""
    pred = fit_profile_predictor(key, n=n, seed=seed)
    held = profiling_sweep(key, n=n, seed=seed + 1)
    metrics = evaluate(pred, held.features, held.scenario, held.latency_ms)
    meta: dict[str, Any] = {
        **pred.meta,
        "source": (
            f"profiling sweep of the simulated {key} engine (engine_adapter/sim/groundtruth.py over the "
            f"Vidur A100 profiles): {n} random batches, seed {seed}, monotone fit; regenerate with "
            f"`slidingserve predictor sweep --profile {key} --samples {n} --seed {seed}` (make default-predictor)"
        ),
        "holdout": {
            "seed": seed + 1,
            **{k: {"mae_ms": round(v["mae_ms"], 3), "r2": round(v["r2"], 4)} for k, v in metrics.items()},
        },
    }
    return BatchLatencyPredictor(scenarios=pred.scenarios, global_model=pred.global_model, meta=meta), metrics
