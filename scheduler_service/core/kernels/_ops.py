"""The one dispatch of the policy hot path: :class:`NumpyOps` and :class:`NumbaOps`.

The policy modules call ``kernels.ops().<operation>(...)`` and never ask which backend
runs.  Both classes have the same methods: :class:`NumpyOps` runs the numpy reference
(:mod:`..reference`, and the reference methods of the candidate queue it is handed);
:class:`NumbaOps` calls the compiled kernel and, when the kernel declines an input whose
reference result it cannot reproduce exactly, runs the reference itself (``super()``).

Every such escape rule lives here and nowhere else:

* the lost sets take fewer than :data:`MAX_LATE_SET` requests (the heap key's position bits);
* the multi-class lost set (``class_late_set``) has no kernel: it runs on numpy;
* ``ordered`` compiles one or two keys that int64 then float64 hold exactly, and an exact
  tie (ids must break it) runs the reference; MLPS the same, its class key packed in the
  integer key while fewer than :data:`MAX_CLASSES` classes are present;
* more than :data:`..reference.SCALAR_MINOR` minor batches in one call are predicted the
  reference's numpy way (the fill curve fixes them, the window search returns −1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import reference as ref
from ..snapshot import Snapshot

if TYPE_CHECKING:
    from ..batch import BudgetCurve, CandidateQueue
    from ..predictor import BatchLatencyPredictor

__all__ = ["MAX_CLASSES", "MAX_LATE_SET", "POS_BITS", "NumbaOps", "NumpyOps", "QueueView"]

#: ``late_set``'s heap key holds a request's position in this many bits.
POS_BITS = 20
#: The most requests the compiled lost sets take.
MAX_LATE_SET = 1 << POS_BITS
#: MLPS packs the class rank into bits 43..61 of its integer key.
CLASS_BITS = 19
MAX_CLASSES = 1 << CLASS_BITS

#: ``lost`` when there is none, for the compiled MLPS sort.
_NO_MASK = np.zeros(0, dtype=bool)
_NO_CLASS = np.zeros(0, dtype=np.int64)
_INT64 = np.dtype(np.int64)


def _idx(a: np.ndarray) -> np.ndarray:
    """Row indices as the compiled kernels take them (int64; no copy when they are).  An
    array a kernel returned carries an int64 dtype equal to, but not the same object as,
    numpy's own: compared by identity first, then by value."""
    return a if a.dtype is _INT64 or a.dtype == _INT64 else a.astype(np.int64)


class QueueView(NamedTuple):
    """A candidate queue as the compiled kernels take it (one numba argument; its
    fields are read by name)."""

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


class NumpyOps:
    """The numpy reference of every hot-path operation."""

    name = "numpy"

    # ---------------------------------------------------------------- orders
    def ordered(self, snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
        return ref.ordered(snap, idx, *keys)

    def mlps_order(self, snap: Snapshot, idx: np.ndarray, prio: np.ndarray | None, throughput: float,
                   alpha: float, eps: float, expired_last: bool, lost: np.ndarray | None) -> np.ndarray:
        return ref.mlps_order(snap, idx, prio, throughput, alpha, eps, expired_last, lost)

    def late_set(self, snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
        return ref.late_set(snap, idx, throughput)

    def lost_mask(self, snap: Snapshot, pre: np.ndarray, rho: float, rho_max: float, hopeless_factor: float,
                  moore: bool, classes: bool) -> np.ndarray:
        return ref.lost_mask(snap, pre, rho, rho_max, hopeless_factor, moore, classes)

    def sit_out(self, snap: Snapshot, dec_all: np.ndarray, pre: np.ndarray, lost: np.ndarray, skip_tbts: float,
                skip_late: bool, starve: float) -> tuple[np.ndarray, np.ndarray]:
        return ref.sit_out(snap, dec_all, pre, lost, skip_tbts, skip_late, starve)

    def window_limits(self, snap: Snapshot, decodes: np.ndarray, k: int, margin: float) -> np.ndarray | None:
        return ref.window_limits(snap, decodes, k, margin)

    # ------------------------------------------------------------------ reasons
    def reason_codes(self, snap: Snapshot, dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray,
                     lost_from: np.ndarray, lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray,
                     rules: np.ndarray, own_rule: int = -1,
                     own_value: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(waiting rows, code indices, values) of a plan (``reasons.explain``) that gives
        one token to each of ``dec_rows`` and ``pre_toks[j]`` to row ``pre_rows[j]``; the
        lost set is ``lost_from[lost_mask]``, ``marked`` the rows the class rules held
        back (prefills) or sat out (decodes), ``verdicts`` the rejected and preempted rows,
        their codes and their KV tokens (int64, three rows), ``rules`` as
        ``reference.RULE_SCALAR`` says, rule ``own_rule``'s number (−1: none) ``own_value``
        instead."""
        return ref.reason_codes(dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked, verdicts, rules,
                                int(own_rule), float(own_value), *snap.reason_columns)

    def fill_reason_codes(self, snap: Snapshot, cq: CandidateQueue, prefill_tokens: int, dec_rows: np.ndarray,
                          lost_from: np.ndarray, lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray,
                          rules: np.ndarray, own_rule: int = -1,
                          own_value: float = 0.0) -> tuple[np.ndarray, ...]:
        """:meth:`fill_prefills` and :meth:`reason_codes` of the plan it makes, in one
        operation, the ``max_num_seqs`` rule on where the fill reaches ``max_num_seqs``
        with ``dec_rows`` (``reference.seqs_rules``): (prefill rows, their tokens, waiting
        rows, code indices, values)."""
        pre_rows, pre_toks = self.fill_prefills(cq, prefill_tokens)
        rules = ref.seqs_rules(rules, len(dec_rows) + len(pre_rows), snap.max_num_seqs)
        return (pre_rows, pre_toks, *self.reason_codes(snap, dec_rows, pre_rows, pre_toks, lost_from, lost_mask,
                                                        marked, verdicts, rules, own_rule, own_value))

    # -------------------------------------------------------- candidate queue
    def fill_prefills(self, cq: CandidateQueue, prefill_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """``cq.fill_arrays``: the greedy fill of ``prefill_tokens`` over the queue."""
        return cq.fill_arrays(prefill_tokens)

    def queue_arrays(self, snap: Snapshot, predictor: BatchLatencyPredictor, fast: int,
                     queue: np.ndarray) -> tuple[np.ndarray, ...]:
        return ref.queue_arrays(snap, predictor.model(fast), queue)

    def prefix_times(self, cq: CandidateQueue, P: np.ndarray) -> np.ndarray:
        return cq.reference_prefix_time_ms(P)

    def fill_curve(self, cq: CandidateQueue, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Times of P = 0..limit and their suffix minimum (None: the caller computes it)."""
        P = np.arange(limit + 1, dtype=np.int64)
        return cq.segment_time_ms(np.zeros_like(P), P), None

    def sliding_chunk(self, cq: CandidateQueue, W: np.ndarray, granularity: int, max_points: int,
                      curve: BudgetCurve, tol: float) -> int:
        return ref.sliding_chunk(cq, W, granularity, max_points, curve, tol)

    # ------------------------------------------------------ batch constructor
    def knapsack_pass(self, idx: np.ndarray, w: np.ndarray, v: np.ndarray, value: dict[int, float],
                      cap_of: dict[int, int]) -> tuple[np.ndarray, list[tuple[ref.Key, int, int]]]:
        return ref.knapsack_pass(idx, w, v, value, cap_of)

    def read_back(self, take: np.ndarray, idx: np.ndarray, w: np.ndarray, pa: int, c: int) -> list[int]:
        return ref.read_back(take, idx, w, pa, c)


class NumbaOps(NumpyOps):
    """The compiled kernels (``k``: the :mod:`._compiled` module), the reference where one declines."""

    name = "numba"

    def __init__(self, k: Any) -> None:
        self.k = k

    def ordered(self, snap: Snapshot, idx: np.ndarray, keys: tuple[np.ndarray, ...]) -> np.ndarray:
        if 1 <= len(keys) <= 2 and len(idx) > 1:  # by arrival alone numpy's sort wins
            out = self._lex(snap, idx, keys)
            if out is not None:
                return out
        return super().ordered(snap, idx, keys)

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
        return None if tie else out

    def mlps_order(self, snap: Snapshot, idx: np.ndarray, prio: np.ndarray | None, throughput: float,
                   alpha: float, eps: float, expired_last: bool, lost: np.ndarray | None) -> np.ndarray:
        cls: np.ndarray | None = _NO_CLASS
        if prio is not None:  # the class key: its rank among the classes present
            levels, rank = np.unique(prio, return_inverse=True)
            cls = rank.astype(np.int64) if len(levels) < MAX_CLASSES else None
        if cls is not None:
            out, tie = self.k.mlps_order(np.asarray(idx, dtype=np.int64), snap.remaining_prefill, snap.slack,
                                         snap.protected, snap.arrival, float(throughput), float(alpha), float(eps),
                                         bool(expired_last), _NO_MASK if lost is None else lost, cls)
            if not tie:
                return out
        return super().mlps_order(snap, idx, prio, throughput, alpha, eps, expired_last, lost)

    def late_set(self, snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
        if 0 < len(idx) < MAX_LATE_SET:
            return self.k.late_set(np.asarray(idx, dtype=np.int64), snap.remaining_prefill, snap.slack,
                                   snap.protected, float(throughput))
        return super().late_set(snap, idx, throughput)

    def lost_mask(self, snap: Snapshot, pre: np.ndarray, rho: float, rho_max: float, hopeless_factor: float,
                  moore: bool, classes: bool) -> np.ndarray:
        if len(pre) < MAX_LATE_SET and not classes:  # no compiled class_late_set
            return self.k.lost_mask(pre, snap.remaining_prefill, snap.slack, snap.protected, float(rho),
                                    float(rho_max), float(hopeless_factor), bool(moore))
        return super().lost_mask(snap, pre, rho, rho_max, hopeless_factor, moore, classes)

    def sit_out(self, snap: Snapshot, dec_all: np.ndarray, pre: np.ndarray, lost: np.ndarray, skip_tbts: float,
                skip_late: bool, starve: float) -> tuple[np.ndarray, np.ndarray]:
        return self.k.sit_out(dec_all, pre, snap.slack, snap.step, lost, float(skip_tbts), bool(skip_late),
                              float(starve))

    def window_limits(self, snap: Snapshot, decodes: np.ndarray, k: int, margin: float) -> np.ndarray | None:
        W = self.k.window_limits(snap.slack, snap.step, decodes, k, margin)
        return W if len(W) else None

    def reason_codes(self, snap: Snapshot, dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray,
                     lost_from: np.ndarray, lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray,
                     rules: np.ndarray, own_rule: int = -1,
                     own_value: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        i8 = _INT64
        return self.k.fill_reason_codes(  # type: ignore[no-any-return]
            cq.queue, cq.R, cq.r, int(prefill_tokens), snap.max_num_seqs,
            dec_rows if dec_rows.dtype is i8 else _idx(dec_rows),
            lost_from if lost_from.dtype is i8 else _idx(lost_from), lost_mask,
            marked if marked.dtype is i8 else _idx(marked), verdicts if verdicts.dtype is i8 else _idx(verdicts),
            rules, int(own_rule), float(own_value), *snap.reason_columns)

    def fill_prefills(self, cq: CandidateQueue, prefill_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k.fill_prefills(cq.queue, cq.R, cq.r, int(prefill_tokens))  # type: ignore[no-any-return]

    def queue_arrays(self, snap: Snapshot, predictor: BatchLatencyPredictor, fast: int,
                     queue: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.k.queue_arrays(snap.remaining_prefill, snap.computed_tokens, np.asarray(queue, dtype=np.int64),
                                   predictor.coef[fast])  # type: ignore[no-any-return]

    def prefix_times(self, cq: CandidateQueue, P: np.ndarray) -> np.ndarray:
        t, _, _ = self.k.prefix_times(cq.view, P)
        return t  # type: ignore[no-any-return]

    def fill_curve(self, cq: CandidateQueue, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
        t, smin, _, _ = self.k.fill_curve(cq.view, limit)
        return t, smin

    def sliding_chunk(self, cq: CandidateQueue, W: np.ndarray, granularity: int, max_points: int,
                      curve: BudgetCurve, tol: float) -> int:
        p1 = self.k.sliding_chunk(cq.view, cq.first_cap, cq.iter_cap, np.asarray(W, dtype=np.float64),
                                  int(granularity), int(max_points), curve.times, curve.suffix_min, float(tol))
        if p1 >= 0:
            return int(p1)
        # -1: the search meets batches the reference predicts with numpy; so must we.
        return super().sliding_chunk(cq, W, granularity, max_points, curve, tol)

    def knapsack_pass(self, idx: np.ndarray, w: np.ndarray, v: np.ndarray, value: dict[int, float],
                      cap_of: dict[int, int]) -> tuple[np.ndarray, list[tuple[ref.Key, int, int]]]:
        at_idx = idx.tolist()
        cap = np.array([cap_of.get(i, -1) for i in at_idx], dtype=np.int64)
        take, adp, acw = self.k.knapsack_pass(w, v, cap, int(max(cap_of.values())))
        at = np.flatnonzero(cap >= 0).tolist()
        return take, [(((packed >> 32) + 1, d + value[at_idx[p]], (packed & 0xFFFFFFFF) + wp), p, c)
                      for p, d, packed, wp, c in zip(at, adp[at].tolist(), acw[at].tolist(), w[at].tolist(),
                                                     cap[at].tolist(), strict=True)]

    def read_back(self, take: np.ndarray, idx: np.ndarray, w: np.ndarray, pa: int, c: int) -> list[int]:
        return [int(idx[pa]), *idx[self.k.read_back(take, w, pa, c)].tolist()]
