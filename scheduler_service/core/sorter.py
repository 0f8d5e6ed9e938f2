"""Orders of the prefill queue (waiting + prefilling requests).

All sorts are total and deterministic: remaining ties break by arrival, then
by id, so the same snapshot always yields the same queue.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from . import kernels
from .snapshot import Snapshot

__all__ = [
    "class_late_set", "edf_order", "fcfs_order", "id_rank", "late_set", "mlps_keys", "mlps_order", "ordered",
    "prefill_indices",
]


#: ``lost`` when there is none, for the compiled MLPS sort.
_NO_MASK = np.zeros(0, dtype=bool)


def prefill_indices(snap: Snapshot) -> np.ndarray:
    return np.flatnonzero(~snap.is_decoding)


def id_rank(snap: Snapshot, idx: np.ndarray) -> np.ndarray:
    ids = np.array([snap.ids[i] for i in idx]) if len(idx) else np.array([], dtype=str)
    order = np.argsort(ids, kind="stable")
    rank = np.empty(len(idx), dtype=np.int64)
    rank[order] = np.arange(len(idx))
    return rank


def ordered(snap: Snapshot, idx: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """``idx`` sorted by ``keys`` (most significant first), then arrival, then id.

    Ids only break exact ties, which are rare; building the id ranks costs
    more than the sort itself, so it happens only when a tie exists.
    """
    jit = kernels.jit()
    if jit is not None and 1 <= len(keys) <= 2 and len(idx) > 1:  # by arrival alone numpy's sort wins
        out = _ordered_compiled(jit, snap, idx, keys)
        if out is not None:
            return out
    cols = (snap.arrival[idx], *reversed(keys))
    perm = np.lexsort(cols)
    if len(perm) > 1:
        tie = np.ones(len(perm) - 1, dtype=bool)
        for col in cols:
            sc = col[perm]
            tie &= sc[1:] == sc[:-1]
        if tie.any():
            perm = np.lexsort((id_rank(snap, idx), *cols))
    return idx[perm]


def _ordered_compiled(jit: Any, snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]
                      ) -> np.ndarray | None:
    """``ordered`` by the compiled sort for up to two keys that int64 then float64
    hold exactly (an integer key, then a float or small-integer one); None when it
    cannot (other key types, or a tie that ids must break)."""
    zi, zf = np.zeros(len(idx), dtype=np.int64), np.zeros(len(idx))
    if len(keys) == 2:
        k0, k1 = keys
    elif keys and keys[0].dtype.kind in "biu":
        k0, k1 = keys[0], zf
    else:
        k0, k1 = zi, (keys[0] if keys else zf)
    if k0.dtype.kind not in "biu" or k0.dtype == np.uint64:
        return None
    if k1.dtype.kind not in "bf" and not (k1.dtype.kind in "iu" and k1.dtype.itemsize < 8):
        return None
    out, tie = jit.lex_order(np.asarray(idx, dtype=np.int64), k0.astype(np.int64), k1.astype(np.float64),
                             snap.arrival)
    return None if tie else out


def mlps_keys(
    snap: Snapshot, idx: np.ndarray, throughput: float, alpha: float, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(1 − g_i, 1 − e_i, r_i) of formulas (10)–(15) for requests ``idx``."""
    r = snap.remaining_prefill[idx]
    s = snap.slack[idx]
    u = r / (throughput * np.maximum(s, eps))  # (13)
    e = u > alpha  # (14)
    return (~snap.protected[idx]).astype(np.int8), (~e).astype(np.int8), r


def mlps_order(
    snap: Snapshot,
    idx: np.ndarray,
    throughput: float,
    alpha: float,
    eps: float,
    expired_last: bool = True,
    lost: np.ndarray | None = None,
) -> np.ndarray:
    """Formula (16): LexSort by (1 − g, 1 − e, r), ascending.

    With ``expired_last`` requests whose TTFT deadline has passed go after all
    live ones (same key among themselves): they can no longer meet their SLO,
    so they get only budget that live requests leave.  ``lost`` (a mask over
    ``idx``) marks more requests to treat the same way.

    Request classes: the class priority is the first key after the expired/lost
    flag, so every live request of a higher class goes before any of a lower class,
    and formula (16) orders each class (with one class, formula (16) exactly).
    Measured against priority as a key after urgency on mixed-v1 at twice the
    load (docs/policies.md): the higher classes miss fewer first tokens.
    """
    if len(idx) == 0:
        return idx
    prio = snap.priority[idx] if not snap.one_class else None
    classes = prio is not None and bool(prio.min() != prio.max())
    jit = None if classes else kernels.jit()  # the compiled sort has no class key
    if jit is not None:
        out, tie = jit.mlps_order(np.asarray(idx, dtype=np.int64), snap.remaining_prefill, snap.slack,
                                  snap.protected, snap.arrival, float(throughput), float(alpha), float(eps),
                                  bool(expired_last), _NO_MASK if lost is None else lost)
        if not tie:
            return out
    g, e, r = mlps_keys(snap, idx, throughput, alpha, eps)
    late = snap.slack[idx] <= 0 if expired_last else np.zeros(len(idx), dtype=bool)
    if lost is not None:
        late = late | lost
    expired = late.astype(np.int8)
    if classes and prio is not None:
        return ordered(snap, idx, expired, prio, g, e, r)
    return ordered(snap, idx, expired, g, e, r)


def late_set(snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
    """Moore–Hodgson on the prefill queue: the mask over ``idx`` of requests to give up
    so that the rest, served one after another in deadline order at ``throughput``
    tokens/s, all meet their TTFT slack.

    Served alone, one at a time, at a fixed rate, this minimises the number of late
    first tokens (Moore 1968).  When a request would finish late, the longest one
    taken so far is dropped; protected requests are dropped only when no unprotected
    one is left to drop.
    """
    lost = np.zeros(len(idx), dtype=bool)
    if len(idx) == 0:
        return lost
    jit = kernels.jit()
    if jit is not None and len(idx) < jit.MAX_LATE_SET:
        return jit.late_set(np.asarray(idx, dtype=np.int64), snap.remaining_prefill, snap.slack,
                            snap.protected, float(throughput))
    r = snap.remaining_prefill[idx].astype(np.float64) / throughput
    s = snap.slack[idx]
    prot = snap.protected[idx]
    order = np.lexsort((np.arange(len(idx)), s))
    lost[s <= 0] = True
    order = order[s[order] > 0]
    # Fast path: the prefix of the deadline order that is on time needs no heap work
    # (np.cumsum adds left to right, as the loop below does, so the sums are the same).
    done = np.cumsum(r[order])
    late = np.flatnonzero(done > s[order])
    if len(late) == 0:
        return lost
    head = int(late[0])
    heap = [(int(prot[j]), -float(r[j]), j) for j in order[:head].tolist()]  # unprotected, longest first
    heapq.heapify(heap)
    t = float(done[head - 1]) if head else 0.0
    for j in order[head:].tolist():
        heapq.heappush(heap, (int(prot[j]), -float(r[j]), j))
        t += float(r[j])
        while t > s[j] and heap:
            _, neg, k = heapq.heappop(heap)
            t += neg
            lost[k] = True
    return lost


def class_late_set(snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
    """:func:`late_set` with request classes: a lower class never costs a higher one its
    first token (docs/policies.md, Request classes).

    Classes are taken from the highest (smallest ``priority``) down.  For each, the
    requests kept so far plus the class's own are walked in deadline order at
    ``throughput``; whenever one would finish late, the longest request *of this class*
    taken so far is given up (unprotected first), until it is on time again.  The
    higher classes' kept set is on time by itself, so this always ends, and which
    requests of a class are lost depends on that class and the classes above it only.
    With one class it is :func:`late_set` exactly.
    """
    prio = snap.priority[idx]
    levels = np.unique(prio)
    if len(levels) <= 1:
        return late_set(snap, idx, throughput)
    r = snap.remaining_prefill[idx].astype(np.float64) / throughput
    s = snap.slack[idx]
    prot = snap.protected[idx]
    lost = s <= 0
    by_deadline = np.lexsort((np.arange(len(idx)), s))
    kept = np.zeros(len(idx), dtype=bool)
    for level in levels.tolist():
        kept |= (prio == level) & ~lost
        order = by_deadline[kept[by_deadline]]
        heap: list[tuple[int, float, int]] = []
        t = 0.0
        for j in order.tolist():
            t += float(r[j])
            if prio[j] == level:
                heapq.heappush(heap, (int(prot[j]), -float(r[j]), j))
            while t > s[j] and heap:
                _, neg, k = heapq.heappop(heap)
                t += neg
                lost[k] = True
                kept[k] = False
    return lost


def edf_order(snap: Snapshot, idx: np.ndarray, expired_last: bool = False) -> np.ndarray:
    """Earliest TTFT deadline a_i + L_i^ttft first (Sarathi-EDF)."""
    if len(idx) == 0:
        return idx
    expired = (snap.slack[idx] <= 0).astype(np.int8) if expired_last else np.zeros(len(idx), np.int8)
    return ordered(snap, idx, expired, snap.ttft_deadline[idx])


def fcfs_order(snap: Snapshot, idx: np.ndarray) -> np.ndarray:
    if len(idx) == 0:
        return idx
    return ordered(snap, idx)
