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

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import kernels
from .features import DECODE
from .plan import CODES, REASON_CODES, Plan, Reason, Reasons
from .policy import Policy
from .predictor import BatchLatencyPredictor
from .snapshot import Snapshot
from .sorter import prefill_indices

__all__ = ["CODES", "REASON_CODES", "Reason", "Reasons", "explain", "kv_left", "kv_watermark", "plan_explained",
           "reason_counts", "token_budget"]

_C = {c: k for k, c in enumerate(CODES)}


def plan_explained(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
    """``policy.plan(snapshot, predictor)`` with its reasons: SlidingServe explains from
    what its decision knew (``plan(..., explain=True)``), any other policy by the post-pass."""
    if hasattr(policy, "held_back"):  # SlidingServe
        return policy.plan(snapshot, predictor, explain=True)  # type: ignore[call-arg]
    return explain(policy, snapshot, predictor, policy.plan(snapshot, predictor))


def reason_counts(reasons: Sequence[Reason]) -> dict[str, int]:
    """Code → how many requests wait for it (``plan.reasons`` of any origin: explained
    here, or decoded from JSON or protobuf), codes in :data:`REASON_CODES` order."""
    if isinstance(reasons, Reasons):
        return reasons.counts()
    n = Counter(r.code for r in reasons)
    return {c: n[c] for c in (*CODES, *sorted(set(n) - set(CODES))) if n[c]}


#: Codes whose value is the request's slack in ms.
_SLACK = np.zeros(len(CODES), dtype=bool)
_SLACK[[_C[c] for c in ("given_up", "expired", "ahead", "late", "ttft_expired", "e2e_expired",
                        "ttft_unreachable", "e2e_unreachable")]] = True


class _Rules:
    """The rules that hold, in order, over the waiting rows: ``mask`` None means every
    waiting row (nothing after it can be reached); ``value`` the code's value where it is
    one number."""

    def __init__(self, n_codes: int) -> None:
        self.rules: list[tuple[np.ndarray | None, int]] = []
        self.scalar = np.zeros(n_codes)
        self.closed = False

    def add(self, mask: np.ndarray | None, code: str, value: float = 0.0) -> None:
        if self.closed or (mask is not None and not mask.any()):
            return
        self.rules.append((mask, _C[code]))
        self.scalar[_C[code]] = value
        self.closed = mask is None

    def codes(self, n: int) -> np.ndarray:
        out = np.full(n, _C["behind"], dtype=np.int8)
        for mask, c in reversed(self.rules):  # the first rule that holds is written last
            if mask is None:
                out[:] = c
            else:
                out[mask] = c
        return out


def explain(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan,
            trace: dict[str, Any] | None = None) -> Plan:
    """``plan`` (made by ``policy`` for ``snapshot``) with a reason for every request it
    does not fully serve; the plan is otherwise returned as it is.  ``trace``: what a
    SlidingServe decision recorded while deciding (``plan(..., explain=True)``); without
    it the rules are replayed.  The reasons are classified when first read (their
    inputs, the snapshot, the plan and the trace, are immutable), so a caller that
    never reads them pays only for this call."""
    if len(snapshot) == 0:
        return plan
    reasons = Reasons(snapshot.ids, compute=lambda: _classify(policy, snapshot, predictor, plan, trace))
    return Plan(plan.policy, plan.policy_version, plan.predictor_version, plan.path, plan.token_budget,
                plan.predicted_latency_ms, plan.allocations, plan.decision_us, plan.breakdown_us, plan.deployment,
                plan.rejections, plan.preemptions, reasons)


_NONE = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8), np.zeros(0))


def _classify(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan,
              trace: dict[str, Any] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(waiting rows, their code indices, their values): what :func:`explain` promises."""
    n = len(snap)
    got = _got(snap, plan, trace)
    dec = snap.is_decoding
    rows = np.flatnonzero(got < np.where(dec, 1, snap.remaining_prefill))
    if not len(rows):
        return _NONE
    rules = _Rules(len(CODES))
    rules.scalar[_C["behind"]] = len(plan.allocations)
    gone = np.zeros(n, dtype=bool)
    if plan.preemptions:
        gone[[snap.index_of[r] for r in plan.preemptions]] = True
    _limits(policy, snap, predictor, plan, got, gone, rows, rules)
    if hasattr(policy, "held_back"):
        _sliding(policy, snap, predictor, plan, got, gone, rows, rules, trace)
    elif hasattr(policy, "relegated") and not rules.closed:  # QoServe
        pre = prefill_indices(snap)
        rel = np.zeros(n, dtype=bool)
        rel[pre[policy.relegated(snap, predictor, pre)]] = True
        rules.add(rel[rows], "given_up")
    code = rules.codes(len(rows))
    value = rules.scalar[code]
    _verdicts(snap, plan, rows, code, value)
    slack = _SLACK[code]
    if slack.any():
        value[slack] = snap.slack[rows[slack]] * 1e3
    for c, col in (("class_sit_out", snap.priority), ("preempted", snap.kv_tokens)):
        m = code == _C[c]
        if m.any():
            value[m] = col[rows[m]]
    return rows, code, value


def _got(snap: Snapshot, plan: Plan, trace: dict[str, Any] | None) -> np.ndarray:
    """Tokens per snapshot row in ``plan``."""
    got = np.zeros(len(snap), dtype=np.int64)
    if trace is not None:
        got[trace["decodes"]] = 1
        if trace["pre_alloc"]:
            i, t = zip(*trace["pre_alloc"], strict=True)
            got[list(i)] = t
    elif plan.allocations:
        ids, toks = zip(*plan.allocations, strict=True)
        got[np.fromiter(map(snap.index_of.__getitem__, ids), dtype=np.int64, count=len(ids))] = toks
    return got


def _verdicts(snap: Snapshot, plan: Plan, rows: np.ndarray, code: np.ndarray, value: np.ndarray) -> None:
    """The rejections and preemptions, which come before every rule."""
    index = snap.index_of
    for r in plan.rejections:
        k = int(np.searchsorted(rows, index[r.id]))
        code[k] = _C[r.reason] if r.reason in _C else _C["ttft_unreachable"]
    for rid in plan.preemptions:
        code[int(np.searchsorted(rows, index[rid]))] = _C["preempted"]


def _member(n: int, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Mask over ``rows``: which are in ``idx`` (both snapshot rows)."""
    m = np.zeros(n, dtype=bool)
    m[idx] = True
    return m[rows]


def token_budget(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor) -> int:
    """The policy's total token budget for the iteration (decode tokens included)."""
    budget = getattr(policy, "iteration_budget", None)  # Sarathi, QoServe
    return snap.max_batch_tokens if budget is None else min(int(budget(snap, predictor)), snap.max_batch_tokens)


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
    iters = int(getattr(policy.params, "kv_growth_iters", 0))
    if not iters:
        return 0
    holders = int(np.count_nonzero(snap.computed_tokens > 0)) - len(plan.preemptions)
    return iters * holders


def _limits(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan, got: np.ndarray,
            gone: np.ndarray, rows: np.ndarray, rules: _Rules) -> None:
    """The hard limits: sequences, tokens, KV, the KV-growth watermark."""
    if len(plan.allocations) >= snap.max_num_seqs:
        rules.add(got[rows] == 0, "max_num_seqs", float(snap.max_num_seqs))
    budget = token_budget(policy, snap, predictor)
    if plan.token_budget >= budget:
        rules.add(None, "token_budget", float(budget))
    left = kv_left(policy, snap, plan, gone)
    if left is None:
        return
    if left < 1:
        rules.add(None, "kv", float(left))
        return
    mark = kv_watermark(policy, snap, plan)
    if left - mark < 1:  # no new admission; the prefill stream stops at the first new request
        rules.add(~snap.is_decoding[rows], "kv_watermark", float(mark))


def _sliding(policy: Any, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan,
             got: np.ndarray, gone: np.ndarray, rows: np.ndarray, rules: _Rules,
             trace: dict[str, Any] | None) -> None:
    """SlidingServe's own rules, from the decision's trace or replayed."""
    if rules.closed:
        return
    p = policy.params
    lost, held, rescued, W = _state(policy, snap, predictor, got, gone, trace)
    d = snap.is_decoding[rows]
    slack = snap.slack[rows]
    if held is not None:
        rules.add(_member(len(snap), held, rows), "class_reserve", _reserve_ms(snap, predictor))
    if p.order == "mlps":
        if len(lost):
            rules.add(_member(len(snap), lost, rows), "given_up")
        rules.add(~d & (slack <= 0), "expired")
    if d.any():
        dr = rows[d]
        if rescued is not None:
            rules.add(_member(len(snap), rescued, rows), "class_rescue", float(len(rescued)))
        late = d & (slack <= 0)
        if p.starve_after > 0:
            late &= slack > -p.starve_after * snap.tbt_slo[rows]
        rules.add(late, "late")
        ahead = np.zeros(len(rows), dtype=bool)
        ahead[d] = snap.slack[dr] > p.decode_skip_tbts * snap.step[dr]
        rules.add(ahead, "ahead")
        if not snap.one_class:
            rules.add(d, "class_sit_out")
    if plan.path == "batch_constructor":
        rules.add(~d, "not_chosen", float(np.count_nonzero((got > 0) & ~snap.is_decoding)))
    elif W is not None:
        rules.add(~d, "time_budget", float(W[0]))


def _state(policy: Any, snap: Snapshot, predictor: BatchLatencyPredictor, got: np.ndarray,
           gone: np.ndarray, trace: dict[str, Any] | None
           ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Rows given up on, held by the class reserve (None: none), sat out by the class
    rescue (None: none), and the decode windows (None: no safe decode)."""
    p = policy.params
    if trace is not None:
        return trace["lost"], trace.get("held"), trace.get("rescued"), trace["W"]
    lost, held, rescued = policy.held_back(snap, predictor, gone)
    W = kernels.ops().window_limits(snap, np.flatnonzero(snap.is_decoding & (got > 0)), p.window, p.margin)
    return lost, held if len(held) else None, rescued if len(rescued) else None, W


def _reserve_ms(snap: Snapshot, predictor: BatchLatencyPredictor) -> float:
    """T̂_dec of the class reserve: the decodes plus the partial prefills, decode-only."""
    partial = np.flatnonzero(~snap.is_decoding & (snap.computed_tokens > 0))
    dec_all = np.flatnonzero(snap.is_decoding)
    k = len(dec_all) + len(partial)
    u = float(snap.kv_tokens[dec_all].sum() + snap.prompt_tokens[partial].sum())
    return float(predictor.model(DECODE).base_ms(k, u)) if k else 0.0

