"""The policy hot path, written once: compiled by numba, or run as plain Python without it.

Every kernel here is the one definition of its operation.  With numba importable each is
compiled (``numba.njit``, no fast-math: no reassociation or fused multiply-add, so the
compiled code computes what the Python source says, bit for bit); without it the same
functions run as plain Python, and a function's ``py_func`` is its Python source either
way (``kernels.use("numpy")`` runs those).  Property tests hold the compiled path
against that source and against independent brute-force oracles (tests/test_kernels.py).

Floating-point expressions keep one order (``a + b + c`` is ``(a + b) + c``; prefix sums
run left to right), so that a plan's predicted time, compared against a slack, is the
same number on every path.  A "minor" batch (no chunk of more than one token, or a
one-token piece that changes the scenario) is predicted by the scalar formula of
:mod:`..features` wherever it occurs.

Model coefficients come as the predictor's ``coef`` (3, 8): per scenario (decode,
prefill, mixed) the intercept and the weights of x1..x7.  A candidate queue comes as one
:class:`._ops.QueueView` (a NamedTuple of its arrays), read by field name.  The scalar
formulas (a piece, the decode base, one segment) are :mod:`..features`' plain-Python
definitions, compiled here; the constants (scenario rows, the grid's request boundaries,
the heap key's bits, the reason rules) are imported, and numba treats module-level ints as
compile-time constants.  What the facade passes and how it reads the results is
:mod:`._ops`' business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..features import DECODE as _DECODE
from ..features import base_ms_one, piece_ms_one, segment_ms_one
from ..rule_codes import (
    RC_AHEAD,
    RC_BEHIND,
    RC_CLASS_RESCUE,
    RC_CLASS_RESERVE,
    RC_CLASS_SIT_OUT,
    RC_EXPIRED,
    RC_GIVEN_UP,
    RC_KV,
    RC_KV_WATERMARK,
    RC_LATE,
    RC_MAX_NUM_SEQS,
    RC_NOT_CHOSEN,
    RC_TIME_BUDGET,
    RC_TOKEN_BUDGET,
    REASON_RULES,
    REASON_VALUE,
    RULE_SCALAR,
    RULE_SKIP,
    RULE_STARVE,
    seqs_rules,
)
from ._ops import CLASS_BITS, MAX_BOUNDARIES, POS_BITS

try:
    import numba
except ImportError:  # the same functions, as plain Python
    numba = None

#: True when the kernels below are compiled.
COMPILED = numba is not None


def _plain(f: Callable[..., Any]) -> Callable[..., Any]:
    f.py_func = f  # type: ignore[attr-defined]  # as a compiled kernel has it
    return f


_jit: Callable[[Callable[..., Any]], Any] = numba.njit(cache=True, nogil=True) if numba is not None else _plain

__all__ = [
    "class_late_set",
    "fill_curve",
    "fill_prefills",
    "fill_reason_codes",
    "knapsack_pass",
    "late_set",
    "lex_order",
    "lost_mask",
    "mlps_key",
    "mlps_order",
    "prefix_times",
    "queue_arrays",
    "read_back",
    "reason_codes",
    "segment_times",
    "sit_out",
    "sliding_chunk",
    "window_limits",
]

#: Targets of the last window tried one at a time from the top before the rest of a
#: block is evaluated in one pass (the top one is usually feasible).
_TOP_COLUMNS = 4


# --------------------------------------------------------------------- the model
#: ``LinearModel.piece_ms`` of one piece (w: a coefficient row).
_piece = _jit(piece_ms_one)
#: ``LinearModel.base_ms``: intercept plus n decodes of total context du.
_base = _jit(base_ms_one)
#: ``CandidateQueue._segment_ms_scalar``: decodes + stream segment [x, y).
_scalar_segment = _jit(segment_ms_one)


@_jit
def _decode_only(coef: np.ndarray, n_dec: int, dec_u: float, step: int) -> float:
    """``CandidateQueue.decode_only_ms``."""
    if n_dec == 0:
        return 0.0
    return _base(coef[_DECODE], n_dec, dec_u + step * n_dec)


# ------------------------------------------------------------- candidate queue
@_jit
def queue_arrays(remaining: np.ndarray, computed: np.ndarray, queue: np.ndarray, w: np.ndarray):  # type: ignore[no-untyped-def]
    """The arrays of ``CandidateQueue.build``: r, u0, R, the prefix sums of the
    pieces' feature rows, their x7 column, its running max and the prefix sums of
    the pieces' times under the fast-path model row ``w``."""
    n = len(queue)
    r = np.empty(n, dtype=np.int64)
    u0 = np.empty(n, dtype=np.int64)
    R = np.zeros(n + 1, dtype=np.int64)
    pf = np.zeros((n + 1, 7))
    rbig = np.zeros(n)
    pmax = np.zeros(n + 1)
    pw = np.zeros(n + 1)
    for j in range(n):
        r[j] = remaining[queue[j]]
        u0[j] = computed[queue[j]]
        R[j + 1] = R[j] + r[j]
        c, u = float(r[j]), float(u0[j])
        big = c > 1
        row = (c * (u + c) if big else 0.0, c * c if big else 0.0, u, 0.0 if big else 1.0,
               0.0 if big else u, c if big else 0.0, c if big else 0.0)
        for k in range(7):
            pf[j + 1, k] = pf[j, k] + row[k]
        rbig[j] = row[6]
        pmax[j + 1] = max(pmax[j], rbig[j]) if j else rbig[j]
        pw[j + 1] = pw[j] + _piece(w, c, u)
    return r, u0, R, pf, rbig, pmax, pw


@_jit
def _prefix_one(w: np.ndarray, R: np.ndarray, u0: np.ndarray, pw: np.ndarray, pf: np.ndarray,
                pmax: np.ndarray, n_dec: int, base: float, P: int, j: int):  # type: ignore[no-untyped-def]
    """Time of decodes + the first P stream tokens (``prefix_time_ms``'s fast
    formula under the model row w; j = the request P falls in, nq when past the
    end) and whether it is a minor entry (predicted by the scalar formula instead).  Takes the row, not
    the matrix: slicing it here, once per token, cost more than the formula."""
    nq = len(R) - 1
    jc = min(j, nq - 1)
    c = float(P - R[jc]) if j < nq else 0.0
    t = base + pw[j] + _piece(w, c, float(u0[jc])) + w[7] * max(pmax[j], c if c > 1 else 0.0)
    minor = pf[j, 5] == 0 and c <= 1
    if n_dec == 0:
        minor = minor or pf[j, 3] > 0 or c == 1
    return t, minor and P > 0


@_jit
def prefix_times(q, P: np.ndarray):  # type: ignore[no-untyped-def]
    """``CandidateQueue.prefix_time_ms`` of the budgets P on the queue q (a QueueView)."""
    return _prefix_times(q.coef, q.fast, q.R, q.u0, q.pw, q.pf, q.pmax, q.n_dec, q.dec_u, P)


@_jit
def _prefix_times(coef: np.ndarray, fast: int, R: np.ndarray, u0: np.ndarray, pw: np.ndarray,  # type: ignore[no-untyped-def]
                  pf: np.ndarray, pmax: np.ndarray, n_dec: int, dec_u: float, P: np.ndarray):
    """:func:`prefix_times` on the queue's fields."""
    nq = len(R) - 1
    t = np.empty(len(P))
    d0 = _decode_only(coef, n_dec, dec_u, 0)
    if nq == 0:
        t[:] = d0
        return t
    w = coef[fast]
    base = _base(w, n_dec, dec_u)
    for i in range(len(P)):
        j = min(np.searchsorted(R, P[i], side="right") - 1, nq)
        t[i], minor = _prefix_one(w, R, u0, pw, pf, pmax, n_dec, base, P[i], j)
        if minor:
            t[i] = _scalar_segment(coef, R, u0, n_dec, dec_u, 0, P[i], 0)
        if P[i] == 0:
            t[i] = d0
    return t


@_jit
def _fill_times(w: np.ndarray, R: np.ndarray, u0: np.ndarray, pw: np.ndarray, pf: np.ndarray,  # type: ignore[no-untyped-def]
                pmax: np.ndarray, n_dec: int, base: float, limit: int):
    """``_prefix_one`` of P = 0..limit, one request at a time: inside a request the
    chunk c = P − R[j] only grows, so from c = 2 on the formula has no branch left
    and the loop vectorises (the same operations in the same order, so the same
    bits: the ``+ 0.0`` is the decode term of the formula, which is not a no-op on −0)."""
    nq = len(R) - 1
    w1, w2, w3, w6, w7 = w[1], w[2], w[3], w[6], w[7]
    t = np.empty(limit + 1)
    minor = np.zeros(limit + 1, dtype=np.bool_)
    j, p = 0, 0
    while p <= limit:
        while j < nq and R[j + 1] <= p:
            j += 1
        end = limit + 1 if j >= nq else min(limit + 1, R[j + 1])
        while p < end and (j >= nq or p - R[j] < 2):  # past the stream, c = 0, c = 1
            t[p], minor[p] = _prefix_one(w, R, u0, pw, pf, pmax, n_dec, base, p, j)
            p += 1
        if p >= end:
            continue
        u, head, pm = float(u0[j]), base + pw[j], pmax[j]
        b = w3 * u
        for q in range(p, end):
            c = float(q - R[j])
            t[q] = head + (c * (w1 * (u + c) + w2 * c + w6) + b + 0.0) + w7 * max(pm, c)
        if n_dec == 0 and pf[j, 3] > 0:  # a one-token request before: a mixed batch
            minor[p:end] = True
        p = end
    return t, minor


@_jit
def fill_curve(q, limit: int):  # type: ignore[no-untyped-def]
    """``prefix_times`` of P = 0..limit on the queue q, with the suffix minimum of
    ``BudgetCurve``."""
    coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u = q.coef, q.fast, q.R, q.u0, q.pw, q.pf, q.pmax, q.n_dec, q.dec_u
    if len(R) == 1:
        t = _prefix_times(coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u, np.arange(limit + 1))
    else:
        w = coef[fast]
        t, minor = _fill_times(w, R, u0, pw, pf, pmax, n_dec, _base(w, n_dec, dec_u), limit)
        for p in np.flatnonzero(minor):
            t[p] = _scalar_segment(coef, R, u0, n_dec, dec_u, 0, int(p), 0)
        t[0] = _decode_only(coef, n_dec, dec_u, 0)
    smin = np.empty(limit + 1)
    m = np.inf
    for i in range(limit, -1, -1):
        m = min(m, t[i])
        smin[i] = m
    return t, smin


# ---------------------------------------------------------------------- orders
@_jit
def _sort_runs(p: np.ndarray, a: np.ndarray, b: np.ndarray, key: np.ndarray) -> None:
    """Within each run of p whose a and b are equal, order p by key (in place)."""
    n = len(p)
    i = 0
    while i < n:
        j = i + 1
        while j < n and a[p[j]] == a[p[i]] and b[p[j]] == b[p[i]]:
            j += 1
        if 1 < j - i <= 16:  # short runs (equal lengths are common): insertion, no allocation
            for m in range(i + 1, j):
                x = p[m]
                q = m - 1
                while q >= i and key[p[q]] > key[x]:
                    p[q + 1] = p[q]
                    q -= 1
                p[q + 1] = x
        elif j - i > 16:
            run = p[i:j].copy()
            p[i:j] = run[np.argsort(key[run])]
        i = j


@_jit
def _ordered(idx: np.ndarray, k0: np.ndarray, k1: np.ndarray, k2: np.ndarray):  # type: ignore[no-untyped-def]
    """idx sorted by (k0, k1, k2), and whether two neighbours tie on all three (the
    caller then breaks ties by id, as ``sorter.ordered`` does).  Unstable sorts
    suffice: without a tie the order is unique, and with one the caller re-sorts.
    Quicksort on k0, then runs of equal k0 by k1, then runs of equal (k0, k1) by k2:
    a few times faster than a merge sort on queues of mostly distinct keys."""
    c0 = len(k0) == 0 or k0.min() == k0.max()  # constant keys order nothing (FCFS, MLPS's k1)
    c1 = len(k1) == 0 or k1.min() == k1.max()
    if c0 and c1:
        p = np.argsort(k2)
    elif c0:
        p = np.argsort(k1)
        _sort_runs(p, k1, k1, k2)
    else:
        p = np.argsort(k0)
        if not c1:
            _sort_runs(p, k0, k0, k1)
        _sort_runs(p, k0, k1, k2)
    tie = False
    for i in range(1, len(p)):
        a, b = p[i - 1], p[i]
        if k0[a] == k0[b] and k1[a] == k1[b] and k2[a] == k2[b]:
            tie = True
            break
    return idx[p], tie


@_jit
def lex_order(idx: np.ndarray, k0: np.ndarray, k1: np.ndarray, arrival: np.ndarray):  # type: ignore[no-untyped-def]
    """``ordered(snap, idx, k0, k1)``: an integer key, a float key (both over idx),
    then arrival."""
    k2 = np.empty(len(idx))
    for i in range(len(idx)):
        k2[i] = arrival[idx[i]]
    return _ordered(idx, k0, k1, k2)


@_jit
def mlps_key(idx: np.ndarray, remaining: np.ndarray, slack: np.ndarray, protected: np.ndarray,  # type: ignore[no-untyped-def]
             throughput: float, alpha: float, eps: float, expired_last: bool, lost: np.ndarray, cls: np.ndarray):
    """``sorter.mlps_order``'s key over idx, formulas (13)–(16): (expired, class, 1 − g,
    1 − e, r) packed in one integer, the urgency u = r / (throughput · max(slack, eps))
    and e = u > alpha; r < 2^41, the class rank below 2^CLASS_BITS.  A late (expired or
    lost) request's key is (1, class): the late ones go oldest first.  ``lost`` is a mask
    over idx, ``cls`` the class rank of each (both empty = none, one class)."""
    n = len(idx)
    k0 = np.empty(n, dtype=np.int64)
    for i in range(n):
        q = idx[i]
        r = remaining[q]
        s = slack[q]
        u = r / (throughput * max(s, eps))
        late = (expired_last and s <= 0) or (len(lost) > 0 and lost[i])
        c = cls[i] if len(cls) else 0
        if late:  # oldest first among the late ones
            k0[i] = (1 << (43 + CLASS_BITS)) | (c << 43)
        else:
            k0[i] = (c << 43) | (int(not protected[q]) << 42) | (int(not u > alpha) << 41) | r
    return k0


@_jit
def mlps_order(idx: np.ndarray, remaining: np.ndarray, slack: np.ndarray, protected: np.ndarray,  # type: ignore[no-untyped-def]
               arrival: np.ndarray, throughput: float, alpha: float, eps: float,
               expired_last: bool, lost: np.ndarray, cls: np.ndarray):
    """idx sorted by :func:`mlps_key`, then arrival, and whether two tie (ids break it)."""
    return lex_order(idx, mlps_key(idx, remaining, slack, protected, throughput, alpha, eps, expired_last, lost, cls),
                     np.zeros(len(idx)), arrival)


@_jit
def _argsort_by_pos(key: np.ndarray) -> np.ndarray:
    """Stable argsort (ties by position, as ``np.lexsort((arange, key))``): quicksort,
    then each run of equal keys back in position order."""
    p = np.argsort(key)
    n = len(p)
    i = 0
    while i < n:
        j = i + 1
        while j < n and key[p[j]] == key[p[i]]:
            j += 1
        if j - i > 1:
            p[i:j] = np.sort(p[i:j])
        i = j
    return p


# ------------------------------------------------------------------ lost set
#: ``late_set``'s heap holds one int64 per request: protected << 61 | (2^40 − r) << 20
#: | position, so that the smallest key is the one to give up first (unprotected
#: first, then the most remaining tokens, then the first position).  Remaining tokens
#: order as remaining / rate does (a division by one positive rate of integers below
#: 2^41 keeps them apart); positions below 2^20 (the caller checks).
_POS_BITS = POS_BITS


@_jit
def _heap_push(h: np.ndarray, n: int, key: int) -> int:
    i = n
    while i > 0:
        up = (i - 1) // 2
        if h[up] <= key:
            break
        h[i] = h[up]
        i = up
    h[i] = key
    return n + 1


@_jit
def _heap_pop(h: np.ndarray, n: int) -> int:
    """Remove the root (read it first); the new size."""
    n -= 1
    last = h[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and h[c + 1] < h[c]:
            c += 1
        if last <= h[c]:
            break
        h[i] = h[c]
        i = c
    h[i] = last
    return n


@_jit
def late_set(idx: np.ndarray, remaining: np.ndarray, slack: np.ndarray, protected: np.ndarray,
             throughput: float) -> np.ndarray:
    """``sorter.late_set``: Moore–Hodgson over idx in deadline (slack) order at
    ``throughput``; a mask over idx."""
    rem = np.empty(len(idx), dtype=np.int64)
    for i in range(len(idx)):
        rem[i] = remaining[idx[i]]
    return _late_set(rem, rem / throughput, slack[idx], protected[idx])


@_jit
def _late_set(rem: np.ndarray, r: np.ndarray, s: np.ndarray, prot: np.ndarray) -> np.ndarray:
    """``late_set`` on gathered columns (r = rem / rate): walked in deadline order (ties
    by position), each live request is taken; while the running sum of times is past the
    slack of the last one taken, the one the heap holds first is given up (unprotected
    first, then the most remaining tokens, then the first position)."""
    lost = s <= 0
    order = _argsort_by_pos(s)
    h = np.empty(len(r), dtype=np.int64)
    mask = (1 << _POS_BITS) - 1
    size = 0
    t = 0.0
    for j in order:
        if s[j] <= 0:
            continue
        key = (int(prot[j]) << 61) | (((1 << 40) - rem[j]) << _POS_BITS) | j
        size = _heap_push(h, size, key)
        t += r[j]
        while t > s[j] and size:
            k = h[0] & mask
            t += -r[k]
            lost[k] = True
            size = _heap_pop(h, size)
    return lost


@_jit
def class_late_set(idx: np.ndarray, remaining: np.ndarray, slack: np.ndarray, protected: np.ndarray,
                   prio: np.ndarray, throughput: float) -> np.ndarray:
    """``sorter.class_late_set``: :func:`late_set` with request classes."""
    n = len(idx)
    rem = np.empty(n, dtype=np.int64)
    p = np.empty(n, dtype=np.int64)
    for i in range(n):
        rem[i] = remaining[idx[i]]
        p[i] = prio[idx[i]]
    return _class_late_set(rem, rem / throughput, slack[idx], protected[idx], p)


@_jit
def _class_late_set(rem: np.ndarray, r: np.ndarray, s: np.ndarray, prot: np.ndarray, prio: np.ndarray) -> np.ndarray:
    """Classes from the highest (smallest priority) down: the requests kept so far plus
    the class's own live ones are walked in deadline order; whenever the running sum is
    past the slack of the one just walked, the request of *this* class that the heap
    holds first is given up (as in :func:`_late_set`).  The higher classes' kept set is
    on time by itself, so each class ends on time.  With one class: :func:`_late_set`."""
    levels = np.unique(prio)
    if len(levels) <= 1:
        return _late_set(rem, r, s, prot)
    n = len(r)
    lost = s <= 0
    by_deadline = _argsort_by_pos(s)
    kept = np.zeros(n, dtype=np.bool_)
    h = np.empty(n, dtype=np.int64)
    mask = (1 << _POS_BITS) - 1
    for level in levels:
        for i in range(n):
            kept[i] = kept[i] or (prio[i] == level and not lost[i])
        size = 0
        t = 0.0
        for j in by_deadline:
            if not kept[j]:  # (only a request already walked leaves the kept set)
                continue
            t += r[j]
            if prio[j] == level:
                size = _heap_push(h, size, (int(prot[j]) << 61) | (((1 << 40) - rem[j]) << _POS_BITS) | j)
            while t > s[j] and size:
                k = h[0] & mask
                t += -r[k]
                lost[k] = True
                kept[k] = False
                size = _heap_pop(h, size)
    return lost


@_jit
def lost_mask(pre: np.ndarray, remaining: np.ndarray, slack: np.ndarray, protected: np.ndarray, prio: np.ndarray,
              rho: float, rho_max: float, hopeless_factor: float, moore: bool, classes: bool) -> np.ndarray:
    """``SlidingServePolicy._lost``: hopeless prefills (optimistic: the request alone with
    the whole budget, at ``rho_max``), then the (class) Moore–Hodgson lost set at ``rho``,
    live ones only."""
    n = len(pre)
    rem = np.empty(n, dtype=np.int64)
    s = np.empty(n)
    prot = np.empty(n, dtype=np.bool_)
    p = np.empty(n, dtype=np.int64)
    lost = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        rem[i] = remaining[pre[i]]
        s[i] = slack[pre[i]]
        prot[i] = protected[pre[i]]
        p[i] = prio[pre[i]]
        if hopeless_factor > 0:
            lost[i] = remaining[pre[i]] > rho_max * s[i] * hopeless_factor
    if moore and n:
        lost |= _class_late_set(rem, rem / rho, s, prot, p) if classes else _late_set(rem, rem / rho, s, prot)
    return lost & (s > 0)


@_jit
def sit_out(dec_all: np.ndarray, pre: np.ndarray, slack: np.ndarray, tbt: np.ndarray, lost: np.ndarray,  # type: ignore[no-untyped-def]
            skip_tbts: float, skip_late: bool, starve: float):
    """``SlidingServePolicy._sit_out``: the live prefills, and the mask over dec_all of
    the decodes that sit out (none unless a decode and a live prefill exist); a late
    decode sits out only while less than ``starve`` TBTs late (``starve`` 0: always)."""
    keep = np.empty(len(pre), dtype=np.bool_)
    for i in range(len(pre)):
        keep[i] = slack[pre[i]] > 0 and not lost[i]
    live = pre[keep]
    out = np.zeros(len(dec_all), dtype=np.bool_)
    if len(dec_all) and len(live):
        for i in range(len(dec_all)):
            s = slack[dec_all[i]]
            late = skip_late and s <= 0 and (starve <= 0 or s > -starve * tbt[dec_all[i]])
            out[i] = (skip_tbts > 0 and s > skip_tbts * tbt[dec_all[i]]) or late
    return live, out


@_jit
def window_limits(slack: np.ndarray, tbt: np.ndarray, decodes: np.ndarray, k: int,
                  margin: float) -> np.ndarray:
    """``chunker.window_limits_ms`` / margin; empty when no decode is safe (None)."""
    W = np.full(k, np.inf)
    safe = False
    for i in decodes:
        s = slack[i]
        if s > 0:
            safe = True
            for m in range(k):
                W[m] = min(W[m], s + m * tbt[i])
    if not safe:
        return np.zeros(0)
    W *= 1e3
    if margin != 1.0:
        W /= margin
    return W


# ------------------------------------------------------------- window search
@_jit
def _within(times: np.ndarray, smin: np.ndarray, t: float, limit: int) -> int:
    """``BudgetCurve.prefill_tokens_within``."""
    p = int(np.searchsorted(smin, t, side="right")) - 1
    if p > limit:
        for q in range(limit, -1, -1):
            if times[q] <= t:
                return q
        return -1
    return p


@_jit
def _grid(R: np.ndarray, k: int, granularity: int, max_points: int, first_cap: int, iter_cap: int,
          reach: int, n_bounds: int) -> np.ndarray:
    """``chunker.grid_positions`` with ``first_tokens=reach``."""
    supply = R[-1]
    per_iter = max(1, min(reach, first_cap))
    xmax = min(supply, per_iter + (k - 1) * iter_cap)
    g = max(1, granularity)
    if per_iter > g * max_points:
        g *= (per_iter + g * max_points - 1) // (g * max_points)
    nb_ = min(n_bounds, len(R))
    pts = np.empty(xmax // g + 1 + nb_ + 3, dtype=np.int64)
    n = 0
    for x in range(0, xmax + 1, g):
        pts[n] = x
        n += 1
    pts[n:n + nb_] = R[:nb_]
    n += nb_
    pts[n], pts[n + 1], pts[n + 2] = first_cap, per_iter, xmax
    grid = np.unique(pts)
    return grid[grid <= xmax]


@_jit
def _ends(grid: np.ndarray, R: np.ndarray, u0: np.ndarray, pw: np.ndarray, pf: np.ndarray,  # type: ignore[no-untyped-def]
          w: np.ndarray):
    """Per grid position, its terms as a segment's start (head piece) and as a
    segment's end (tail piece), which :func:`_pair_row` combines."""
    nq = len(R) - 1
    G = len(grid)
    jh = np.empty(G, dtype=np.int64)
    jt = np.empty(G, dtype=np.int64)
    hv = np.empty((G, 5))  # uh, ch_full, head piece, its x7 share, pw[jh + 1]
    tv = np.empty((G, 4))  # ct, tail piece, its x7 share, pw[jt]
    h4 = np.empty(G)
    h6 = np.empty(G)
    t4 = np.empty(G)
    t6 = np.empty(G)
    for i in range(G):
        x = grid[i]
        a = min(max(np.searchsorted(R, x, side="right") - 1, 0), nq - 1)
        b = min(max(np.searchsorted(R, x - 1, side="right") - 1, 0), nq - 1)
        jh[i], jt[i] = a, b
        uh = float(u0[a] + (x - R[a]))
        ch = float(R[a + 1] - x)
        hv[i, 0], hv[i, 1], hv[i, 2] = uh, ch, _piece(w, ch, uh)
        hv[i, 3], hv[i, 4] = (ch if ch > 1 else 0.0), pw[a + 1]
        h6[i], h4[i] = pf[a + 1, 5], pf[a + 1, 3]
        ct = float(x - R[b])
        tv[i, 0], tv[i, 1] = ct, _piece(w, ct, float(u0[b]))
        tv[i, 2], tv[i, 3] = (ct if ct > 1 else 0.0), pw[b]
        t6[i], t4[i] = pf[b, 5], pf[b, 3]
    return jh, jt, hv, tv, h4, h6, t4, t6


@_jit
def _pair_row(a: int, cols: np.ndarray, out: np.ndarray, grid: np.ndarray, R: np.ndarray,  # type: ignore[no-untyped-def]
              u0: np.ndarray, rbig: np.ndarray, coef: np.ndarray, fast: int, n_dec: int, dec_u: float,
              step: int, ends) -> None:  # type: ignore[no-untyped-def]
    """The predicted times of the segments [grid[a], grid[c]) for the ascending ``cols``
    into ``out`` (a minor one by the scalar formula; inf where grid[c] < grid[a])."""
    jh, jt, hv, tv, h4, h6, t4, t6 = ends
    w = coef[fast]
    base = _base(w, n_dec, dec_u + step * n_dec)
    d_only = _decode_only(coef, n_dec, dec_u, step)
    X = grid[a]
    uh, chf, head, bigh, pwh = hv[a, 0], hv[a, 1], hv[a, 2], hv[a, 3], hv[a, 4]
    inner, nxt = 0.0, jh[a] + 1  # running max of rbig over (jh, jt)
    for o in range(len(cols)):
        c = cols[o]
        Y = grid[c]
        if Y <= X:
            out[o] = np.inf if Y < X else d_only
            continue
        while nxt < jt[c]:
            inner = max(inner, rbig[nxt])
            nxt += 1
        ct, tail, bigt, pwt = tv[c, 0], tv[c, 1], tv[c, 2], tv[c, 3]
        if jt[c] > jh[a]:
            minor = t6[c] - h6[a] <= 0 and bigh == 0 and bigt == 0
            if n_dec == 0:
                minor = minor or t4[c] - h4[a] > 0 or chf == 1 or ct == 1
            out[o] = base + (head + (pwt - pwh) + tail + w[7] * max(max(inner, bigh), bigt))
        else:
            c1 = float(Y - X)
            minor = c1 <= 1
            out[o] = base + (_piece(w, c1, uh) + w[7] * (c1 if c1 > 1 else 0.0))
        if minor:
            out[o] = _scalar_segment(coef, R, u0, n_dec, dec_u, X, Y, step)


@_jit
def segment_times(q, X: np.ndarray, Y: np.ndarray, step: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The predicted times of the batches "decodes (``step`` tokens longer) + stream
    segment [X[i], Y[i])" on the queue q, each the way the window search prices it."""
    out = np.empty(len(X))
    cols = np.ones(1, dtype=np.int64)
    for i in range(len(X)):
        if len(q.R) == 1 or Y[i] <= X[i]:  # an empty segment: the decodes alone
            out[i] = np.inf if Y[i] < X[i] else _decode_only(q.coef, q.n_dec, q.dec_u, step)
            continue
        grid = np.array([X[i], Y[i]], dtype=np.int64)
        ends = _ends(grid, q.R, q.u0, q.pw, q.pf, q.coef[q.fast])
        _pair_row(0, cols, out[i:i + 1], grid, q.R, q.u0, q.rbig, q.coef, q.fast, q.n_dec, q.dec_u, step, ends)
    return out


@_jit
def _step(best: np.ndarray, first: np.ndarray, cols: np.ndarray, w_m: float, tol: float, step: int,  # type: ignore[no-untyped-def]
          grid: np.ndarray, R: np.ndarray, u0: np.ndarray, rbig: np.ndarray, coef: np.ndarray, fast: int,
          n_dec: int, dec_u: float, iter_cap: int, ends):  # type: ignore[no-untyped-def]
    """One transition of the window search's DP to the targets ``grid[cols]``: per target
    the cumulative time and the source chosen.  Among sources within ``tol`` of the least
    time the one whose path has the larger b_1 wins (then the larger source); the
    intermediate windows use tol = 0, which keeps the DP exact.  A target no source
    reaches gets an infinite time."""
    src = np.flatnonzero(np.isfinite(best))
    nc = len(cols)
    out_t = np.full(nc, np.inf)
    out_p = np.zeros(nc, dtype=np.int64)
    if len(src) == 0:
        return out_t, out_p
    G = len(grid)
    tot = np.empty((len(src), nc))
    for i in range(len(src)):
        a = src[i]
        row = tot[i]
        _pair_row(a, cols, row, grid, R, u0, rbig, coef, fast, n_dec, dec_u, step, ends)
        for o in range(nc):
            row[o] = best[a] + row[o]
            if grid[cols[o]] - grid[a] > iter_cap or row[o] > w_m:
                row[o] = np.inf
    for o in range(nc):
        lo = np.inf
        for i in range(len(src)):
            lo = min(lo, tot[i, o])
        thr = lo + tol
        arg, top = 0, -1
        for i in range(len(src)):
            if tot[i, o] <= thr:
                rank = first[src[i]] * (G + 1) + src[i]
                if rank > top:
                    arg, top = i, rank
        out_t[o], out_p[o] = tot[arg, o], src[arg]
    return out_t, out_p


@_jit
def _drain(coef: np.ndarray, fast: int, R: np.ndarray, u0: np.ndarray, pw: np.ndarray, pf: np.ndarray,
           pmax: np.ndarray, n_dec: int, dec_u: float, first_cap: int, W: np.ndarray) -> bool:
    """``chunker._drain``: the whole queue now, then decode-only iterations, fit every window."""
    supply = R[-1]
    if supply == 0 or supply > first_cap:
        return False
    total = _prefix_times(coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u, np.array([supply]))[0]
    if total > W[0]:
        return False
    for m in range(1, len(W)):
        total += _decode_only(coef, n_dec, dec_u, m)
        if total > W[m]:
            return False
    return True


@_jit
def _last_window(best: np.ndarray, first: np.ndarray, W: np.ndarray, tol: float, grid: np.ndarray,  # type: ignore[no-untyped-def]
                 R: np.ndarray, u0: np.ndarray, rbig: np.ndarray, coef: np.ndarray, fast: int, n_dec: int,
                 dec_u: float, iter_cap: int, ends) -> int:
    """The DP's last step: b_1 of the largest feasible total, 0 when no split fits the
    last window.  Only the largest feasible total matters, so the targets are scanned
    from the top in blocks: the top few targets first (usually feasible), and only if
    none is, the rest of the block."""
    k = len(W)
    src = np.flatnonzero(np.isfinite(best))
    if len(src) == 0:
        return 0
    block = max(8, 8192 // len(src))
    hi = len(grid)
    while hi > 0:
        cols = np.arange(max(0, hi - block), hi)
        rest = max(0, len(cols) - _TOP_COLUMNS)
        for part in (cols[rest:], cols[:rest]):
            if len(part) == 0:
                continue
            b, pars = _step(best, first, part, W[k - 1], tol, k - 1, grid, R, u0, rbig, coef, fast,
                               n_dec, dec_u, iter_cap, ends)
            for o in range(len(part) - 1, -1, -1):
                if np.isfinite(b[o]):
                    return grid[first[pars[o]]]
        hi -= block
    return 0


@_jit
def sliding_chunk(q, first_cap: int, iter_cap: int, W: np.ndarray, granularity: int,  # type: ignore[no-untyped-def]
                  max_points: int, times: np.ndarray, smin: np.ndarray, tol: float) -> int:
    """``chunker.sliding_chunk`` from the queue q (a QueueView) and its fill curve (times
    and suffix minimum): b_1, the first iteration's prefill tokens.

    The windows' DP runs over a grid of stream positions (every ``granularity`` tokens,
    widened so that the first iteration's range holds at most ``max_points`` of them, plus
    the first request boundaries and the caps): b_1 is the position of the first
    iteration, then one transition per window; ties between equally fast paths go to the
    larger b_1 (``first[j]``: the grid index of b_1 on the path chosen into j)."""
    coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u = q.coef, q.fast, q.R, q.u0, q.pw, q.pf, q.pmax, q.n_dec, q.dec_u
    rbig = q.rbig
    n_bounds = MAX_BOUNDARIES + 1
    k = len(W)
    if R[-1] == 0 or first_cap == 0:
        return 0
    if _drain(coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u, first_cap, W):
        return R[-1]
    reach = _within(times, smin, W[0], first_cap)
    if reach < 0:
        return 0
    grid = _grid(R, k, granularity, max_points, first_cap, iter_cap, reach, n_bounds)
    ends = _ends(grid, R, u0, pw, pf, coef[fast])
    n_in = 0
    while n_in < len(grid) and grid[n_in] <= first_cap:
        n_in += 1
    t1 = _prefix_times(coef, fast, R, u0, pw, pf, pmax, n_dec, dec_u, grid[:n_in])
    best = np.full(len(grid), np.inf)
    for i in range(n_in):
        if t1[i] <= W[0]:
            best[i] = t1[i]
    if not np.isfinite(best).any():
        return 0
    first = np.arange(len(grid))
    every = np.arange(len(grid))
    for m in range(1, k - 1):
        best, par = _step(best, first, every, W[m], 0.0, m, grid, R, u0, rbig, coef, fast, n_dec, dec_u,
                          iter_cap, ends)
        first = first[par]
        if not np.isfinite(best).any():
            return 0
    if k > 1:
        return _last_window(best, first, W, tol, grid, R, u0, rbig, coef, fast, n_dec, dec_u, iter_cap, ends)
    return grid[np.flatnonzero(np.isfinite(best))[-1]]


# ------------------------------------------------------------ batch constructor
@_jit
def knapsack_pass(w: np.ndarray, v: np.ndarray, cap: np.ndarray, cmax: int):  # type: ignore[no-untyped-def]
    """``constructor._knapsack_pass``: the choice bits, and per pool position with an
    anchor capacity (cap ≥ 0) the dp value and packed (count, weight) cell the pass
    read when it reached it.  Cells are updated from the top down, so each item
    reads the values before it."""
    n = len(w)
    dp = np.zeros(cmax + 1)
    cw = np.zeros(cmax + 1, dtype=np.int64)
    take = np.zeros((n, cmax + 1), dtype=np.bool_)
    adp = np.zeros(n)
    acw = np.zeros(n, dtype=np.int64)
    for p in range(n):
        if cap[p] >= 0:
            adp[p], acw[p] = dp[cap[p]], cw[cap[p]]
        wp = w[p]
        if wp > cmax:
            continue
        inc = (1 << 32) + wp
        for c in range(cmax, wp - 1, -1):
            cand = dp[c - wp] + v[p]
            if cand > dp[c]:
                dp[c] = cand
                cw[c] = cw[c - wp] + inc
                take[p, c] = True
    return take, adp, acw


@_jit
def read_back(take: np.ndarray, w: np.ndarray, pa: int, c: int) -> np.ndarray:
    """Pool positions the knapsack chose before ``pa`` at capacity c (nearest first)."""
    out = np.empty(pa, dtype=np.int64)
    n = 0
    for p in range(pa - 1, -1, -1):
        if take[p, c]:
            out[n] = p
            n += 1
            c -= w[p]
    return out[:n]


# ----------------------------------------------------------------------- reasons
# The passes over the rows have no branch on their data.  A waiting row's reason
# is the first rule of REASON_RULES that is on and holds: the lowest set bit of (the
# rules on) & (the rules that hold for the row), rule j at bit j and ``behind`` (always on,
# always holds) above them.  A snapshot's slacks and sets are new every iteration, so a
# branch on them is mispredicted about as often as not: the same pass written as an
# if-chain took 8.5 us a plan on 100 distinct busy snapshots against 5.3 us on 5 seen
# again and again (the predictor had learnt them), and in a decision's wake 14 us.
_RULE_BIT = {c: j for j, c in enumerate(REASON_RULES)}
_BEHIND_BIT = len(REASON_RULES)
#: A row's flags (:func:`_row_flags`, one byte) sit at the bits of the rules they decide:
#: it gets a token (max_num_seqs holds where it does not), held by the class reserve, in
#: the lost set, rescued; and it gets all it needs at token_budget's bit, which holds for
#: every row anyway.
_GETS, _HELD, _LOST, _RESCUED, _SERVED = (1 << _RULE_BIT[c] for c in (
    RC_MAX_NUM_SEQS, RC_CLASS_RESERVE, RC_GIVEN_UP, RC_CLASS_RESCUE, RC_TOKEN_BUDGET))
assert max(_GETS, _HELD, _LOST, _RESCUED, _SERVED) < 256, "a row's flags fit in a byte"
_FLAG_RULES = _GETS | _HELD | _LOST | _RESCUED
_ALWAYS = (1 << _RULE_BIT[RC_TOKEN_BUDGET]) | (1 << _RULE_BIT[RC_KV]) | (1 << _BEHIND_BIT)
_DECODE_RULES = 1 << _RULE_BIT[RC_CLASS_SIT_OUT]
_PREFILL_RULES = (1 << _RULE_BIT[RC_KV_WATERMARK]) | (1 << _RULE_BIT[RC_NOT_CHOSEN]) | (
    1 << _RULE_BIT[RC_TIME_BUDGET])
_EXPIRED_AT, _LATE_AT, _AHEAD_AT = (_RULE_BIT[c] for c in (RC_EXPIRED, RC_LATE, RC_AHEAD))
assert max(REASON_VALUE[c] for c in (*REASON_RULES, RC_BEHIND)) < 3, "a rule's value is never a KV count"
#: The lowest set bit of a word below 2**32 by de Bruijn's multiply-and-look-up; here the
#: code of the rule at that bit (bits past ``behind``'s are never set).
_DE_BRUIJN = 0x077CB531
_LOWEST_CODE = np.full(32, RC_BEHIND, dtype=np.int8)
for _b, _c in enumerate((*REASON_RULES, RC_BEHIND)):
    _LOWEST_CODE[((1 << _b) * _DE_BRUIJN & 0xFFFFFFFF) >> 27] = _c
_LOWEST_KIND = REASON_VALUE[_LOWEST_CODE]  # what that rule's value is (REASON_VALUE)


@_jit
def _row_flags(flags, dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked, remaining):  # type: ignore[no-untyped-def]
    """Per row, in ``flags`` (one byte each, zeroed): what a plan that gives one token to
    each of ``dec_rows`` and ``pre_toks[j]`` to ``pre_rows[j]`` (the last word for a row)
    gives it, and the sets it is in (the lost set: ``lost_from[lost_mask]``; ``marked``:
    held back, a prefill, or rescued, a decode), as the bits :data:`_GETS` to
    :data:`_SERVED`.  A decode has ``remaining`` 0 and needs one token; a row that gets no
    token always waits (a prefill has at least one token left)."""
    for i in dec_rows:
        flags[i] = _GETS | (remaining[i] <= 1) * _SERVED
    for j in range(pre_rows.shape[0]):
        i = pre_rows[j]
        g = pre_toks[j]
        flags[i] = (g > 0) * _GETS | (g >= max(remaining[i], 1)) * _SERVED
    for j in range(lost_from.shape[0]):
        flags[lost_from[j]] |= lost_mask[j] * _LOST
    for i in marked:
        flags[i] |= _HELD + (remaining[i] == 0) * (_RESCUED - _HELD)


@_jit
def _reason_value(kind, slack, prio, kv, scalar):  # type: ignore[no-untyped-def]
    """A reason's value by its kind (:data:`REASON_VALUE`): the slack in ms, the class
    priority, the request's KV tokens, or the plan-wide quantity."""
    if kind == 1:
        return slack * 1e3
    if kind == 2:
        return float(prio)
    if kind == 3:
        return float(kv)
    return scalar


@_jit
def _scalar(rules, c, behind, own_rule, own_value):  # type: ignore[no-untyped-def]
    """Rule ``c``'s number: ``behind``'s the plan's count, ``own_rule``'s ``own_value``,
    any other's in ``rules``."""
    if c == RC_BEHIND:
        return behind
    if c == own_rule:
        return own_value
    return rules[RULE_SCALAR + c]


@_jit
def reason_codes(dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked, verdicts, rules, own_rule,  # type: ignore[no-untyped-def]
                 own_value, remaining, slack, tbt, step, prio):
    """(waiting rows, their code indices, their values) of a plan that gives one token to
    each of ``dec_rows`` and ``pre_toks[j]`` to row ``pre_rows[j]``: the rows that get
    fewer tokens than they need (a decode, ``remaining`` 0, one; a prefill what remains),
    each given the first rule of ``REASON_RULES`` that is on (``rules``, laid out as
    ``rule_codes.RULE_SCALAR`` says) and holds for it, a verdict (``verdicts``: rows, their
    codes, their KV tokens) overriding it.  The rules' predicates: ``max_num_seqs`` no
    token; ``token_budget``, ``kv`` every row; ``kv_watermark`` a prefill;
    ``class_reserve`` a prefill in ``marked`` (held back); ``given_up`` in
    ``lost_from[lost_mask]``; ``expired`` a prefill with slack <= 0; ``class_rescue`` a
    decode in ``marked`` (sat out); ``late`` a decode with slack <= 0 (and, the starvation
    bound > 0, above minus that many TBTs); ``ahead`` a decode with slack > the decode
    skip's steps; ``class_sit_out`` a decode; ``not_chosen``, ``time_budget`` a prefill.
    Values per ``REASON_VALUE``; a rule's own number from ``rules`` (``own_rule``'s
    ``own_value``, −1 for none; ``behind``'s the count served).

    Two passes over the snapshot's rows, without a branch on their data: each row's rules
    that hold as bits, the first that is on by its lowest set bit; then every row is
    written and only a waiting one advances the output (the verdicts, few, looked up
    afterwards; a plan that fills its token budget or KV takes :func:`_limited_codes`).
    The rows and the values share one allocation: what a plan keeps are views of the two."""
    n = remaining.shape[0]
    flags = np.zeros(n, dtype=np.uint8)
    _row_flags(flags, dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked, remaining)
    codes = np.empty(n, dtype=np.int8)
    buf = np.empty(2 * n, dtype=np.int64)
    rows = buf[:n]
    values = buf[n:].view(np.float64)
    behind = float(dec_rows.shape[0] + pre_rows.shape[0])
    k = _waiting_codes(flags, codes, rows, values, rules, behind, own_rule, own_value, remaining, slack, tbt, step,
                       prio)
    for j in range(verdicts.shape[1]):  # the verdicts, which come before every rule (waiting rows)
        r = verdicts[0, j]
        at = np.searchsorted(rows[:k], r)
        if at == k or rows[at] != r:
            continue
        c = verdicts[1, j]
        codes[at] = c
        values[at] = _reason_value(REASON_VALUE[c], slack[r], prio[r], verdicts[2, j],
                                   _scalar(rules, c, behind, own_rule, own_value))
    return rows[:k], codes[:k], values[:k]  # views: no copy of what a plan keeps anyway


@_jit
def fill_prefills(queue, R, r, p1):  # type: ignore[no-untyped-def]
    """``CandidateQueue.fill_arrays``: the greedy fill of ``p1`` prompt tokens over the
    queue (``R`` its prefix sums, ``r`` what each needs), as (rows, tokens)."""
    n = min(queue.shape[0], np.searchsorted(R, p1))
    toks = np.empty(n, dtype=np.int64)
    for j in range(n):
        toks[j] = min(r[j], p1 - R[j])
    return queue[:n], toks


#: ``rule_codes.seqs_rules``: the ``max_num_seqs`` rule on where a plan reaches it.
_seqs_rules = _jit(seqs_rules)


@_jit
def fill_reason_codes(queue, R, r, p1, max_seqs, dec_rows, lost_from, lost_mask, marked, verdicts, rules,  # type: ignore[no-untyped-def]
                      own_rule, own_value, remaining, slack, tbt, step, prio):
    """:func:`fill_prefills`, then :func:`reason_codes` of the plan that gives one token
    to each of ``dec_rows`` and the fill to the prefills, in one call (a compiled call's
    own cost, in a decision's wake, is about that of the classification), the
    ``max_num_seqs`` rule on (``max_seqs``) when the fill reaches it with the decodes:
    (prefill rows, their tokens, waiting rows, codes, values)."""
    pre_rows, pre_toks = fill_prefills(queue, R, r, p1)
    rows, codes, values = reason_codes(dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked, verdicts,
                                       _seqs_rules(rules, dec_rows.shape[0] + pre_rows.shape[0], max_seqs),
                                       own_rule, own_value, remaining, slack, tbt, step, prio)
    return pre_rows, pre_toks, rows, codes, values


@_jit
def _waiting_codes(flags, codes, rows, values, rules, behind, own_rule, own_value, remaining, slack, tbt,  # type: ignore[no-untyped-def]
                   step, prio):
    """The pass of :func:`reason_codes` over the rows' ``flags``: each waiting row's
    first rule that is on (``rules[c]`` nonzero) and holds, its row, code and value
    written at the next place of ``rows``, ``codes``, ``values``; how many."""
    if rules[RC_TOKEN_BUDGET] != 0 or rules[RC_KV] != 0:  # a hard limit holds for every row
        return _limited_codes(flags, codes, rows, values, rules, behind, own_rule, own_value)
    on = np.int64(1) << _BEHIND_BIT
    for j in range(_BEHIND_BIT):
        if rules[REASON_RULES[j]] != 0:
            on |= np.int64(1) << j
    # per de Bruijn index: the rule's own number (what its value is: _LOWEST_KIND), then
    # a row's three values
    scalar = np.empty(35)
    for b in range(32):
        scalar[b] = _scalar(rules, _LOWEST_CODE[b], behind, own_rule, own_value)
    starve = rules[RULE_STARVE]
    skip = rules[RULE_SKIP]
    unbounded = np.int32(starve <= 0)
    on32 = np.int32(on)
    # 1. per row, the de Bruijn index of its first rule, in the codes' bytes: no table and
    # no output position here, so that the compiler vectorises the loop
    first = codes.view(np.uint8)
    for i in range(flags.shape[0]):
        m = np.int32(flags[i])
        d = np.int32(remaining[i] == 0)
        s = slack[i]
        gone = np.int32(s <= 0)
        late = gone & (unbounded | np.int32(s > -starve * tbt[i]))
        ahead = np.int32(s > skip * step[i])
        as_decode = _DECODE_RULES | (late << _LATE_AT) | (ahead << _AHEAD_AT)
        as_prefill = _PREFILL_RULES | (gone << _EXPIRED_AT)
        holds = ((m ^ _GETS) & _FLAG_RULES) | _ALWAYS | (as_prefill + d * (as_decode - as_prefill))
        x = np.uint32(holds & on32)
        first[i] = ((np.int64(x & (x ^ (x - np.uint32(1)))) * _DE_BRUIJN) & 0xFFFFFFFF) >> 27  # x > 0: behind
    # 2. the waiting rows' codes and values, packed: every row is written, only a waiting
    # one advances (a row's index is read before a code is written over it: k <= i)
    # (a value picked by an index, not a branch: the compiler turned a select into one,
    # mispredicted on a new snapshot, 1-2 us a plan; a verdict's KV value is never a rule's)
    value = scalar[32:]
    k = 0
    for i in range(flags.shape[0]):
        b = first[i]
        value[0] = scalar[b]
        value[1] = slack[i] * 1e3
        value[2] = prio[i]
        rows[k] = i
        codes[k] = _LOWEST_CODE[b]
        values[k] = value[_LOWEST_KIND[b]]
        k += 1 - ((flags[i] & _SERVED) != 0)
    return k


@_jit
def _limited_codes(flags, codes, rows, values, rules, behind, own_rule, own_value):  # type: ignore[no-untyped-def]
    """:func:`_waiting_codes` where the token budget or KV holds every row back (a plan
    that fills its budget: most of Sarathi's and vLLM's): ``max_num_seqs`` for a row with
    no token when that rule is on, else the limit's code, each with its rule's number."""
    limit = RC_TOKEN_BUDGET if rules[RC_TOKEN_BUDGET] != 0 else RC_KV
    seqs = np.int64(rules[RC_MAX_NUM_SEQS] != 0)
    value = np.empty(2, dtype=np.float64)
    value[0] = _scalar(rules, limit, behind, own_rule, own_value)
    value[1] = _scalar(rules, RC_MAX_NUM_SEQS, behind, own_rule, own_value)
    k = 0
    for i in range(flags.shape[0]):
        m = np.int64(flags[i])
        by_seqs = seqs & ((m & _GETS) == 0)
        rows[k] = i
        codes[k] = limit + by_seqs * (RC_MAX_NUM_SEQS - limit)
        values[k] = value[by_seqs]
        k += 1 - ((m & _SERVED) != 0)
    return k
