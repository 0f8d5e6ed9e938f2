"""The numpy reference of the policy hot path: what the kernels facade runs on the numpy
backend, and what the numba backend falls back to when a compiled kernel declines.

It stands below the policy modules (:mod:`.sorter`, :mod:`.batch`, :mod:`.chunker`,
:mod:`.constructor`, :mod:`.slidingserve`), which reach it only through
:func:`.kernels.ops`, and above nothing but the snapshot, the features and numpy: the
kernels package imports it, so it must import none of the policies.  The compiled kernels
(:mod:`.kernels._compiled`) reproduce every function here bit for bit.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from .features import X7, piece_features
from .plan import CODES
from .predictor import LinearModel
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .batch import BudgetCurve, CandidateQueue

__all__ = [
    "MAX_BOUNDARIES", "REASON_RULES", "REASON_VALUE", "RULES_LEN", "RULE_SCALAR", "RULE_SKIP", "RULE_STARVE",
    "SCALAR_MINOR", "class_late_set", "grid_positions", "id_rank", "knapsack_pass", "late_set",
    "lost_mask", "mlps_keys", "mlps_order", "ordered", "queue_arrays", "read_back", "reason_codes", "sit_out",
    "sliding_chunk", "window_limits", "window_limits_ms",
]

#: Up to this many minor entries in one call the reference predicts them one by one
#: in plain Python, beyond it with numpy (``CandidateQueue.fix_minor``); the kernels follow suit.
SCALAR_MINOR = 8
#: Request boundaries added to the window search's grid (the first ones of the stream).
MAX_BOUNDARIES = 16

#: An anchor's key (21) in BatchConstructor: (|Y|, Σv, Σr).
Key = tuple[int, float, int]


# ---------------------------------------------------------------------- orders
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


def mlps_keys(
    snap: Snapshot, idx: np.ndarray, throughput: float, alpha: float, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(1 − g_i, 1 − e_i, r_i) of formulas (10)–(15) for requests ``idx``."""
    r = snap.remaining_prefill[idx]
    s = snap.slack[idx]
    u = r / (throughput * np.maximum(s, eps))  # (13)
    e = u > alpha  # (14)
    return (~snap.protected[idx]).astype(np.int8), (~e).astype(np.int8), r


def mlps_order(snap: Snapshot, idx: np.ndarray, prio: np.ndarray | None, throughput: float, alpha: float,
               eps: float, expired_last: bool, lost: np.ndarray | None) -> np.ndarray:
    """``sorter.mlps_order`` of a non-empty ``idx``; ``prio``: the class key over idx
    (None with one class)."""
    g, e, r = mlps_keys(snap, idx, throughput, alpha, eps)
    late = snap.slack[idx] <= 0 if expired_last else np.zeros(len(idx), dtype=bool)
    if lost is not None:
        late = late | lost
    if late.any():  # none of the late ones is expected to meet its SLO: oldest first bounds the longest wait
        g, e, r = (np.where(late, 0, x) for x in (g, e, r))
    expired = late.astype(np.int8)
    if prio is not None:
        return ordered(snap, idx, expired, prio, g, e, r)
    return ordered(snap, idx, expired, g, e, r)


# ------------------------------------------------------------------ lost sets
def late_set(snap: Snapshot, idx: np.ndarray, throughput: float) -> np.ndarray:
    """``sorter.late_set`` (Moore–Hodgson) of ``idx``."""
    lost = np.zeros(len(idx), dtype=bool)
    if len(idx) == 0:
        return lost
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


def lost_mask(snap: Snapshot, pre: np.ndarray, rho: float, rho_max: float, hopeless_factor: float,
              moore: bool, classes: bool) -> np.ndarray:
    """``SlidingServePolicy._lost`` of a non-empty ``pre``: hopeless prefills, then the
    (class) Moore–Hodgson lost set, live ones only."""
    lost = np.zeros(len(pre), dtype=bool)
    if hopeless_factor > 0:
        # Optimistic: the request alone with the whole budget, at the predictor's rate.
        lost |= snap.remaining_prefill[pre] > rho_max * snap.slack[pre] * hopeless_factor
    if moore:
        lost |= class_late_set(snap, pre, rho) if classes else late_set(snap, pre, rho)
    return lost & (snap.slack[pre] > 0)


def sit_out(snap: Snapshot, dec_all: np.ndarray, pre: np.ndarray, lost: np.ndarray, skip_tbts: float,
            skip_late: bool, starve: float) -> tuple[np.ndarray, np.ndarray]:
    """``SlidingServePolicy._sit_out``: the live prefills and the decodes that sit out."""
    live = pre[(snap.slack[pre] > 0) & ~lost]
    out = np.zeros(len(dec_all), dtype=bool)
    if len(dec_all) and len(live):
        s = snap.slack[dec_all]
        if skip_tbts > 0:
            out |= s > skip_tbts * snap.step[dec_all]
        if skip_late:
            late = s <= 0
            if starve > 0:
                late &= s > -starve * snap.step[dec_all]
            out |= late
    return live, out


# -------------------------------------------------------------------- windows
def window_limits_ms(snap: Snapshot, decodes: np.ndarray, k: int) -> np.ndarray | None:
    """W_1..W_k in ms over safe decodes (formulas (7), (8)); None if D_safe = ∅."""
    if len(decodes) == 0:
        return None
    s = snap.slack[decodes]
    safe = s > 0
    if not safe.any():
        return None
    s, tbt = s[safe], snap.step[decodes][safe]
    steps = np.arange(k)[:, None]
    return (s[None, :] + steps * tbt[None, :]).min(axis=1) * 1e3


def window_limits(snap: Snapshot, decodes: np.ndarray, k: int, margin: float) -> np.ndarray | None:
    """:func:`window_limits_ms` divided by the margin."""
    W = window_limits_ms(snap, decodes, k)
    if W is not None and margin != 1.0:
        W = W / margin
    return W


# ------------------------------------------------------------- candidate queue
def queue_arrays(snap: Snapshot, model: LinearModel, queue: np.ndarray) -> tuple[np.ndarray, ...]:
    """r, u0, R, the prefix sums of the full requests' feature rows, their x7
    column, its running max and the prefix sums of their times under ``model``."""
    r = snap.remaining_prefill[queue].astype(np.int64)
    u0 = snap.computed_tokens[queue].astype(np.int64)
    R = np.zeros(len(queue) + 1, dtype=np.int64)
    np.cumsum(r, out=R[1:])
    rf = r.astype(np.float64)
    uf = u0.astype(np.float64)
    f = piece_features(rf, uf)  # every queued request has r ≥ 1
    pf = np.zeros((len(r) + 1, f.shape[1]))
    np.cumsum(f, axis=0, out=pf[1:])
    rbig = np.ascontiguousarray(f[:, X7])
    pmax = np.concatenate([[0.0], np.maximum.accumulate(rbig)]) if len(rbig) else np.zeros(1)
    pw = np.zeros(len(r) + 1)
    np.cumsum(model.piece_ms(rf, uf), out=pw[1:])
    return r, u0, R, pf, rbig, pmax, pw


# ------------------------------------------------------------ batch constructor
def knapsack_pass(idx: np.ndarray, w: np.ndarray, v: np.ndarray, value: dict[int, float],
                  cap_of: dict[int, int]) -> tuple[np.ndarray, list[tuple[Key, int, int]]]:
    """``constructor._knapsack_pass`` over the pool (snapshot indices ``idx``, weights,
    values): the choice bits, and per anchor its key (21), pool position and capacity."""
    cmax = max(cap_of.values())
    dp = np.zeros(cmax + 1)
    # |Y| and Σr of each dp cell packed in one integer (count << 32 | weight):
    # one array update per item instead of two.
    cw = np.zeros(cmax + 1, dtype=np.int64)
    take = np.zeros((len(idx), cmax + 1), dtype=bool)
    anchors: list[tuple[Key, int, int]] = []  # (key (21), anchor pos, cap)
    for p, i in enumerate(idx.tolist()):
        if i in cap_of:
            c = cap_of[i]
            packed = int(cw[c])
            key = ((packed >> 32) + 1, float(dp[c]) + value[i], (packed & 0xFFFFFFFF) + int(w[p]))
            anchors.append((key, p, c))
        wp = int(w[p])
        if wp > cmax:
            continue
        head = cmax + 1 - wp
        cand = dp[:head] + v[p]
        better = take[p, wp:]
        np.greater(cand, dp[wp:], out=better)
        np.copyto(dp[wp:], cand, where=better)
        np.copyto(cw[wp:], cw[:head] + ((1 << 32) + wp), where=better)
    assert anchors
    return take, anchors


def read_back(take: np.ndarray, idx: np.ndarray, w: np.ndarray, pa: int, c: int) -> list[int]:
    """The knapsack's selection of the anchor at pool position ``pa`` with capacity
    ``c``: the anchor, then the items chosen before it, nearest first."""
    chosen = [int(idx[pa])]
    for p in range(pa - 1, -1, -1):
        if take[p, c]:
            chosen.append(int(idx[p]))
            c -= int(w[p])
    return chosen


# ------------------------------------------------------------- window search
def grid_positions(
    cq: CandidateQueue, k: int, granularity: int, max_points: int = 1 << 30, first_tokens: int | None = None
) -> np.ndarray:
    """Stream positions the search may stop at (sorted, unique, from 0).

    The step is ``granularity``, widened to a multiple of it when the first
    iteration's feasible range (``first_tokens``, default its cap) would hold
    more than ``max_points`` positions.
    """
    per_iter = cq.first_cap if first_tokens is None else max(1, min(first_tokens, cq.first_cap))
    xmax = min(cq.supply, per_iter + (k - 1) * cq.iter_cap)
    g = max(1, granularity)
    if per_iter > g * max_points:
        g *= -(-per_iter // (g * max_points))
    # per_iter is TimeToBudget(W_1) when the caller passes it: the exact
    # greedy answer is always a candidate b_1, whatever the step.
    pts = [np.arange(0, xmax + 1, g, dtype=np.int64), cq.R[: MAX_BOUNDARIES + 1], [cq.first_cap, per_iter, xmax]]
    grid = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in pts]))
    return grid[grid <= xmax]


def _drain(cq: CandidateQueue, W: np.ndarray) -> bool:
    if cq.supply == 0 or cq.supply > cq.first_cap:
        return False
    total = float(cq.prefix_time_ms(np.array([cq.supply]))[0])
    if total > W[0]:
        return False
    for m in range(1, len(W)):
        total += cq.decode_only_ms(m)
        if total > W[m]:
            return False
    return True


def sliding_chunk(cq: CandidateQueue, W: np.ndarray, granularity: int, max_points: int, curve: BudgetCurve,
                  tie_tolerance_ms: float) -> int:
    """``chunker.sliding_chunk`` of a queue with supply and a first-iteration cap."""
    k = len(W)
    if _drain(cq, W):
        return cq.supply
    reach = curve.prefill_tokens_within(float(W[0]), cq.first_cap)
    if reach < 0:
        return 0
    grid = grid_positions(cq, k, granularity, max_points, first_tokens=reach)
    best = _first_window(cq, grid, W)
    if not np.isfinite(best).any():
        return 0
    # first[j]: grid index of b_1 on the path chosen into position j, so that
    # ties between equally fast paths go to the larger b_1 at every window.
    first = np.arange(len(grid))
    for m in range(1, k - 1):
        best, par = _step(cq, grid, best, first, m, W[m], np.arange(len(grid)))
        first = first[par]
        if not np.isfinite(best).any():
            return 0
    if k > 1:
        return _last_window(cq, grid, best, first, W, tie_tolerance_ms)
    return int(grid[np.flatnonzero(np.isfinite(best))[-1]])


def _first_window(cq: CandidateQueue, grid: np.ndarray, W: np.ndarray) -> np.ndarray:
    """The DP's first step: the time of each position as b_1, infinite where
    it is past the first iteration's cap or over W_1."""
    inf = np.inf
    in_first = grid <= cq.first_cap
    best = np.full(len(grid), inf)
    t1 = cq.segment_time_ms(np.zeros(int(in_first.sum()), dtype=np.int64), grid[in_first])
    best[in_first] = np.where(t1 <= W[0], t1, inf)
    return best


def _last_window(cq: CandidateQueue, grid: np.ndarray, best: np.ndarray, first: np.ndarray,
                 W: np.ndarray, tie_tolerance_ms: float) -> int:
    """The DP's last step: b_1 of the largest feasible total, 0 when no split
    fits the last window.

    Only the largest feasible total matters, so scan the targets from the top
    in blocks and stop at the first feasible one.  Blocks of ~8k pair
    evaluations: numpy's per-call overhead dominates below that, so one big
    block usually beats several small ones."""
    k = len(W)
    rows = int(np.isfinite(best).sum())
    block = max(8, 8192 // max(rows, 1))
    hi = len(grid)
    while hi > 0:
        cols = np.arange(max(0, hi - block), hi)
        b, par = _step(cq, grid, best, first, k - 1, W[k - 1], cols, tie_tolerance_ms)
        ok = np.flatnonzero(np.isfinite(b))
        if len(ok):
            return int(grid[first[par[ok[-1]]]])
        hi -= block
    return 0  # no split fits the last window


def _step(
    cq: CandidateQueue,
    grid: np.ndarray,
    best: np.ndarray,
    first: np.ndarray,
    m: int,
    w_m: float,
    cols: np.ndarray,
    tol: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """One DP transition to the targets ``grid[cols]``: the cumulative time
    and the source position chosen for each.  Among sources within ``tol`` of
    the least time the one whose path has the larger b_1 wins (then the
    larger source); intermediate windows use tol = 0, which keeps the DP
    exact.  Targets no source reaches get an infinite time."""
    src = np.flatnonzero(np.isfinite(best))
    if len(src) == 0:
        return np.full(len(cols), np.inf), np.zeros(len(cols), dtype=np.int64)
    X, Y = grid[src], grid[cols]
    tot = best[src][:, None] + cq.pair_times_ms(X, Y, m)
    tot[(Y[None, :] - X[:, None] > cq.iter_cap) | (tot > w_m)] = np.inf
    near = tot <= tot.min(axis=0)[None, :] + tol
    rank = (first[src] * (len(grid) + 1) + src)[:, None]
    arg = np.argmax(np.where(near, rank, -1), axis=0)
    return tot[arg, np.arange(len(cols))], src[arg]


# --------------------------------------------------------------------- reasons
# Code indices (into :data:`.plan.CODES`) of the rules :func:`reason_codes` applies; the
# compiled kernel imports them (numba treats module-level ints as constants).
RC_MAX_NUM_SEQS, RC_TOKEN_BUDGET, RC_TIME_BUDGET, RC_KV, RC_KV_WATERMARK, RC_GIVEN_UP, RC_EXPIRED, RC_AHEAD, \
    RC_LATE, RC_CLASS_SIT_OUT, RC_CLASS_RESCUE, RC_CLASS_RESERVE, RC_NOT_CHOSEN, RC_BEHIND = (
        CODES.index(c) for c in ("max_num_seqs", "token_budget", "time_budget", "kv", "kv_watermark", "given_up",
                                 "expired", "ahead", "late", "class_sit_out", "class_rescue", "class_reserve",
                                 "not_chosen", "behind"))
#: The rules in the order they are tried: a waiting request's reason is the first that
#: holds (after its own verdict, a rejection or a preemption), ``behind`` when none does.
REASON_RULES = (RC_MAX_NUM_SEQS, RC_TOKEN_BUDGET, RC_KV, RC_KV_WATERMARK, RC_CLASS_RESERVE, RC_GIVEN_UP,
                RC_EXPIRED, RC_CLASS_RESCUE, RC_LATE, RC_AHEAD, RC_CLASS_SIT_OUT, RC_NOT_CHOSEN, RC_TIME_BUDGET)
#: What a code's value is, per code: 0 the rule's own number (``scalar``), 1 the request's
#: slack in ms, 2 its class (priority), 3 its KV tokens.
REASON_VALUE = np.zeros(len(CODES), dtype=np.int8)
REASON_VALUE[[CODES.index(c) for c in ("given_up", "expired", "ahead", "late", "ttft_expired", "e2e_expired",
                                        "ttft_unreachable", "e2e_unreachable")]] = 1
REASON_VALUE[CODES.index("class_sit_out")] = 2
REASON_VALUE[CODES.index("preempted")] = 3
REASON_VALUE.flags.writeable = False

#: Where :func:`reason_codes` reads the plan-wide facts in its one ``rules`` array (float64):
#: ``rules[c]`` nonzero where rule ``c`` is on, ``rules[RULE_SCALAR + c]`` the rule's own
#: number (but ``behind``'s, counted, and the one passed apart), then the starvation bound
#: and the decode skip.
RULE_SCALAR = len(CODES)
RULE_STARVE = 2 * len(CODES)
RULE_SKIP = RULE_STARVE + 1
RULES_LEN = RULE_SKIP + 1


def seqs_rules(rules: np.ndarray, served: int, max_seqs: int) -> np.ndarray:
    """A copy of ``rules`` with the ``max_num_seqs`` rule on (its number ``max_seqs``)
    when a plan serving ``served`` requests reaches it (``rules`` may be shared and
    read-only; plain enough for the compiled kernel to compile as it is)."""
    own = rules.copy()
    if served >= max_seqs:
        own[RC_MAX_NUM_SEQS] = 1.0
        own[RULE_SCALAR + RC_MAX_NUM_SEQS] = max_seqs
    return own


def reason_tokens(n: int, dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray) -> np.ndarray:
    """Tokens per row of a plan: one for each of ``dec_rows`` (decodes), ``pre_toks[j]``
    for row ``pre_rows[j]``."""
    got = np.zeros(n, dtype=np.int64)
    got[dec_rows] = 1
    got[pre_rows] = pre_toks
    return got


def reason_codes(dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray, lost_from: np.ndarray,
                 lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray, rules: np.ndarray,
                 own_rule: int, own_value: float, remaining: np.ndarray, slack: np.ndarray, tbt: np.ndarray,
                 step: np.ndarray, prio: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(waiting rows, their code indices, their values): the rows that get fewer tokens
    (:func:`reason_tokens`) than they need (a decode, ``remaining`` 0, one; a prefill what
    remains), each given the first rule of :data:`REASON_RULES` that is
    on (``rules``, laid out as :data:`RULE_SCALAR` says) and holds for it, a verdict
    (``verdicts``: rows, their codes, their KV tokens; waiting rows) overriding it.  The rules'
    predicates: ``max_num_seqs`` no token;
    ``token_budget``, ``kv`` every row; ``kv_watermark`` a prefill; ``class_reserve`` a
    prefill in ``marked`` (held back); ``given_up`` in ``lost_from[lost_mask]``; ``expired`` a
    prefill with slack <= 0; ``class_rescue`` a decode in ``marked`` (sat out); ``late`` a
    decode with slack <= 0 (and, the starvation
    bound > 0, above minus that many TBTs); ``ahead`` a decode with slack > the decode skip's
    steps; ``class_sit_out`` a decode; ``not_chosen``, ``time_budget`` a prefill.  Values per
    :data:`REASON_VALUE`, the rule's own number for the rules' (:func:`_rule_numbers`;
    ``own_rule``, −1 for none: a plan's own number on a ``rules`` array plans share)."""
    on = rules[:RULE_SCALAR] != 0
    scalar = _rule_numbers(rules, own_rule, own_value, len(dec_rows) + len(pre_rows))
    starve, skip = float(rules[RULE_STARVE]), float(rules[RULE_SKIP])
    lost = lost_from[lost_mask]
    is_dec = remaining == 0
    got = reason_tokens(len(is_dec), dec_rows, pre_rows, pre_toks)
    rows = np.flatnonzero(got < np.where(is_dec, 1, remaining))
    if not len(rows):
        return rows, np.zeros(0, dtype=np.int8), np.zeros(0)
    n = len(got)
    d = is_dec[rows]
    s = slack[rows]

    def member(idx: np.ndarray) -> np.ndarray:
        m = np.zeros(n, dtype=bool)
        m[idx] = True
        return m[rows]

    masks = {
        RC_MAX_NUM_SEQS: lambda: got[rows] == 0,
        RC_TOKEN_BUDGET: lambda: None,
        RC_KV: lambda: None,
        RC_KV_WATERMARK: lambda: ~d,
        RC_CLASS_RESERVE: lambda: member(marked) & ~d,
        RC_GIVEN_UP: lambda: member(lost),
        RC_EXPIRED: lambda: ~d & (s <= 0),
        RC_CLASS_RESCUE: lambda: member(marked) & d,
        RC_LATE: lambda: d & (s <= 0) & ((s > -starve * tbt[rows]) if starve > 0 else True),
        RC_AHEAD: lambda: d & (s > skip * step[rows]),
        RC_CLASS_SIT_OUT: lambda: d,
        RC_NOT_CHOSEN: lambda: ~d,
        RC_TIME_BUDGET: lambda: ~d,
    }
    code = np.full(len(rows), RC_BEHIND, dtype=np.int8)
    for c in reversed(REASON_RULES):  # the first rule that holds is written last
        if on[c]:
            m = masks[c]()
            code[slice(None) if m is None else m] = c
    return rows, code, _reason_values(code, scalar, s, prio[rows], _verdicts_over(rows, code, verdicts))


def _verdicts_over(rows: np.ndarray, code: np.ndarray, verdicts: np.ndarray) -> np.ndarray:
    """The verdicts' codes written over the waiting ``rows``' ``code`` (a served row's
    verdict is dropped); their KV tokens (a verdict's value may be its row's), 0 elsewhere."""
    kv = np.zeros(len(rows), dtype=np.int64)
    if verdicts.shape[1]:
        at = np.searchsorted(rows, verdicts[0])
        keep = (at < len(rows)) & (rows[np.minimum(at, len(rows) - 1)] == verdicts[0])
        code[at[keep]] = verdicts[1][keep]
        kv[at[keep]] = verdicts[2][keep]
    return kv


def _rule_numbers(rules: np.ndarray, own_rule: int, own_value: float, served: int) -> np.ndarray:
    """Each rule's number (code-indexed): ``rules``'s, ``own_rule``'s ``own_value``, and
    ``behind``'s the count of requests served."""
    scalar = rules[RULE_SCALAR:RULE_STARVE].copy()
    if own_rule >= 0:
        scalar[own_rule] = own_value
    scalar[RC_BEHIND] = served
    return scalar


def _reason_values(code: np.ndarray, scalar: np.ndarray, s: np.ndarray, prio: np.ndarray,
                   kv: np.ndarray) -> np.ndarray:
    """Each reason's value by its code's kind (:data:`REASON_VALUE`), of the waiting rows'
    slack ``s``, class ``prio`` and KV tokens ``kv``; the rule's own number from ``scalar``."""
    kind = REASON_VALUE[code]
    value = scalar[code]
    for k, col in ((1, s * 1e3), (2, prio), (3, kv)):
        m = kind == k
        if m.any():
            value[m] = col[m]
    return value
