"""SlidingChunker, formulas (7)–(9), generalised to a window of k iterations.

Decision on the paper's two-window problem (docs/policies.md): with decode
windows W_m = min over safe decodes of (s_i + (m − 1)·L_i^tbt), choose token
counts b_1..b_k whose *cumulative* predicted times fit every window,
Σ_{l ≤ m} T̂_l(b_l) ≤ W_m, maximise the total B_Σ, and among the splits that
reach it minimise Σ T̂_l (ties: larger b_1).  Only b_1 is executed.  k = 1 is
the greedy rule TimeToBudget(T_cur); k = 2 is the paper.

Search.  Iteration l processes the stream segment [X_{l−1}, X_l), so the
cost of a step depends only on (l, X_{l−1}, X_l).  Because the constraints
are upper bounds on cumulative time, the least cumulative time that reaches
position X after l steps dominates every other way of getting there; a DP
over (step, position) is therefore exact, O(k·G²) for G grid positions,
instead of enumerating the G^k splits.  Positions are multiples of
``granularity`` tokens plus the first request boundaries of the stream, the
first-iteration cap and the exact TimeToBudget(W_1) point, so a chunk can
end exactly where a prompt ends and b_1 can always be the greedy answer.

Drain rule (our addition): when the whole queue fits in this iteration and
the batch plus decode-only iterations after it fit every window, take it all.
Splitting a queue that can be drained would only delay first tokens.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .batch import BudgetCurve, CandidateQueue
from .snapshot import Snapshot

__all__ = ["MAX_BOUNDARIES", "grid_positions", "sliding_chunk", "window_limits_ms"]

#: Request boundaries added to the grid (the first ones of the stream).
MAX_BOUNDARIES = 16


def window_limits_ms(snap: Snapshot, decodes: np.ndarray, k: int) -> np.ndarray | None:
    """W_1..W_k in ms over safe decodes (formulas (7), (8)); None if D_safe = ∅."""
    if len(decodes) == 0:
        return None
    s = snap.slack[decodes]
    safe = s > 0
    if not safe.any():
        return None
    s, tbt = s[safe], snap.tbt_slo[decodes][safe]
    steps = np.arange(k)[:, None]
    return (s[None, :] + steps * tbt[None, :]).min(axis=1) * 1e3


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


def sliding_chunk(
    cq: CandidateQueue,
    W: np.ndarray,
    granularity: int = 16,
    max_points: int = 1 << 30,
    curve: BudgetCurve | None = None,
    tie_tolerance_ms: float = 0.0,
) -> int:
    """Prefill tokens for this iteration (b_1 − |D|); 0 when nothing fits.

    ``curve`` (the fill curve of ``cq``, if the caller has it) saves
    recomputing how far the first iteration can go within W_1.
    ``tie_tolerance_ms``: splits whose Σ T̂ is within this of the least count
    as ties, and ties go to the larger b_1.  A linear predictor makes Σ T̂
    almost flat in the split (the same tokens cost the same in either
    iteration), so without a tolerance rounding-level differences between
    scenario models pick the split; with it, more work now means earlier
    first tokens at the same predicted cost.
    """
    k = len(W)
    if cq.supply == 0 or cq.first_cap == 0:
        return 0
    if curve is None:
        curve = cq.budget_curve(cq.first_cap)
    jit = kernels.jit()
    if jit is not None:
        p1 = jit.sliding_chunk(*cq.kernel_args(), cq.first_cap, cq.iter_cap, np.asarray(W, dtype=np.float64),
                               int(granularity), int(max_points), curve.times, curve.suffix_min,
                               float(tie_tolerance_ms), MAX_BOUNDARIES + 1)
        if p1 >= 0:
            return int(p1)
        # -1: the search meets batches the reference predicts with numpy; so must we.
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
