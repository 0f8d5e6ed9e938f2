"""BatchConstructor, formulas (17)–(22): pick whole prefills around an anchor.

For each risky anchor a (a live prefill whose slack is below the predicted
time of the greedy candidate batch): capacity C_a = TimeToBudget(s_a) − |D|
(17); the candidates S_a are the live prefills with slack ≥ s_a; a 0/1
knapsack with weights r_j and values v_j (18) fills C_a − r_a (19)–(20); the
best Y_a = Y* ∪ {a} wins by (|Y|, Σv, Σr) (21); every chosen request gets
all its remaining tokens (22).

Decisions where the paper is silent or the naive form is too slow:

* Single DP pass.  Ordering live prefills by slack, descending (ties: arrival,
  then id), makes every S_a the prefix of that order before a.  One pass of
  the knapsack over the order, reading dp[C_a − r_a] when it reaches anchor a
  and keeping choice bits, answers every anchor in O(n_c · C) instead of
  O(n_r · n_c · C).
* Values are normalised over all live candidates, Σ_{S} s and Σ_{S} r, not
  per anchor: per-anchor normalisers would change the item values between
  anchors and rule out the single pass.  Only the relative weight of slack
  and size inside (18) depends on the normaliser.
* Candidate pool: the ``max_candidates`` live prefills of highest value plus
  every anchor; the rest cannot be worth more to any knapsack than the kept
  ones of similar weight, and the DP cost stays bounded under overload.
* Expired requests are never anchors nor candidates (ARCHITECTURE §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import BudgetCurve
from .snapshot import Snapshot
from .sorter import ordered

__all__ = ["ConstructorResult", "construct_batch"]


@dataclass(frozen=True, slots=True)
class ConstructorResult:
    anchor: int
    #: Snapshot indices of the chosen prefills, anchor included.
    chosen: tuple[int, ...]
    value: float


def _order_by_slack_desc(snap: Snapshot, idx: np.ndarray) -> np.ndarray:
    return ordered(snap, idx, -snap.slack[idx])


def construct_batch(
    snap: Snapshot,
    live: np.ndarray,
    curve: BudgetCurve,
    n_dec: int,
    t_full_ms: float,
    token_cap: int,
    seq_cap: int,
    max_candidates: int = 64,
    margin: float = 1.0,
) -> ConstructorResult | None:
    """Return the best anchored selection, or None (no risky or no feasible anchor).

    ``token_cap`` bounds the prefill tokens (budget after decodes and KV
    headroom); ``seq_cap`` the number of chosen requests.  Predicted times
    count ``margin`` times over against every slack.
    """
    if len(live) == 0 or seq_cap <= 0:
        return None
    s_all = snap.slack[live]
    risky = live[s_all * 1e3 < t_full_ms * margin]
    if len(risky) == 0:
        return None
    r_all = snap.remaining_prefill[live].astype(np.float64)
    v_all = 1.0 / (s_all / s_all.sum() + r_all / r_all.sum())  # (18)
    # Anchors and their capacities (17), all at once.
    c_a = np.minimum(curve.prefill_tokens_within_many(snap.slack[risky] * 1e3 / margin), token_cap)
    r_a = snap.remaining_prefill[risky]
    ok = r_a <= c_a
    if not ok.any():
        return None
    cap_of = dict(zip(risky[ok].tolist(), (c_a - r_a)[ok].tolist(), strict=True))
    cmax = max(cap_of.values())
    # Candidate pool: top values plus anchors, then the slack-descending order.
    if len(live) > max_candidates:
        top = np.argpartition(-v_all, max_candidates - 1)[:max_candidates]
        keep = np.zeros(len(live), dtype=bool)
        keep[top] = True
        keep |= np.isin(live, risky[ok])
        pool_pos = np.flatnonzero(keep)
    else:
        pool_pos = np.arange(len(live))
    value_of = np.zeros(len(snap))
    value_of[live] = v_all
    pool = _order_by_slack_desc(snap, live[pool_pos])
    w = snap.remaining_prefill[pool].astype(np.int64)
    v = value_of[pool]
    value = dict(zip(pool.tolist(), v.tolist(), strict=True))
    dp = np.zeros(cmax + 1)
    # |Y| and Σr of each dp cell packed in one integer (count << 32 | weight):
    # one array update per item instead of two.
    cw = np.zeros(cmax + 1, dtype=np.int64)
    take = np.zeros((len(pool), cmax + 1), dtype=bool)
    best: tuple[tuple[int, float, int], int, int] | None = None  # (key, anchor pos, cap)
    for p, i in enumerate(pool.tolist()):
        if i in cap_of:
            c = cap_of[i]
            packed = int(cw[c])
            key = ((packed >> 32) + 1, float(dp[c]) + value[i], (packed & 0xFFFFFFFF) + int(w[p]))
            if best is None or key > best[0]:
                best = (key, p, c)
        wp = int(w[p])
        if wp > cmax:
            continue
        head = cmax + 1 - wp
        cand = dp[:head] + v[p]
        better = take[p, wp:]
        np.greater(cand, dp[wp:], out=better)
        np.copyto(dp[wp:], cand, where=better)
        np.copyto(cw[wp:], cw[:head] + ((1 << 32) + wp), where=better)
    assert best is not None
    (_, total_v, _), pa, c = best
    chosen = [int(pool[pa])]
    for p in range(pa - 1, -1, -1):
        if take[p, c]:
            chosen.append(int(pool[p]))
            c -= int(w[p])
    if len(chosen) > seq_cap:
        # Rare: more prefills than sequence slots.  Keep the anchor and the
        # most valuable others.
        rest = sorted(chosen[1:], key=lambda i: (-value[i], snap.ids[i]))
        chosen = [chosen[0], *rest[: seq_cap - 1]]
        total_v = sum(value[i] for i in chosen)
    return ConstructorResult(anchor=chosen[0], chosen=tuple(chosen), value=float(total_v))
