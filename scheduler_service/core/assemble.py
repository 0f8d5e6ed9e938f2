"""Turn a policy's choice into a :class:`Plan` (shared by every policy)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from .plan import Allocation, Plan, Reason, Reasons
from .policy import Policy
from .predictor import BatchLatencyPredictor, batch_features
from .reasons import Facts, classify
from .snapshot import Snapshot

__all__ = ["assemble_plan", "in_queue_order"]


def in_queue_order(chosen: Iterable[int], queue: np.ndarray) -> np.ndarray:
    """``chosen`` snapshot indices sorted by their position in ``queue`` (int64)."""
    c = np.fromiter(chosen, dtype=np.int64)
    if len(c) == 0 or len(queue) == 0:
        return c[:0]
    member = np.zeros(max(int(queue.max()), int(c.max())) + 1, dtype=bool)  # np.isin without its sort
    member[c] = True
    return queue[member[queue]]


#: ``Allocation(id, 1)`` of running decodes, shared between decisions: a decode keeps its
#: id and its one token for hundreds of iterations, and building some 256 named tuples
#: per decision was the largest pure-Python cost left in it.  Allocations are immutable
#: and compare by value, so sharing changes no plan.  Bounded (cleared when full);
#: dict reads and writes are atomic, so threads may share it.
_ONE_TOKEN: dict[str, Allocation] = {}
_ONE_TOKEN_MAX = 1 << 16


def _decode_allocations(ids: list[str]) -> list[Allocation]:
    out = list(map(_ONE_TOKEN.get, ids))
    if None in out:
        if len(_ONE_TOKEN) > _ONE_TOKEN_MAX:
            _ONE_TOKEN.clear()
        for k, a in enumerate(out):
            if a is None:
                out[k] = _ONE_TOKEN[ids[k]] = Allocation(ids[k], 1)
    return out  # type: ignore[return-value]


def assemble_plan(
    policy: Policy,
    snap: Snapshot,
    predictor: BatchLatencyPredictor,
    decodes: np.ndarray,
    pre_rows: np.ndarray,
    pre_toks: np.ndarray,
    path: str,
    t0: int,
    breakdown_ns: dict[str, int],
    predicted_ms: float | None = None,
    facts: Facts | None = None,
    reasons: Sequence[Reason] | None = None,
) -> Plan:
    """Build the plan and predict the latency of exactly the batch it names
    (``predicted_ms`` when the caller already knows it).  Its reasons, when the decision
    explains itself: ``reasons``, classified already (SlidingServe); or ``facts``, what the
    decision knew: they are classified from them and from the rows the plan serves
    (``reasons.classify``).
    The plan gives one token to each of ``decodes`` and ``pre_toks[j]`` to row ``pre_rows[j]``."""
    ids = snap.ids
    dec = decodes.tolist()
    rows, toks = pre_rows.tolist(), pre_toks.tolist()
    if predicted_ms is not None:
        pred = predicted_ms
    elif dec or rows:
        idx = dec + rows
        c = np.array([1] * len(dec) + toks, dtype=np.float64)
        u = snap.kv_tokens[np.array(idx)].astype(np.float64)
        x, s = batch_features(c, u)
        pred = float(predictor.predict_ms(x[None, :], np.array([s]))[0])
    else:
        pred = 0.0
    allocs = _decode_allocations(list(map(ids.__getitem__, dec)))
    allocs += [Allocation(ids[i], t) for i, t in zip(rows, toks, strict=True)]
    allocations = tuple(allocs)
    budget = len(dec) + int(sum(toks))
    if reasons is None and facts is not None and len(snap):
        reasons = Reasons(snap.ids, *classify(snap, facts, np.asarray(decodes, dtype=np.int64),
                                              np.asarray(pre_rows, dtype=np.int64),
                                              np.asarray(pre_toks, dtype=np.int64)))
    return Plan(
        policy=policy.name,
        policy_version=policy.version,
        predictor_version=predictor.version,
        path=path,
        token_budget=budget,
        predicted_latency_ms=pred,
        allocations=allocations,
        decision_us=(time.perf_counter_ns() - t0) // 1000,
        breakdown_us={k: v // 1000 for k, v in breakdown_ns.items()},
        reasons=() if reasons is None else reasons,
    )
