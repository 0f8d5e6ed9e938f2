"""Why a request waited: one reason for every request a plan does not fully serve.

``explain(policy, snapshot, predictor, plan)`` is a post-pass: it replays the rules of the
policy that made ``plan`` against the plan itself and returns the same plan with
``reasons`` set (docs/policies.md, "Why a request waited: reason codes").  It reads the
plan and never changes an allocation, a path, a rejection or a preemption; a policy's
``plan()`` does not call it, so deciding without reasons costs nothing more.

A request is *not fully served* when it gets no token (a decode that sits out, a prefill
that waits) or, a prefill, fewer prompt tokens than remain.  Each gets exactly one reason,
the first of these that holds (the order is the code order below, after the request's own
verdicts: rejected, preempted, held back by the class reserve):

``max_num_seqs`` → ``token_budget`` → ``kv`` → ``kv_watermark`` (the hard limits) →
``given_up`` / ``expired`` (served only after every live request) → the decode sit-out
rules (``class_rescue``, ``late``, ``ahead``, ``class_sit_out``) → the batch it was not
in (``not_chosen``: BatchConstructor; ``time_budget``: the decode windows) → ``behind``.

``plan.reasons`` is a sequence of :class:`~.plan.Reason` (``.id``, ``.code``,
``.value``); :data:`REASON_CODES` pairs each code with a one-line description.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import kernels
from .baselines import QoServePolicy, SarathiPolicy
from .features import DECODE
from .plan import CODES, REASON_CODES, Plan, Reason, Reasons
from .policy import Policy
from .predictor import BatchLatencyPredictor
from .slidingserve import SlidingServePolicy, _without
from .snapshot import Snapshot
from .sorter import prefill_indices

__all__ = ["CODES", "REASON_CODES", "Reason", "Reasons", "explain", "plan_explained"]

_C = {c: k for k, c in enumerate(CODES)}


def plan_explained(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
    """``policy.plan(snapshot, predictor)`` with its reasons (:func:`explain`)."""
    return explain(policy, snapshot, predictor, policy.plan(snapshot, predictor))


class _Why:
    """The code and value of each row, filled first come first served."""

    def __init__(self, waiting: np.ndarray) -> None:
        self.open = waiting.copy()
        self.code = np.full(len(waiting), -1, dtype=np.int8)
        self.value = np.zeros(len(waiting))

    def set(self, mask: np.ndarray, code: str, value: float | np.ndarray) -> None:
        m = mask & self.open
        if m.any():
            self.code[m] = _C[code]
            self.value[m] = value[m] if isinstance(value, np.ndarray) else value
            self.open &= ~m


def explain(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan) -> Plan:
    """``plan`` (made by ``policy`` for ``snapshot``) with a reason for every request it
    does not fully serve; the plan is otherwise returned as it is."""
    snap = snapshot
    n = len(snap)
    if n == 0:
        return plan
    index = snap.index_of
    got = np.zeros(n, dtype=np.int64)
    if plan.allocations:
        ids, toks = zip(*plan.allocations, strict=True)
        got[np.fromiter(map(index.__getitem__, ids), dtype=np.int64, count=len(ids))] = toks
    dec = snap.is_decoding
    waiting = got < np.where(dec, 1, snap.remaining_prefill)
    if not waiting.any():
        return plan
    why = _Why(waiting)
    slack_ms = snap.slack * 1e3
    for r in plan.rejections:
        why.set(_row(n, index[r.id]), r.reason if r.reason in _C else "ttft_unreachable", slack_ms)
    gone = np.zeros(n, dtype=bool)
    if plan.preemptions:
        gone[[index[r] for r in plan.preemptions]] = True
        why.set(gone, "preempted", snap.kv_tokens.astype(np.float64))
    if why.open.any():
        _limits(policy, snap, predictor, plan, got, gone, why)
    if why.open.any() and isinstance(policy, SlidingServePolicy):
        _sliding(policy, snap, predictor, plan, got, gone, why)
    if why.open.any() and isinstance(policy, QoServePolicy):
        pre = prefill_indices(snap)
        rel = np.zeros(n, dtype=bool)
        rel[pre[policy.relegated(snap, predictor, pre)]] = True
        why.set(rel, "given_up", slack_ms)
    why.set(why.open, "behind", float(len(plan.allocations)))
    rows = np.flatnonzero(waiting)
    return replace(plan, reasons=Reasons(snap.ids, rows, why.code[rows], why.value[rows]))


def _row(n: int, i: int) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[i] = True
    return m


def token_budget(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor) -> int:
    """The policy's total token budget for the iteration (decode tokens included)."""
    if isinstance(policy, SarathiPolicy):
        return min(policy.params.chunk_size, snap.max_batch_tokens)
    if isinstance(policy, QoServePolicy):
        return min(policy.total_budget(snap, policy.candidate_queue(snap, predictor)), snap.max_batch_tokens)
    return snap.max_batch_tokens


def kv_left(policy: Policy, snap: Snapshot, plan: Plan, gone: np.ndarray | None = None) -> int | None:
    """KV tokens the plan leaves free after its tokens, the preempted requests' KV counted
    as free, and the policy's per-decode reserve for every decode (None: KV unlimited)."""
    if snap.free_kv_tokens is None:
        return None
    reserve = int(getattr(policy.params, "kv_decode_reserve", 0))
    freed = int(snap.kv_tokens[gone].sum()) if gone is not None and gone.any() else 0
    if gone is None and plan.preemptions:
        freed = int(sum(int(snap.kv_tokens[snap.index_of[r]]) for r in plan.preemptions))
    return snap.free_kv_tokens + freed - plan.token_budget - reserve * int(np.count_nonzero(snap.is_decoding))


def kv_watermark(policy: Policy, snap: Snapshot, plan: Plan) -> int:
    """The KV a new admission must leave free (SlidingServe's growth watermark, else 0)."""
    if not isinstance(policy, SlidingServePolicy):
        return 0
    holders = int(np.count_nonzero(snap.computed_tokens > 0)) - len(plan.preemptions)
    return policy.params.kv_growth_iters * holders


def _limits(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan, got: np.ndarray,
            gone: np.ndarray, why: _Why) -> None:
    """The hard limits: sequences, tokens, KV, the KV-growth watermark."""
    if len(plan.allocations) >= snap.max_num_seqs:
        why.set(got == 0, "max_num_seqs", float(snap.max_num_seqs))
    budget = token_budget(policy, snap, predictor)
    if plan.token_budget >= budget:
        why.set(why.open, "token_budget", float(budget))
    left = kv_left(policy, snap, plan, gone)
    if left is None:
        return
    if left < 1:
        why.set(why.open, "kv", float(left))
        return
    mark = kv_watermark(policy, snap, plan)
    if left - mark < 1:  # no new admission; the prefill stream stops at the first new request
        why.set(~snap.is_decoding, "kv_watermark", float(mark))


def _sliding(policy: SlidingServePolicy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan,
             got: np.ndarray, gone: np.ndarray, why: _Why) -> None:
    """SlidingServe's own rules, replayed on the snapshot it planned on."""
    p = policy.params
    n = len(snap)
    if gone.any():
        keep = ~gone
        sub = _without(snap, keep, int(snap.free_kv_tokens or 0) + int(snap.kv_tokens[gone].sum()))
        rows = np.flatnonzero(keep)
        masks = policy.held_back(sub, predictor)
        lost, held, rescued = (np.zeros(n, dtype=bool) for _ in range(3))
        for full, part in zip((lost, held, rescued), masks, strict=True):
            full[rows[part]] = True
    else:
        lost, held, rescued = policy.held_back(snap, predictor)
    slack = snap.slack
    dec = snap.is_decoding
    if held.any():  # checked after the limits: a held class is held whatever they leave
        why.set(held, "class_reserve", _reserve_ms(snap, predictor))
    if p.order == "mlps":
        why.set(lost, "given_up", slack * 1e3)
        why.set(~dec & (slack <= 0), "expired", slack * 1e3)
    why.set(rescued, "class_rescue", float(np.count_nonzero(rescued)))
    late = dec & (slack <= 0)
    if p.starve_after > 0:
        late &= slack > -p.starve_after * snap.tbt_slo
    why.set(late, "late", slack * 1e3)
    why.set(dec & (slack > p.decode_skip_tbts * snap.step), "ahead", slack * 1e3)
    if not snap.one_class:
        why.set(dec, "class_sit_out", snap.priority.astype(np.float64))
    if plan.path == "batch_constructor":
        why.set(~dec, "not_chosen", float(np.count_nonzero((got > 0) & ~dec)))
        return
    W = kernels.ops().window_limits(snap, np.flatnonzero(dec & (got > 0)), p.window, p.margin)
    if W is not None:
        why.set(~dec, "time_budget", float(W[0]))


def _reserve_ms(snap: Snapshot, predictor: BatchLatencyPredictor) -> float:
    """T̂_dec of the class reserve: the decodes plus the partial prefills, decode-only."""
    partial = np.flatnonzero(~snap.is_decoding & (snap.computed_tokens > 0))
    dec_all = np.flatnonzero(snap.is_decoding)
    k = len(dec_all) + len(partial)
    u = float(snap.kv_tokens[dec_all].sum() + snap.prompt_tokens[partial].sum())
    return float(predictor.model(DECODE).base_ms(k, u)) if k else 0.0

