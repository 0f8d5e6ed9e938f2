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
from .kernels import MAX_BOUNDARIES
from .snapshot import Snapshot

__all__ = ["MAX_BOUNDARIES", "sliding_chunk", "window_limits_ms"]


def window_limits_ms(snap: Snapshot, decodes: np.ndarray, k: int) -> np.ndarray | None:
    """W_1..W_k in ms over the safe decodes (formulas (7), (8)): W_m = min over decodes
    with slack > 0 of (slack + (m − 1) · TBT); None when no decode is safe."""
    return kernels.ops().window_limits(snap, decodes, k, 1.0)


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

    The search itself (the drain rule, the grid, the DP over windows) is the
    ``sliding_chunk`` kernel, run by ``kernels.ops()``.
    """
    if cq.supply == 0 or cq.first_cap == 0:
        return 0
    if curve is None:
        curve = cq.budget_curve(cq.first_cap)
    return kernels.ops().sliding_chunk(cq, W, granularity, max_points, curve, tie_tolerance_ms)
