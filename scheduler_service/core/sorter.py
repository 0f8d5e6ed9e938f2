"""Orders of the prefill queue (waiting + prefilling requests).

All sorts are total and deterministic: remaining ties break by arrival, then
by id, so the same snapshot always yields the same queue.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .kernels import id_rank
from .snapshot import Snapshot

__all__ = ["class_late_set", "edf_order", "fcfs_order", "id_rank", "late_set", "mlps_keys", "mlps_order", "ordered",
           "prefill_indices"]


def prefill_indices(snap: Snapshot) -> np.ndarray:
    return np.flatnonzero(~snap.is_decoding)


def ordered(snap: Snapshot, idx: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """``idx`` sorted by ``keys`` (most significant first), then arrival, then id.

    Ids only break exact ties, which are rare; building the id ranks costs
    more than the sort itself, so it happens only when a tie exists.
    """
    return kernels.ops().ordered(snap, idx, keys)


def mlps_keys(
    snap: Snapshot, idx: np.ndarray, throughput: float, alpha: float, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(1 − g_i, 1 − e_i, r_i) of formulas (10)–(15) for requests ``idx``: with the urgency
    u_i = r_i / (throughput · max(s_i, eps)) (13), e_i = u_i > alpha (14), g_i protected;
    the fields of the key :func:`mlps_order` sorts by."""
    k = kernels.ops().mlps_key(snap, idx, throughput, alpha, eps)
    return (k >> 42) & 1, (k >> 41) & 1, k & ((1 << 41) - 1)


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
    live ones: they can no longer meet their SLO, so they get only budget that
    live requests leave.  ``lost`` (a mask over ``idx``) marks more requests to
    treat the same way.  Among themselves these late requests go oldest first
    (by class, then arrival): none is expected to meet its SLO, so their order
    only decides how long each waits, and first come first served bounds the
    longest wait (shortest first, formula (16)'s r, left the oldest long
    prompts waiting until the queue drained).

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
    return kernels.ops().mlps_order(snap, idx, prio if classes else None, throughput, alpha, eps, expired_last, lost)


def late_set(snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
    """Moore–Hodgson on the prefill queue: the mask over ``idx`` of requests to give up
    so that the rest, served one after another in deadline order at ``throughput``
    tokens/s, all meet their TTFT slack.

    Served alone, one at a time, at a fixed rate, this minimises the number of late
    first tokens (Moore 1968).  When a request would finish late, the longest one
    taken so far is dropped; protected requests are dropped only when no unprotected
    one is left to drop.
    """
    return kernels.ops().late_set(snap, idx, throughput)


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
    return kernels.ops().class_late_set(snap, idx, throughput)


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
