"""Turn a policy's choice into a :class:`Plan` (shared by every policy)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import repeat

import numpy as np

from .plan import Allocation, Plan
from .policy import Policy
from .predictor import BatchLatencyPredictor, batch_features
from .snapshot import Snapshot

__all__ = ["assemble_plan", "in_queue_order"]


def in_queue_order(chosen: Iterable[int], queue: np.ndarray) -> list[int]:
    """``chosen`` snapshot indices sorted by their position in ``queue``."""
    c = np.fromiter(chosen, dtype=np.int64)
    pos = np.flatnonzero(np.isin(queue, c))
    return queue[pos].tolist()


def assemble_plan(
    policy: Policy,
    snap: Snapshot,
    predictor: BatchLatencyPredictor,
    decodes: np.ndarray,
    pre_alloc: list[tuple[int, int]],
    path: str,
    t0: int,
    breakdown_ns: dict[str, int],
    predicted_ms: float | None = None,
) -> Plan:
    """Build the plan and predict the latency of exactly the batch it names
    (``predicted_ms`` when the caller already knows it)."""
    idx = decodes.tolist() + [i for i, _ in pre_alloc]
    tok = [1] * len(decodes) + [t for _, t in pre_alloc]
    if predicted_ms is not None:
        pred = predicted_ms
    elif idx:
        c = np.array(tok, dtype=np.float64)
        u = snap.kv_tokens[np.array(idx)].astype(np.float64)
        x, s = batch_features(c, u)
        pred = float(predictor.predict_ms(x[None, :], np.array([s]))[0])
    else:
        pred = 0.0
    # tuple.__new__ straight from C: an Allocation per request without a Python call each
    allocs = tuple(map(tuple.__new__, repeat(Allocation), zip(map(snap.ids.__getitem__, idx), tok, strict=True)))
    return Plan(
        policy=policy.name,
        policy_version=policy.version,
        predictor_version=predictor.version,
        path=path,
        token_budget=int(sum(tok)),
        predicted_latency_ms=pred,
        allocations=allocs,
        decision_us=(time.perf_counter_ns() - t0) // 1000,
        breakdown_us={k: v // 1000 for k, v in breakdown_ns.items()},
    )
