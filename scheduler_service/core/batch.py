"""Candidate batches: decode selection, greedy fill and their predicted times.

Every policy builds the same kind of batch: the scheduled decodes (one token
each) plus a greedy fill of an ordered prefill queue Q, where each request
takes min(remaining, left) tokens (docs/architecture.md, formula (3)).  Concatenating the remaining prompt tokens of Q gives one *token
stream*; a fill of P tokens is the stream prefix [0, P), and the look-ahead
iterations of the SlidingChunker are further segments [X, Y) of the same
stream.  Prefix sums over Q turn the features (4)–(6) of any segment into a
handful of vectorised numpy operations, so hundreds of candidate budgets cost
about as much as one.

Limits: the first iteration's fill is capped by the token budget left after
decodes, by ``max_num_seqs`` (number of requests) and by the KV headroom:
prefill tokens ≤ free_kv_tokens − scheduled decodes − ``kv_decode_reserve``
× all decodes (room for the decodes' next tokens, which the paper ignores).
Admitting a *new* request (not started, ``Snapshot.started``: nothing computed but
prefix-cache hits) must also leave ``kv_growth_reserve`` tokens free (a KV-growth
watermark: the requests already holding KV grow by a token per iteration, and a cache
filled by admissions forces the engine to preempt and recompute them).  Requests already
partly prefilled are not held back by it: their KV is allocated and they only finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import kernels
from .features import (
    DECODE,
    MIXED,
    PREFILL,
    X4,
    X6,
    X7,
    add_decodes,
    piece_features,
    scenarios,
    segment_ms_one,
)
from .kernels import QueueView
from .predictor import BatchLatencyPredictor, LinearModel
from .reference import SCALAR_MINOR
from .snapshot import Snapshot
from .sorter import ordered

__all__ = ["BudgetCurve", "CandidateQueue", "fit_class_decodes", "select_decodes"]


def select_decodes(snap: Snapshot, dec_idx: np.ndarray, starve_tbts: float = 0.0) -> np.ndarray:
    """Decodes that fit the limits, most urgent first when not all fit.

    Priority: live decodes by ascending TBT slack, then expired ones (ties
    by arrival and id); with ``starve_tbts`` > 0, before them the starving
    decodes, at least that many TBTs late, the latest first.  Each decode
    takes one token of ``max_batch_tokens``, one sequence slot and one KV slot.
    """
    cap = min(snap.max_batch_tokens, snap.max_num_seqs)
    if snap.free_kv_tokens is not None:
        cap = min(cap, snap.free_kv_tokens)
    if len(dec_idx) <= cap:
        return dec_idx
    s = snap.slack[dec_idx]
    if starve_tbts > 0:
        fed = s > -starve_tbts * snap.tbt_slo[dec_idx]  # not starving
        return np.sort(ordered(snap, dec_idx, fed, s <= 0, s)[:cap])
    return np.sort(ordered(snap, dec_idx, s <= 0, s)[:cap])


def fit_class_decodes(snap: Snapshot, predictor: BatchLatencyPredictor, decodes: np.ndarray,
                      margin: float) -> np.ndarray:
    """Request classes: ``decodes`` less the lower-class decodes that sit this iteration
    out so that the decodes alone are predicted within the slack of every higher-class
    decode (docs/policies.md, Request classes).

    Decodes leave lowest class first; within a class, those already late (their request
    has missed its SLO) first, then the most slack first.  A decode leaves only while a
    decode of a strictly higher class with slack left is predicted to miss its token,
    margin · T̂(decodes) > its slack; a class never sits out for its own or a lower class.
    With one class ``decodes`` is returned as it is."""
    if len(decodes) < 2 or snap.one_class:
        return decodes
    pr = snap.priority[decodes]
    if pr.min() == pr.max():
        return decodes
    s = snap.slack[decodes]
    order = np.lexsort((np.where(s > 0, -s, -np.inf), -pr))  # drop order
    pr_o, s_o = pr[order], s[order]
    u_o = snap.kv_tokens[decodes][order].astype(np.float64)
    n = len(order)
    # What the decodes left after dropping the first m predict (m = 0..n-1): the
    # decode-only terms, linear in the count and the context.
    kept_u = u_o[::-1].cumsum()[::-1]
    t_ms = predictor.model(DECODE).base_ms_many(np.arange(n, 0, -1, dtype=np.float64), kept_u)
    # Whom dropping order[m] would protect: the safe decodes of a strictly higher class,
    # all after order[m]'s class in the drop order.
    safe = np.where(s_o > 0, s_o, np.inf)
    suffix_min = np.minimum.accumulate(safe[::-1])[::-1]
    higher_from = np.searchsorted(-pr_o, -pr_o, side="right")  # first index of a higher class
    protect_s = np.where(higher_from < n, suffix_min[np.minimum(higher_from, n - 1)], np.inf)
    # The top class protects no one, so a first m always exists.
    m = int(np.flatnonzero(margin * t_ms <= protect_s * 1e3)[0])
    return np.sort(decodes[order[m:]])


def kv_prefill_cap(snap: Snapshot, n_sched_dec: int, n_all_dec: int, reserve: int) -> int:
    if snap.free_kv_tokens is None:
        return 1 << 62
    return max(0, snap.free_kv_tokens - n_sched_dec - reserve * n_all_dec)


@dataclass(frozen=True, slots=True, eq=False)
class CandidateQueue:
    """Scheduled decodes + an ordered prefill queue, ready for fast prediction.

    ``queue`` holds snapshot indices of prefill requests in priority order;
    ``r``/``u0`` their remaining and already-computed prompt tokens; ``R`` the
    stream boundaries (R[0] = 0, R[j+1] = R[j] + r[j]).
    """

    snap: Snapshot
    predictor: BatchLatencyPredictor
    decodes: np.ndarray
    queue: np.ndarray
    r: np.ndarray
    u0: np.ndarray
    R: np.ndarray
    dec_u: float
    #: Prefill tokens the first iteration may take (budget, seqs, KV, supply).
    first_cap: int
    #: Prefill tokens any later look-ahead iteration may take.
    iter_cap: int
    #: Prefill tokens the KV headroom allows this iteration when new requests
    #: are admitted (after the growth watermark).
    kv_cap: int
    #: Prefix sums of the full requests' feature rows (row j covers queue[:j]).
    _pf: np.ndarray
    #: r where r > 1 (chunk sizes that count in x7), else 0.
    _rbig: np.ndarray
    _pmax: np.ndarray
    # Fast path: the model almost every candidate batch uses (mixed with
    # decodes, prefill-only without) and the prefix sums of each full
    # request's terms under it.
    _model: LinearModel
    _pw: np.ndarray
    #: The scenario row of that model in the predictor's coefficients (kernels).
    _fast: int
    #: The queue as the compiled kernels take it (its layout: ``kernels.QueueView``).
    view: QueueView
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        snap: Snapshot,
        predictor: BatchLatencyPredictor,
        decodes: np.ndarray,
        queue: np.ndarray,
        *,
        n_all_decodes: int,
        kv_decode_reserve: int = 1,
        kv_growth_reserve: int = 0,
        budget: int | None = None,
    ) -> CandidateQueue:
        """``budget`` (total tokens, default ``max_batch_tokens``) bounds every
        iteration; fixed-budget baselines pass their chunk size.
        ``kv_growth_reserve``: KV tokens a new admission must leave free."""
        budget = snap.max_batch_tokens if budget is None else min(budget, snap.max_batch_tokens)
        n_dec = len(decodes)
        fast = MIXED if n_dec else PREFILL
        queue = np.asarray(queue, dtype=np.int64)
        r, u0, R, pf, rbig, pmax, pw = kernels.ops().queue_arrays(snap, predictor, fast, queue)
        seq_left = max(0, snap.max_num_seqs - n_dec)
        iter_cap = max(0, budget - n_dec)
        kv_cont = kv_prefill_cap(snap, n_dec, n_all_decodes, kv_decode_reserve)
        kv_cap = max(0, kv_cont - kv_growth_reserve)
        kv_first = kv_cont
        if kv_cap < kv_cont:
            new = np.flatnonzero(~snap.started[queue])
            # The stream may run up to its first new request on the partial
            # prefills' headroom; past it, only up to the watermark.
            kv_first = min(kv_cont, max(kv_cap, int(R[new[0]]))) if len(new) else kv_cont
        first_cap = min(iter_cap, int(R[min(seq_left, len(queue))]), kv_first)
        dec_u = float(snap.kv_tokens[decodes].sum())
        return cls(
            snap=snap,
            predictor=predictor,
            decodes=decodes,
            queue=queue,
            r=r,
            u0=u0,
            R=R,
            dec_u=dec_u,
            first_cap=int(first_cap),
            iter_cap=int(iter_cap),
            kv_cap=int(kv_cap),
            _pf=pf,
            _rbig=rbig,
            _pmax=pmax,
            _model=predictor.model(fast),
            _pw=pw,
            _fast=fast,
            view=QueueView(coef=predictor.coef, fast=fast, R=R, u0=u0, pw=pw, pf=pf, rbig=rbig, pmax=pmax,
                           n_dec=n_dec, dec_u=dec_u),
        )

    @property
    def n_dec(self) -> int:
        return len(self.decodes)

    @property
    def supply(self) -> int:
        """All prompt tokens the queue still needs."""
        return int(self.R[-1])

    # ------------------------------------------------------------- features
    def _sparse_table(self) -> list[np.ndarray]:
        """Range-max table over ``_rbig``, built on first use: only the
        reference path needs it, not a decision's fast path."""
        table = self._cache.get("sparse")
        if table is None:
            table = [self._rbig]
            k = 1
            while 2 * k <= len(self._rbig):
                prev = table[-1]
                table.append(np.maximum(prev[:-k], prev[k:]))
                k *= 2
            self._cache["sparse"] = table
        return table

    def _range_max(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """max(rbig[a:b]) per element (0 where the range is empty)."""
        length = b - a
        out = np.zeros(len(a))
        ok = length > 0
        if not ok.any():
            return out
        lvl = np.zeros(len(a), dtype=np.int64)
        lvl[ok] = np.floor(np.log2(length[ok])).astype(np.int64)
        sparse = self._sparse_table()
        for k in np.unique(lvl[ok]):
            m = ok & (lvl == k)
            tab = sparse[k]
            out[m] = np.maximum(tab[a[m]], tab[b[m] - (1 << k)])
        return out

    def segment_features(
        self, X: np.ndarray, Y: np.ndarray, step: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Features and scenario of the batch "decodes + stream segment [X, Y)".

        ``step`` is the look-ahead iteration (0 = this one): decodes are
        ``step`` tokens longer and the segment's first request has already
        computed its tokens before X.
        """
        X = np.asarray(X, dtype=np.int64)
        Y = np.asarray(Y, dtype=np.int64)
        feats = np.zeros((len(X), 7))
        R, r, u0 = self.R, self.r, self.u0
        nq = len(r)
        if nq:
            nonempty = Y > X
            jh = np.clip(np.searchsorted(R, X, side="right") - 1, 0, nq - 1)
            jt = np.clip(np.searchsorted(R, Y - 1, side="right") - 1, 0, nq - 1)
            multi = nonempty & (jh < jt)
            # head piece [X, min(Y, R[jh+1])); tail piece [R[jt], Y) when the
            # segment spans two or more requests; full requests in between
            ch = np.where(nonempty, np.minimum(Y, R[jh + 1]) - X, 0)
            ct = np.where(multi, Y - R[jt], 0)
            head = piece_features(ch, u0[jh] + (X - R[jh]))
            tail = piece_features(ct, u0[jt])
            head[ch <= 0] = 0.0
            tail[ct <= 0] = 0.0
            a = np.where(multi, jh + 1, 0)
            b = np.maximum(a, np.where(multi, jt, 0))
            feats += self._pf[b] - self._pf[a] + head + tail
            feats[:, X7] = np.maximum(self._range_max(a, b), np.maximum(head[:, X7], tail[:, X7]))
        add_decodes(feats, self.n_dec, self.dec_u + step * self.n_dec)
        return feats, scenarios(feats)

    # ------------------------------------------------------------ fast path
    def decode_only_ms(self, step: int = 0) -> float:
        """Predicted time of the decodes alone (0 when there are none)."""
        if self.n_dec == 0:
            return 0.0
        return self.predictor.model(DECODE).base_ms(self.n_dec, self.dec_u + step * self.n_dec)

    def fix_minor(self, t: np.ndarray, X: np.ndarray, Y: np.ndarray, minor: np.ndarray,
                   step: int) -> None:
        """Entries outside the main scenario (formula (5)) — no chunk of more
        than one token (decode-only), or, without decodes, a one-token piece
        that makes the batch mixed — are few: recompute them with the
        reference path."""
        if not minor.any():
            return
        xs, ys = np.broadcast_to(X, t.shape)[minor], np.broadcast_to(Y, t.shape)[minor]
        t[minor] = [self._segment_ms_scalar(int(x), int(y), step) for x, y in zip(xs, ys, strict=True)]

    def _segment_ms_scalar(self, x: int, y: int, step: int) -> float:
        """One segment's predicted time in plain Python (reference semantics)."""
        return segment_ms_one(self.predictor.coef, self.R, self.u0, self.n_dec, self.dec_u, x, y, step)

    def prefix_time_ms(self, P: np.ndarray) -> np.ndarray:
        """Predicted time of decodes + the greedy fill of P tokens (fast path;
        equal to ``segment_time_ms(0, P)``)."""
        return kernels.ops().prefix_times(self, np.asarray(P, dtype=np.int64))

    def reference_prefix_time_ms(self, P: np.ndarray) -> np.ndarray:
        """:meth:`prefix_time_ms` in numpy (the reference; P: int64)."""
        nq = len(self.r)
        if nq == 0:
            return np.full(len(P), self.decode_only_ms(0))
        j = np.minimum(np.searchsorted(self.R, P, side="right") - 1, nq)
        jc = np.minimum(j, nq - 1)
        c = np.where(j < nq, P - self.R[jc], 0).astype(np.float64)
        m = self._model
        t = (
            m.base_ms(self.n_dec, self.dec_u)
            + self._pw[j]
            + m.piece_ms(c, self.u0[jc].astype(np.float64))
            + m.x7_ms(np.maximum(self._pmax[j], np.where(c > 1, c, 0.0)))
        )
        pf = self._pf
        minor = (pf[j, X6] == 0) & (c <= 1)  # no chunk: decode-only
        if self.n_dec == 0:
            minor |= (pf[j, X4] > 0) | (c == 1)  # a one-token piece: mixed
        minor &= P > 0
        self.fix_minor(t, np.zeros_like(P), P, minor, 0)
        t[P == 0] = self.decode_only_ms(0)
        return t

    def pair_times_ms(self, X: np.ndarray, Y: np.ndarray, step: int) -> np.ndarray:
        """Predicted times of segments [X_a, Y_b) for every pair, as an
        (len(X), len(Y)) matrix (inf where Y_b < X_a); the window search's
        inner loop.  A segment is a head piece (depends on X), the full
        requests between (a difference of weighted prefix sums) and a tail
        piece (depends on Y), so the matrix is a few broadcasts of vectors."""
        X = np.asarray(X, dtype=np.int64)
        Y = np.asarray(Y, dtype=np.int64)
        nq = len(self.r)
        if nq == 0:  # every segment is empty: a decode-only batch
            return np.where(Y[None, :] >= X[:, None], self.decode_only_ms(step), np.inf)
        R, u0, m, pf = self.R, self.u0, self._model, self._pf
        jh = np.clip(np.searchsorted(R, X, side="right") - 1, 0, nq - 1)
        jt = np.clip(np.searchsorted(R, Y - 1, side="right") - 1, 0, nq - 1)
        Xc, Yr = X[:, None], Y[None, :]
        empty = Yr <= Xc
        multi = ~empty & (jt[None, :] > jh[:, None])
        uh = (u0[jh] + (X - R[jh])).astype(np.float64)
        ch_full = (R[jh + 1] - X).astype(np.float64)  # head piece when the segment spans on
        ct = (Y - R[jt]).astype(np.float64)
        ut = u0[jt].astype(np.float64)
        head = m.piece_ms(ch_full, uh)[:, None]
        tail = m.piece_ms(ct, ut)[None, :]
        mid = self._pw[jt][None, :] - self._pw[jh + 1][:, None]
        span = int(jt.max()) + 1
        cols = np.arange(span)
        run = np.maximum.accumulate(
            np.where(cols[None, :] > jh[:, None], self._rbig[:span][None, :], 0.0), axis=1
        )
        inner = run[:, np.maximum(jt - 1, 0)]
        big_h = np.where(ch_full > 1, ch_full, 0.0)[:, None]
        big_t = np.where(ct > 1, ct, 0.0)[None, :]
        t_multi = head + mid + tail + m.x7_ms(np.maximum(np.maximum(inner, big_h), big_t))
        c1 = (Yr - Xc).astype(np.float64)  # the single piece when head and tail coincide
        t_single = m.piece_ms(c1, uh[:, None]) + m.x7_ms(np.where(c1 > 1, c1, 0.0))
        t = m.base_ms(self.n_dec, self.dec_u + step * self.n_dec) + np.where(multi, t_multi, t_single)
        nbig = pf[jt, X6][None, :] - pf[jh + 1, X6][:, None]
        minor = ~empty & np.where(multi, (nbig <= 0) & (big_h == 0) & (big_t == 0), c1 <= 1)
        if self.n_dec == 0:
            none = pf[jt, X4][None, :] - pf[jh + 1, X4][:, None]
            minor |= multi & ((none > 0) | (ch_full == 1)[:, None] | (ct == 1)[None, :])
        self.fix_minor(t, Xc, Yr, minor, step)
        t[empty] = self.decode_only_ms(step)
        t[Yr < Xc] = np.inf
        return t

    def segment_time_ms(self, X: np.ndarray, Y: np.ndarray, step: int = 0) -> np.ndarray:
        if step == 0 and not np.any(X):
            return self.prefix_time_ms(np.asarray(Y, dtype=np.int64))
        f, s = self.segment_features(X, Y, step)
        t = self.predictor.predict_ms(f, s)
        if self.n_dec == 0:
            t = np.where(np.asarray(Y) > np.asarray(X), t, 0.0)
        return t

    # --------------------------------------------------------- budget curve
    def fill_curve_ms(self, limit: int | None = None) -> np.ndarray:
        """Predicted time of decodes + the first P stream tokens, P = 0..limit
        (default: ``max_batch_tokens`` − decodes, capped by the supply).

        The curve ignores the sequence and KV caps on purpose: it maps a token
        budget to a time, which BatchConstructor needs beyond the greedy fill.
        """
        return self.budget_curve(limit).times

    def budget_curve(self, limit: int | None = None) -> BudgetCurve:
        """The :class:`BudgetCurve` of :meth:`fill_curve_ms` (same ``limit``)."""
        if limit is None:
            limit = min(self.iter_cap, self.supply)
        t, smin = kernels.ops().fill_curve(self, limit)
        return BudgetCurve(t, len(self.decodes), smin)

    def fill(self, prefill_tokens: int) -> list[tuple[int, int]]:
        """(snapshot index, tokens) of the greedy fill of ``prefill_tokens``: every
        request that starts before it takes min(r, what is left)."""
        rows, takes = self.fill_arrays(prefill_tokens)
        return list(zip(rows.tolist(), takes.tolist(), strict=True))

    def fill_arrays(self, prefill_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`fill` as arrays: (snapshot indices, tokens)."""
        n = min(len(self.queue), int(np.searchsorted(self.R, prefill_tokens, side="left")))
        return self.queue[:n], np.minimum(self.r[:n], prefill_tokens - self.R[:n])


class BudgetCurve:
    """TimeToBudget on the exact integer grid.

    A fitted linear model need not be monotone in the budget, so instead of a
    binary search we evaluate every budget once and answer "largest P whose
    predicted time ≤ T" through the suffix minimum, which *is* monotone.
    """

    __slots__ = ("n_dec", "suffix_min", "times")

    def __init__(self, times: np.ndarray, n_dec: int, suffix_min: np.ndarray | None = None):
        """``suffix_min`` when the caller computed it (the fill-curve kernel)."""
        self.times = times
        self.n_dec = n_dec
        if suffix_min is None:
            # contiguous: the compiled window search takes it as it is
            suffix_min = np.ascontiguousarray(np.minimum.accumulate(times[::-1])[::-1])
        self.suffix_min = suffix_min

    def prefill_tokens_within(self, t_ms: float, limit: int | None = None) -> int:
        """Largest prefill token count P (≤ ``limit``) with T̂(decodes + P) ≤
        t_ms; −1 if none."""
        p = int(np.searchsorted(self.suffix_min, t_ms, side="right")) - 1
        if limit is not None and p > limit:
            ok = np.flatnonzero(self.times[: limit + 1] <= t_ms)
            p = int(ok[-1]) if len(ok) else -1
        return p

    def prefill_tokens_within_many(self, t_ms: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.suffix_min, t_ms, side="right").astype(np.int64) - 1

    def time_to_budget(self, t_ms: float) -> int:
        """TimeToBudget(T): the largest total budget (decodes included), or
        ``n_dec − 1`` when even the decodes alone are predicted over T."""
        return self.n_dec + self.prefill_tokens_within(t_ms)
