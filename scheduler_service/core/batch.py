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

from dataclasses import dataclass

import numpy as np

from . import kernels
from .features import DECODE, MIXED, PREFILL
from .kernels import QueueView
from .predictor import BatchLatencyPredictor
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
    stream boundaries (R[0] = 0, R[j+1] = R[j] + r[j]).  The predictions run in the
    kernels (``kernels.ops()``), on :attr:`view`.
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
    #: The queue as the kernels take it: the predictor's coefficients, the scenario row
    #: of the model almost every candidate batch uses (mixed with decodes, prefill-only
    #: without), the prefix sums of each full request's features and times under it
    #: (``kernels.QueueView``).
    view: QueueView

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

    def decode_only_ms(self, step: int = 0) -> float:
        """Predicted time of the decodes alone (0 when there are none)."""
        if self.n_dec == 0:
            return 0.0
        return self.predictor.model(DECODE).base_ms(self.n_dec, self.dec_u + step * self.n_dec)

    def prefix_time_ms(self, P: np.ndarray) -> np.ndarray:
        """Predicted time of decodes + the greedy fill of P tokens (the stream prefix
        [0, P)), per entry of P."""
        return kernels.ops().prefix_times(self, np.asarray(P, dtype=np.int64))

    def segment_time_ms(self, X: np.ndarray, Y: np.ndarray, step: int = 0) -> np.ndarray:
        """Predicted times of the batches "decodes + stream segment [X, Y)" (``step``: the
        look-ahead iteration, 0 = this one: decodes are ``step`` tokens longer and the
        segment's first request has computed its tokens before X), as the window search
        prices them; 0 for an empty batch."""
        X, Y = np.asarray(X, dtype=np.int64), np.asarray(Y, dtype=np.int64)
        return kernels.ops().segment_times(self, X, Y, step)

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
        return kernels.ops().fill_prefills(self, prefill_tokens)


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
