"""Fidelity checks of the simulated GPU (issue 3), shared by tests and benchmark.

(1) :func:`qoserve_gap`: the ground truth for A100 Llama-3-8B TP1 against the
linear batch-time model that the public QoServe scheduler hard-codes, fitted on
real runs of that setup (microsoft/sarathi-serve, branch ``niyama_asplos2026``,
commit 72339db5, ``sarathi/core/scheduler/deadline_scheduler.py::
_predict_batch_time``).  Only its published coefficients are used here; the
formula is restated from them, no code is copied.

(2) :func:`predictor_fidelity`: the seven-feature predictor fitted on a
profiling sweep, evaluated on held-out batches from an independent seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler_service.core import evaluate

from .groundtruth import DEFAULT_PROFILE, load_ground_truth
from .profiling import fit_profile_predictor, profiling_sweep

__all__ = ["GapReport", "predictor_fidelity", "qoserve_gap", "qoserve_reference_ms", "typical_batches"]

QOSERVE_PROFILE = "a100-tp1-llama3-8b"
#: (num_tokens, prefill_tokens, decode_tokens, decode_context, prefill_context, intercept), seconds.
_QOSERVE_SMALL = (5.882475e-05, 2.247956e-05, 3.634519e-05, 1.111258e-07, 7.554773e-07, 0.014936)
_QOSERVE_LARGE = (2.719050e-05, 6.863043e-05, -4.143993e-05, 1.663409e-07, 2.727223e-06, 0.005004)
_QOSERVE_SPLIT = 512


def qoserve_reference_ms(c: np.ndarray, u: np.ndarray) -> float:
    """QoServe's fitted batch time (ms): two linear bins split at 512 tokens.

    decode_context = Σ over decodes of their context; prefill_context = tokens
    already processed of the first prefill in the batch.
    """
    c = np.asarray(c, dtype=np.int64)
    u = np.asarray(u, dtype=np.int64)
    p, d = c > 1, c == 1
    num = float(c.sum())
    pre = float(c[p].sum())
    dec = float(d.sum())
    dctx = float(u[d].sum())
    pctx = float(u[p][0]) if p.any() else 0.0
    k = _QOSERVE_SMALL if num <= _QOSERVE_SPLIT else _QOSERVE_LARGE
    s = k[0] * num + k[1] * pre + k[2] * dec + k[3] * dctx + k[4] * pctx + k[5]
    return s * 1e3


def typical_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """Decodes {0, 8, 32, 64, 128} × decode context {256, 1024, 2048} × one
    prefill chunk {0, 128, 256, 512, 1024, 2048} × its cached prefix {0, 1024};
    the empty batch is skipped (duplicates of the no-prefill case are kept once)."""
    out = []
    for nd in (0, 8, 32, 64, 128):
        for dctx in (256, 1024, 2048):
            for chunk in (0, 128, 256, 512, 1024, 2048):
                for pctx in (0, 1024):
                    if (nd == 0 and chunk == 0) or (chunk == 0 and pctx):
                        continue
                    if nd == 0 and dctx != 256:
                        continue  # no decodes: decode context is irrelevant
                    c = [1] * nd + ([chunk] if chunk else [])
                    u = [dctx] * nd + ([pctx] if chunk else [])
                    out.append((np.array(c), np.array(u)))
    return out


@dataclass(frozen=True, slots=True)
class GapReport:
    n: int
    median_abs_gap: float
    #: Median of (gt − qoserve) / qoserve: < 0 when the ground truth is faster.
    median_signed_gap: float
    p90_abs_gap: float
    by_bin: dict[str, float]


def qoserve_gap(key: str = QOSERVE_PROFILE) -> GapReport:
    """Relative gap |gt − qoserve| / qoserve over :func:`typical_batches`."""
    gt = load_ground_truth(key)
    batches = typical_batches()
    g = np.array([gt.iteration_ms(c, u) for c, u in batches])
    q = np.array([qoserve_reference_ms(c, u) for c, u in batches])
    rel = (g - q) / q
    small = np.array([c.sum() <= _QOSERVE_SPLIT for c, _ in batches])
    return GapReport(
        n=len(batches),
        median_abs_gap=float(np.median(np.abs(rel))),
        median_signed_gap=float(np.median(rel)),
        p90_abs_gap=float(np.quantile(np.abs(rel), 0.9)),
        by_bin={"<=512": float(np.median(np.abs(rel[small]))), ">512": float(np.median(np.abs(rel[~small])))},
    )


def predictor_fidelity(key: str = DEFAULT_PROFILE, n_train: int = 3000, n_test: int = 1500,
                       seed: int = 0) -> dict[str, dict[str, float]]:
    """MAE/RMSE (ms) and R² per scenario of the fitted predictor on held-out,
    noisy batches (test seed differs from the training seed)."""
    pred = fit_profile_predictor(key, n=n_train, seed=seed)
    test = profiling_sweep(key, n=n_test, seed=seed + 10_000)
    return evaluate(pred, test.features, test.scenario, test.latency_ms)
