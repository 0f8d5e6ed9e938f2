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
* Expired requests are never anchors nor candidates (docs/policies.md).
* Request classes: the anchors are the risky prefills of the highest class
  that has any (smallest priority); candidates are every live prefill with
  at least the anchor's slack, of any class; and the batch's time is bounded
  by the slack of every scheduled decode of a higher class than the anchors'
  too (a lower class's anchor never costs a higher class's decode its token).
  The values (18) are scaled class by class (``class_values``) so that each
  request is worth more than all lower-class requests together: the knapsack,
  which maximises Σv, takes a higher-class request before any set of
  lower-class ones it could take instead.  With one class, (17) and (18) as is.
* Final check and repair.  C_a comes from the fill curve of the *sorted*
  queue, but the knapsack takes other requests, whose cached tokens (x1, x3)
  and chunk sizes (x2, x7) can cost more than the queue's head.  So, as in the
  paper's worked example, the chosen batch is predicted exactly and kept only
  if margin · T̂(D ∪ Y) ≤ s_a (the least slack it completes, in ms).  When it
  is over, the non-anchor item with the least value per predicted millisecond
  (v_j / (T̂(Y) − T̂(Y ∖ {j}))) is dropped until it fits; if even the anchor
  alone does not fit, that anchor is infeasible.  Anchors are tried in the
  order of their knapsack key (21) and the best repaired selection wins (a
  repair only lowers a key, so the search stops once the next anchor's
  unrepaired key cannot beat it).  No feasible anchor → the SlidingChunker
  path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels
from .batch import BudgetCurve
from .features import combine_sets, decode_features, piece_features
from .predictor import BatchLatencyPredictor
from .snapshot import Snapshot
from .sorter import ordered

__all__ = ["ConstructorResult", "construct_batch"]


@dataclass(frozen=True, slots=True)
class ConstructorResult:
    anchor: int
    #: Snapshot indices of the chosen prefills, anchor included.
    chosen: tuple[int, ...]
    value: float


def class_values(v: np.ndarray, priority: np.ndarray) -> np.ndarray:
    """The values (18) scaled class by class, from the lowest up, so that every request is
    worth more than all requests of lower classes together: a knapsack that maximises Σv
    then takes a higher-class request before any set of lower-class ones that it could
    take instead.  Within a class the values keep their ratios."""
    out = v.astype(np.float64).copy()
    below = 0.0  # total (scaled) value of the classes done so far
    for level in np.unique(priority)[::-1].tolist():  # lowest class (largest priority) first
        m = priority == level
        low = float(out[m].min())
        if below > 0.0:
            out[m] *= 2.0 * below / low if 2.0 * below > low else 1.0
        below += float(out[m].sum())
    return out


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
    *,
    predictor: BatchLatencyPredictor,
    decodes: np.ndarray,
) -> ConstructorResult | None:
    """Return the best anchored selection, or None (no risky or no feasible anchor).

    ``token_cap`` bounds the prefill tokens (budget after decodes and KV
    headroom); ``seq_cap`` the number of chosen requests.  Predicted times
    count ``margin`` times over against every slack.  ``predictor`` and the
    scheduled ``decodes`` (``n_dec`` of them) are what the final check
    predicts the chosen batch with: every returned selection Y satisfies
    margin · T̂(decodes ∪ Y) ≤ min slack of Y.
    """
    if len(live) == 0 or seq_cap <= 0:
        return None
    s_all = snap.slack[live]
    risky = live[s_all * 1e3 < t_full_ms * margin]
    if len(risky) == 0:
        return None
    limit_s = np.inf
    if not snap.one_class:
        # request classes: anchors only from the highest class at risk (any class may fill),
        # and the batch must not cost a decode of a higher class than the anchors' its token
        prio = snap.priority[risky]
        risky = risky[prio == prio.min()]
        if len(decodes):
            above = decodes[(snap.priority[decodes] < prio.min()) & (snap.slack[decodes] > 0)]
            if len(above):
                limit_s = float(snap.slack[above].min())
    r_all = snap.remaining_prefill[live].astype(np.float64)
    v_all = 1.0 / (s_all / s_all.sum() + r_all / r_all.sum())  # (18)
    if not snap.one_class:
        v_all = class_values(v_all, snap.priority[live])
    cap_of = _anchor_capacities(snap, risky, curve, token_cap, margin, limit_s)
    if not cap_of:
        return None
    pool = _candidate_pool(snap, live, v_all, np.array(list(cap_of), dtype=risky.dtype), max_candidates)
    take, anchors = _knapsack_pass(pool, cap_of)
    best = _best_repaired(snap, pool, take, anchors, seq_cap, margin, predictor, decodes, limit_s)
    if best is None:
        return None
    (_, total_v, _), chosen = best
    return ConstructorResult(anchor=chosen[0], chosen=tuple(chosen), value=float(total_v))


#: A knapsack key (21): (|Y|, Σv, Σr).
_Key = tuple[int, float, int]


@dataclass(frozen=True, slots=True, eq=False)
class _Pool:
    """The candidate pool in slack-descending order, with weights r_j and values v_j."""

    idx: np.ndarray
    w: np.ndarray
    v: np.ndarray
    #: v_j by snapshot index.
    value: dict[int, float]


def _anchor_capacities(snap: Snapshot, risky: np.ndarray, curve: BudgetCurve, token_cap: int,
                       margin: float, limit_s: float = np.inf) -> dict[int, int]:
    """C_a − r_a (17), (19) of every risky anchor whose own prefill fits, all at once
    (the time of each is its slack, at most ``limit_s``)."""
    s_a = np.minimum(snap.slack[risky], limit_s)
    c_a = np.minimum(curve.prefill_tokens_within_many(s_a * 1e3 / margin), token_cap)
    r_a = snap.remaining_prefill[risky]
    ok = r_a <= c_a
    if not ok.any():
        return {}
    return dict(zip(risky[ok].tolist(), (c_a - r_a)[ok].tolist(), strict=True))


def _candidate_pool(snap: Snapshot, live: np.ndarray, v_all: np.ndarray, anchors: np.ndarray,
                    max_candidates: int) -> _Pool:
    """Top values plus anchors, then the slack-descending order."""
    if len(live) > max_candidates:
        top = np.argpartition(-v_all, max_candidates - 1)[:max_candidates]
        keep = np.zeros(len(live), dtype=bool)
        keep[top] = True
        anchor = np.zeros(len(snap), dtype=bool)  # np.isin(live, anchors), without its sort
        anchor[anchors] = True
        keep |= anchor[live]
        pool_pos = np.flatnonzero(keep)
    else:
        pool_pos = np.arange(len(live))
    value_of = np.zeros(len(snap))
    value_of[live] = v_all
    pool = _order_by_slack_desc(snap, live[pool_pos])
    w = snap.remaining_prefill[pool].astype(np.int64)
    v = value_of[pool]
    return _Pool(pool, w, v, dict(zip(pool.tolist(), v.tolist(), strict=True)))


def _knapsack_pass(pool: _Pool, cap_of: dict[int, int]) -> tuple[np.ndarray, list[tuple[_Key, int, int]]]:
    """One knapsack pass over the pool: the choice bits, and for every anchor
    its key (21), its position in the pool and its capacity, read off the DP
    when the pass reaches it (its candidates are the items before it)."""
    return kernels.ops().knapsack_pass(pool.idx, pool.w, pool.v, pool.value, cap_of)


def _best_repaired(snap: Snapshot, pool: _Pool, take: np.ndarray, anchors: list[tuple[_Key, int, int]],
                   seq_cap: int, margin: float, predictor: BatchLatencyPredictor,
                   decodes: np.ndarray, limit_s: float = np.inf) -> tuple[_Key, list[int]] | None:
    """Try the anchors in key order; the best repaired selection, or None.  A selection
    fits when margin · T̂ ≤ the least slack it completes, and ≤ ``limit_s``."""
    value = pool.value
    slack_ms = snap.slack * 1e3
    u_dec = float(snap.kv_tokens[decodes].sum()) if len(decodes) else 0.0
    base = decode_features(float(len(decodes)), u_dec)
    anchors.sort(key=lambda e: e[0], reverse=True)
    best: tuple[_Key, list[int]] | None = None
    for key, pa, c in anchors:
        if best is not None and key <= best[0]:
            break  # repairs only lower keys: nothing left can win
        chosen = _read_back(snap, pool, take, pa, c, seq_cap)
        fit = _repair(snap, predictor, base, chosen, value, min(float(slack_ms[chosen].min()), limit_s * 1e3),
                      margin)
        if fit is None:
            continue
        rkey = (len(fit), sum(value[i] for i in fit), int(sum(int(snap.remaining_prefill[i]) for i in fit)))
        if best is None or rkey > best[0]:
            best = (rkey, fit)
    return best


def _read_back(snap: Snapshot, pool: _Pool, take: np.ndarray, pa: int, c: int, seq_cap: int) -> list[int]:
    """The selection of the anchor at pool position ``pa`` with capacity ``c``
    (anchor first), cut to ``seq_cap`` requests."""
    chosen = kernels.ops().read_back(take, pool.idx, pool.w, pa, c)
    if len(chosen) > seq_cap:
        # Rare: more prefills than sequence slots.  Keep the anchor and the
        # most valuable others.
        value = pool.value
        rest = sorted(chosen[1:], key=lambda i: (-value[i], snap.ids[i]))
        chosen = [chosen[0], *rest[: seq_cap - 1]]
    return chosen


def _repair(snap: Snapshot, predictor: BatchLatencyPredictor, base: np.ndarray, chosen: list[int],
            value: dict[int, float], slack_ms: float, margin: float) -> list[int] | None:
    """``chosen`` (anchor first) if margin · T̂ ≤ slack_ms, else with the
    items of least value per predicted ms dropped until it fits; None when
    the anchor alone does not fit."""
    idx = np.array(chosen, dtype=np.int64)
    # each item runs all its remaining tokens
    f = piece_features(snap.remaining_prefill[idx], snap.computed_tokens[idx])
    keep = np.ones(len(idx), dtype=bool)
    while True:
        t = float(predictor.predict_ms(combine_sets(base, f, keep[None, :]))[0])
        if t * margin <= slack_ms:
            return [chosen[j] for j in np.flatnonzero(keep)]
        others = np.flatnonzero(keep)[1:]
        if len(others) == 0:
            return None
        without = np.repeat(keep[None, :], len(others), axis=0)
        without[np.arange(len(others)), others] = False
        delta = t - predictor.predict_ms(combine_sets(base, f, without))
        ok = delta > 0
        if not ok.any():
            # No single drop saves time (a non-monotone predictor): the anchor alone or nothing.
            keep[others] = False
            continue
        ratio = np.where(ok, np.array([value[chosen[j]] for j in others]) / np.where(ok, delta, 1.0), np.inf)
        keep[others[int(np.argmin(ratio))]] = False
