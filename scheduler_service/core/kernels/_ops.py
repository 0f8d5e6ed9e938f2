"""The one dispatch of the policy hot path: :class:`Ops`.

The policy modules call ``kernels.ops().<operation>(...)`` and never ask which backend
runs.  An :class:`Ops` gathers a decision's arrays into the arguments of a kernel of
:mod:`._compiled`, the one definition of each operation, and calls it compiled (numba)
or as its plain Python source (``py_func``): the same code, so the same plans.

One sort is not a kernel: ordering by keys the compiled sort cannot hold exactly (more
than two keys, or a float first key), or when an exact tie remains after every key and
arrival, is numpy's ``lexsort`` with request ids as the last key (:func:`lexsort_order`).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..snapshot import Snapshot

if TYPE_CHECKING:
    from ..batch import BudgetCurve, CandidateQueue
    from ..predictor import BatchLatencyPredictor

__all__ = ["CLASS_BITS", "MAX_BOUNDARIES", "MAX_LATE_SET", "POS_BITS", "Ops", "QueueView", "id_rank", "lexsort_order"]

#: ``late_set``'s heap key holds a request's position in this many bits.
POS_BITS = 20
#: MLPS packs the class rank into bits 43..61 of its integer key.
CLASS_BITS = 19
#: The most requests a lost set or an MLPS order takes: a position fits the heap key and
#: a class rank MLPS's key (``snapshot.MAX_REQUESTS`` stays below it).
MAX_LATE_SET = 1 << min(POS_BITS, CLASS_BITS)
#: Request boundaries added to the window search's grid (the first ones of the stream).
MAX_BOUNDARIES = 16

#: ``lost`` when there is none, for the compiled MLPS sort.
_NO_MASK = np.zeros(0, dtype=bool)
_NO_CLASS = np.zeros(0, dtype=np.int64)
_INT64 = np.dtype(np.int64)


def _idx(a: np.ndarray) -> np.ndarray:
    """Row indices as the kernels take them (int64; no copy when they are).  An array a
    kernel returned carries an int64 dtype equal to, but not the same object as, numpy's
    own: compared by identity first, then by value."""
    return a if a.dtype is _INT64 or a.dtype == _INT64 else a.astype(np.int64)


def id_rank(snap: Snapshot, idx: np.ndarray) -> np.ndarray:
    """Each of ``idx``'s rank by request id (the last tie-break of every order)."""
    ids = np.array([snap.ids[i] for i in idx]) if len(idx) else np.array([], dtype=str)
    order = np.argsort(ids, kind="stable")
    rank = np.empty(len(idx), dtype=np.int64)
    rank[order] = np.arange(len(idx))
    return rank


def lexsort_order(snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """``idx`` sorted by ``keys`` (most significant first), then arrival, then id.  Ids
    only break exact ties, which are rare; their ranks cost more than the sort, so they
    are built only when a tie exists."""
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


class QueueView(NamedTuple):
    """A candidate queue as the kernels take it (one numba argument; its fields are read
    by name)."""

    coef: np.ndarray  # (3, 8) the predictor's coefficients
    fast: int  # the scenario row of the fast-path model
    R: np.ndarray  # stream boundaries
    u0: np.ndarray  # computed tokens of each queued request
    pw: np.ndarray  # prefix sums of the full requests' times (fast-path row)
    pf: np.ndarray  # prefix sums of their feature rows
    rbig: np.ndarray  # chunk sizes that count in x7
    pmax: np.ndarray  # running max of rbig
    n_dec: int
    dec_u: float


class _PlainKernels:
    """The kernels of a module as their plain Python source (``py_func``)."""

    def __init__(self, mod: ModuleType) -> None:
        self._mod = mod

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._mod, name)
        return getattr(f, "py_func", f)


class Ops:
    """Every hot-path operation, on the kernels of :mod:`._compiled` (``k``): compiled
    (``name`` "numba") or as plain Python (``plain=True``, "numpy")."""

    def __init__(self, mod: ModuleType, *, plain: bool = False) -> None:
        self.k: Any = _PlainKernels(mod) if plain else mod
        self.name = "numpy" if plain or not mod.COMPILED else "numba"

    # ---------------------------------------------------------------- orders
    def ordered(self, snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
        if 1 <= len(keys) <= 2 and len(idx) > 1:  # by arrival alone numpy's sort wins
            out = self._lex(snap, idx, keys)
            if out is not None:
                return out
        return lexsort_order(snap, idx, keys)

    def _lex(self, snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray | None:
        """The compiled sort for up to two keys that int64 then float64 hold exactly (an
        integer key, then a float or small-integer one); None when it cannot (other key
        types, or a tie that ids must break)."""
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
        out, tie = self.k.lex_order(np.asarray(idx, dtype=np.int64), k0.astype(np.int64), k1.astype(np.float64),
                                    snap.arrival)
        return None if tie else out  # type: ignore[no-any-return]

    def mlps_order(self, snap: Snapshot, idx: np.ndarray, prio: np.ndarray | None, throughput: float,
                   alpha: float, eps: float, expired_last: bool, lost: np.ndarray | None) -> np.ndarray:
        cls = _NO_CLASS
        if prio is not None:  # the class key: its rank among the classes present
            cls = np.unique(prio, return_inverse=True)[1].astype(np.int64)
        args = (np.asarray(idx, dtype=np.int64), snap.remaining_prefill, snap.slack, snap.protected)
        rest = (float(throughput), float(alpha), float(eps), bool(expired_last), _NO_MASK if lost is None else lost,
                cls)
        out, tie = self.k.mlps_order(*args, snap.arrival, *rest)
        if not tie:
            return out  # type: ignore[no-any-return]
        return lexsort_order(snap, idx, (self.k.mlps_key(*args, *rest),))

    def mlps_key(self, snap: Snapshot, idx: np.ndarray, throughput: float, alpha: float, eps: float) -> np.ndarray:
        """MLPS's packed key of live requests of one class (the kernel's ``mlps_key``)."""
        return self.k.mlps_key(np.asarray(idx, dtype=np.int64), snap.remaining_prefill,  # type: ignore[no-any-return]
                               snap.slack, snap.protected, float(throughput), float(alpha), float(eps), False,
                               _NO_MASK, _NO_CLASS)

    def late_set(self, snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
        if len(idx) == 0:
            return np.zeros(0, dtype=bool)
        return self.k.late_set(np.asarray(idx, dtype=np.int64), snap.remaining_prefill,  # type: ignore[no-any-return]
                               snap.slack, snap.protected, float(throughput))

    def class_late_set(self, snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
        if len(idx) == 0:
            return np.zeros(0, dtype=bool)
        return self.k.class_late_set(np.asarray(idx, dtype=np.int64),  # type: ignore[no-any-return]
                                     snap.remaining_prefill, snap.slack, snap.protected, snap.priority,
                                     float(throughput))

    def lost_mask(self, snap: Snapshot, pre: np.ndarray, rho: float, rho_max: float, hopeless_factor: float,
                  moore: bool, classes: bool) -> np.ndarray:
        return self.k.lost_mask(pre, snap.remaining_prefill, snap.slack,  # type: ignore[no-any-return]
                                snap.protected, snap.priority, float(rho), float(rho_max), float(hopeless_factor),
                                bool(moore), bool(classes))

    def sit_out(self, snap: Snapshot, dec_all: np.ndarray, pre: np.ndarray, lost: np.ndarray, skip_tbts: float,
                skip_late: bool, starve: float) -> tuple[np.ndarray, np.ndarray]:
        return self.k.sit_out(dec_all, pre, snap.slack, snap.step, lost,  # type: ignore[no-any-return]
                              float(skip_tbts), bool(skip_late), float(starve))

    def window_limits(self, snap: Snapshot, decodes: np.ndarray, k: int, margin: float) -> np.ndarray | None:
        """W_1..W_k in ms over the safe decodes (formulas (7), (8)), divided by ``margin``;
        None when no decode is safe."""
        W = self.k.window_limits(snap.slack, snap.step, decodes, k, margin)
        return W if len(W) else None

    # ------------------------------------------------------------------ reasons
    def reason_codes(self, snap: Snapshot, dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray,
                     lost_from: np.ndarray, lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray,
                     rules: np.ndarray, own_rule: int = -1,
                     own_value: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(waiting rows, code indices, values) of a plan (``reasons.explain``) that gives
        one token to each of ``dec_rows`` and ``pre_toks[j]`` to row ``pre_rows[j]``: the
        kernel's docstring says which rule applies to whom."""
        i8 = _INT64  # the checks of _idx inline: a call each costs more than the check (once per plan)
        return self.k.reason_codes(  # type: ignore[no-any-return]
            dec_rows if dec_rows.dtype is i8 else _idx(dec_rows),
            pre_rows if pre_rows.dtype is i8 else _idx(pre_rows),
            pre_toks if pre_toks.dtype is i8 else _idx(pre_toks),
            lost_from if lost_from.dtype is i8 else _idx(lost_from), lost_mask,
            marked if marked.dtype is i8 else _idx(marked), verdicts if verdicts.dtype is i8 else _idx(verdicts),
            rules, int(own_rule), float(own_value), *snap.reason_columns)

    def fill_reason_codes(self, snap: Snapshot, cq: CandidateQueue, prefill_tokens: int, dec_rows: np.ndarray,
                          lost_from: np.ndarray, lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray,
                          rules: np.ndarray, own_rule: int = -1,
                          own_value: float = 0.0) -> tuple[np.ndarray, ...]:
        """:meth:`fill_prefills` and :meth:`reason_codes` of the plan it makes, in one
        call, the ``max_num_seqs`` rule on where the fill reaches ``max_num_seqs`` with
        ``dec_rows``: (prefill rows, their tokens, waiting rows, code indices, values)."""
        i8 = _INT64
        return self.k.fill_reason_codes(  # type: ignore[no-any-return]
            cq.queue, cq.R, cq.r, int(prefill_tokens), snap.max_num_seqs,
            dec_rows if dec_rows.dtype is i8 else _idx(dec_rows),
            lost_from if lost_from.dtype is i8 else _idx(lost_from), lost_mask,
            marked if marked.dtype is i8 else _idx(marked), verdicts if verdicts.dtype is i8 else _idx(verdicts),
            rules, int(own_rule), float(own_value), *snap.reason_columns)

    # -------------------------------------------------------- candidate queue
    def fill_prefills(self, cq: CandidateQueue, prefill_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The greedy fill of ``prefill_tokens`` over the queue: (snapshot rows, tokens)."""
        return self.k.fill_prefills(cq.queue, cq.R, cq.r, int(prefill_tokens))  # type: ignore[no-any-return]

    def queue_arrays(self, snap: Snapshot, predictor: BatchLatencyPredictor, fast: int,
                     queue: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.k.queue_arrays(snap.remaining_prefill, snap.computed_tokens,  # type: ignore[no-any-return]
                                   np.asarray(queue, dtype=np.int64), predictor.coef[fast])

    def prefix_times(self, cq: CandidateQueue, P: np.ndarray) -> np.ndarray:
        return self.k.prefix_times(cq.view, P)  # type: ignore[no-any-return]

    def segment_times(self, cq: CandidateQueue, X: np.ndarray, Y: np.ndarray, step: int) -> np.ndarray:
        return self.k.segment_times(cq.view, X, Y, int(step))  # type: ignore[no-any-return]

    def fill_curve(self, cq: CandidateQueue, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Times of P = 0..limit and their suffix minimum."""
        return self.k.fill_curve(cq.view, int(limit))  # type: ignore[no-any-return]

    def sliding_chunk(self, cq: CandidateQueue, W: np.ndarray, granularity: int, max_points: int,
                      curve: BudgetCurve, tol: float) -> int:
        return int(self.k.sliding_chunk(cq.view, cq.first_cap, cq.iter_cap, np.asarray(W, dtype=np.float64),
                                        int(granularity), int(max_points), curve.times, curve.suffix_min,
                                        float(tol)))

    # ------------------------------------------------------ batch constructor
    def knapsack_pass(self, idx: np.ndarray, w: np.ndarray, v: np.ndarray, value: dict[int, float],
                      cap_of: dict[int, int]) -> tuple[np.ndarray, list[tuple[tuple[int, float, int], int, int]]]:
        """0/1 knapsack over the pool (snapshot indices ``idx``, weights, values), one
        pass: the choice bits, and per anchor (``cap_of``: its capacity) its key (21)
        (|Y|, Σv, Σr), pool position and capacity."""
        at_idx = idx.tolist()
        cap = np.array([cap_of.get(i, -1) for i in at_idx], dtype=np.int64)
        take, adp, acw = self.k.knapsack_pass(w, v, cap, int(max(cap_of.values())))
        at = np.flatnonzero(cap >= 0).tolist()
        return take, [(((packed >> 32) + 1, d + value[at_idx[p]], (packed & 0xFFFFFFFF) + wp), p, c)
                      for p, d, packed, wp, c in zip(at, adp[at].tolist(), acw[at].tolist(), w[at].tolist(),
                                                     cap[at].tolist(), strict=True)]

    def read_back(self, take: np.ndarray, idx: np.ndarray, w: np.ndarray, pa: int, c: int) -> list[int]:
        """The knapsack's selection of the anchor at pool position ``pa`` with capacity
        ``c``: the anchor, then the items chosen before it, nearest first."""
        return [int(idx[pa]), *idx[self.k.read_back(take, w, pa, c)].tolist()]
