"""Why a request waited: one reason for every request a plan does not fully serve.

``explain(policy, snapshot, predictor, plan)`` is a post-pass: it replays the rules of the
policy that made ``plan`` against the plan itself and returns the same plan with
``reasons`` set (docs/reasons.md).  It reads the plan and never changes an allocation, a
path, a rejection or a preemption.  ``plan_explained`` asks a policy that explains
itself (``explains``: every registered one) for ``plan(..., explain=True)`` instead: the
decision keeps what it knew (:func:`sliding_rules`, SlidingServe; :func:`assembled_reasons`,
the baselines) and the same rules classify from it, without replaying.  Deciding without
reasons costs nothing more either way.

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
from typing import Any, NamedTuple

import numpy as np

from . import kernels
from .features import DECODE
from .plan import CODES, REASON_CODES, Allocation, Plan, Reason, Reasons, Rejection
from .policy import Policy
from .predictor import BatchLatencyPredictor
from .rule_codes import RULE_SCALAR, RULE_SKIP, RULE_STARVE, RULES_LEN, reason_tokens, seqs_rules
from .snapshot import Snapshot
from .sorter import prefill_indices

__all__ = ["CODES", "REASON_CODES", "Decided", "PlanLike", "Reason", "Reasons", "assembled_reasons", "explain",
           "kv_left", "kv_watermark", "plan_explained", "reason_counts", "reserve_ms", "sliding_reasons",
           "sliding_rules", "token_budget"]

_C = {c: k for k, c in enumerate(CODES)}


class Decided(NamedTuple):
    """What explaining reads of a plan: its own fields without its reasons, for the
    reasons of a plan being assembled (:func:`assembled_reasons`), classified before the
    plan that carries them exists."""

    allocations: tuple[Allocation, ...]
    token_budget: int
    path: str
    rejections: tuple[Rejection, ...]
    preemptions: tuple[str, ...]


#: A plan as explaining reads it.
PlanLike = Plan | Decided


def plan_explained(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
    """``policy.plan(snapshot, predictor)`` with its reasons: a policy whose class sets
    ``explains`` (every registered one) explains from what its decision knew
    (``plan(..., explain=True)``), any other by the post-pass (:func:`explain`)."""
    if getattr(policy, "explains", False):
        return policy.plan(snapshot, predictor, explain=True)  # type: ignore[call-arg]
    return explain(policy, snapshot, predictor, policy.plan(snapshot, predictor))


def assembled_reasons(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Decided,
                      facts: dict[str, Any]) -> Reasons:
    """The reasons of ``plan``, being assembled (``assemble.assemble_plan``), classified
    now from what the decision knew, ``facts``: its ``decodes``, ``pre_rows`` and
    ``pre_toks`` (what each row gets, so that no allocation is looked up by id),
    optionally the ``budget`` it used and the rows it relegated (``lost_mask`` over
    ``lost_from``)."""
    return Reasons(snapshot.ids, *_classify(policy, snapshot, predictor, plan, facts))


def reason_counts(reasons: Sequence[Reason]) -> dict[str, int]:
    """Code → how many requests wait for it (``plan.reasons`` of any origin: explained
    here, or decoded from JSON or protobuf), codes in :data:`REASON_CODES` order."""
    if isinstance(reasons, Reasons):
        return reasons.counts()
    n = Counter(r.code for r in reasons)
    return {c: n[c] for c in (*CODES, *sorted(set(n) - set(CODES))) if n[c]}


def explain(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan) -> Plan:
    """``plan`` (made by ``policy`` for ``snapshot``) with a reason for every request it
    does not fully serve, the policy's rules replayed; the plan is otherwise returned as
    it is.  The reasons are classified when first read (their inputs, the snapshot and
    the plan, are immutable), so a caller that never reads them pays only for this call."""
    if len(snapshot) == 0:
        return plan
    reasons = Reasons(snapshot.ids, compute=lambda: _classify(policy, snapshot, predictor, plan))
    return Plan(plan.policy, plan.policy_version, plan.predictor_version, plan.path, plan.token_budget,
                plan.predicted_latency_ms, plan.allocations, plan.decision_us, plan.breakdown_us, plan.deployment,
                plan.rejections, plan.preemptions, reasons)


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_CODES = np.zeros(0, dtype=np.int8)
_NO_MASK = np.zeros(0, dtype=bool)
_NO_VERDICTS = np.zeros((3, 0), dtype=np.int64)
(_TOKEN_BUDGET, _KV, _KV_WATERMARK, _CLASS_RESERVE, _CLASS_RESCUE, _NOT_CHOSEN, _TIME_BUDGET) = (
    _C[c] for c in ("token_budget", "kv", "kv_watermark", "class_reserve", "class_rescue", "not_chosen",
                    "time_budget"))
#: The kernel's ``rules`` (``rule_codes.RULE_SCALAR``): rule c on at ``rules[c]``, its number at
#: ``rules[_S + c]``.
_S = RULE_SCALAR


def _rules_on(*codes: str, starve: float = 0.0, skip: float = 0.0) -> np.ndarray:
    """Read-only rules with ``codes`` on (no numbers), the starvation bound and the decode skip."""
    rules = np.zeros(RULES_LEN)
    rules[[_C[c] for c in codes]] = 1.0
    rules[RULE_STARVE], rules[RULE_SKIP] = starve, skip
    rules.flags.writeable = False
    return rules


_RULES_OFF = _rules_on()


def _sliding_rules(p: Any, one_class: bool, own_rule: int) -> np.ndarray:
    """The rules a SlidingServe plan that no hard limit closes switches on (read-only: a
    plan passes its own number apart, and copies them only for rules of its own, the KV
    watermark, a class hold, ``max_num_seqs``), for parameters ``p``: the decode sit-outs
    always, the lost rule's with MLPS order, the class sit-out with several classes, and
    ``own_rule``, the rule of the batch the plan was not in (``not_chosen``:
    BatchConstructor, ``time_budget``: the decode windows, −1: none).  A policy keeps them
    (``SlidingServePolicy.reason_rules``)."""
    codes = ["late", "ahead"] + ["given_up", "expired"] * (p.order == "mlps") + ["class_sit_out"] * (not one_class)
    return _rules_on(*codes, *([CODES[own_rule]] if own_rule >= 0 else []), starve=p.starve_after,
                     skip=p.decode_skip_tbts)


def _classify(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: PlanLike,
              facts: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(waiting rows, their code indices, their values): what :func:`explain` promises.

    Here only the plan-wide facts are gathered (which rules apply, their numbers, the
    sets the decision held back); the per-request work, over the rows, which also counts
    each row's tokens, is the ``reason_codes`` operation of the kernels facade
    (the ``reason_codes`` kernel)."""
    got = None
    if facts is not None:  # what the decision assembled (the kernel finds whether anything waits)
        dec_rows, pre_rows, pre_toks = facts["decodes"], facts["pre_rows"], facts["pre_toks"]
    else:
        dec_rows, (pre_rows, pre_toks) = _EMPTY, _allocated(snap, plan)
        got = reason_tokens(len(snap), dec_rows, pre_rows, pre_toks)
        if not (got < np.where(snap.is_decoding, 1, snap.remaining_prefill)).any():
            return _EMPTY, _NO_CODES, np.zeros(0)  # nothing waits: no rule to replay
    rules = _RULES_OFF.copy()
    budget = facts.get("budget") if facts is not None else None
    closed = _limits(policy, snap, predictor, plan, rules, budget)
    lost_from, lost_mask, marked = _EMPTY, _NO_MASK, _EMPTY
    if not closed and hasattr(policy, "held_back"):  # (closed: no rule of the policy's own is reached)
        if got is None:
            got = reason_tokens(len(snap), dec_rows, pre_rows, pre_toks)
        lost_from, marked = _sliding(policy, snap, predictor, plan, got, rules)
        lost_mask = np.ones(len(lost_from), dtype=bool)
    elif not closed and hasattr(policy, "relegated"):  # QoServe
        if facts is not None and "lost_from" in facts:
            lost_from, lost_mask = facts["lost_from"], facts["lost_mask"]
        else:
            lost_from = prefill_indices(snap)
            lost_mask = policy.relegated(snap, predictor, lost_from)  # type: ignore[attr-defined]
        rules[_C["given_up"]] = 1.0
    return kernels.ops().reason_codes(snap, dec_rows, pre_rows, pre_toks, lost_from, lost_mask, marked,
                                      _verdicts(snap, plan.rejections, plan.preemptions), rules)


def sliding_reasons(policy: Any, snap: Snapshot, decodes: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray,
                    lost_from: np.ndarray, lost_mask: np.ndarray, n_decoding: int, holders: int,
                    held_back: dict[str, Any]) -> Reasons:
    """The reasons of the plan BatchConstructor chose (``decodes`` and the prefills it
    gives all they need), classified as a SlidingServe decision assembles it, from what
    :func:`sliding_rules` reads, with ``max_num_seqs`` where the plan reaches it
    (``rule_codes.seqs_rules``, as the kernel that fills and classifies the sliding
    chunker's plans has it: ``SlidingServePolicy._fill``)."""
    lost, mask, marked, verdicts, rules, own_rule, own = sliding_rules(
        policy, snap, len(decodes) + int(pre_toks.sum()), len(pre_rows), None, lost_from, lost_mask, n_decoding,
        holders, held_back)
    rules = seqs_rules(rules, len(decodes) + len(pre_rows), snap.max_num_seqs)
    return Reasons(snap.ids, *kernels.ops().reason_codes(snap, decodes, pre_rows, pre_toks, lost, mask, marked,
                                                         verdicts, rules, own_rule, own))


def sliding_rules(policy: Any, snap: Snapshot, budget: int, chosen: int | None, W: np.ndarray | None,
                  lost_from: np.ndarray, lost_mask: np.ndarray, n_decoding: int, holders: int,
                  held_back: dict[str, Any]) -> tuple[Any, ...]:
    """What the reasons kernel needs beside the plan's rows (``reason_codes`` from
    ``lost_from`` on) for a SlidingServe plan, but the ``max_num_seqs`` rule
    (``rule_codes.seqs_rules``, applied by the caller): its token ``budget``, ``chosen``
    the prefills BatchConstructor chose (None: not its plan), the decode windows ``W``, the prefills the decision
    considered (``lost_from``) and gave up on (``lost_mask``), the count of decoding
    requests and of requests holding KV, and in ``held_back`` the rows the class reserve
    held back (``held``, with ``reserve_ms``) and the decodes the class rescue sat out
    (``rescued``), when it did, and the ``rejections`` it shed.  A few scalar comparisons;
    a decision that preempts is explained by the post-pass.  The same rules as
    :func:`_limits` and :func:`_sliding` (``tests/test_reasons.py`` checks the two give
    the same reasons)."""
    p = policy.params
    lost, mask, marked = _EMPTY, _NO_MASK, _EMPTY
    own_rule, own = -1, 0.0
    free = snap.free_kv_tokens
    left = 1 if free is None else free - budget - p.kv_decode_reserve * n_decoding
    if budget >= snap.max_batch_tokens:
        rules = _RULES_OFF.copy()
        rules[_TOKEN_BUDGET], rules[_S + _TOKEN_BUDGET] = 1.0, snap.max_batch_tokens
    elif left < 1:
        rules = _RULES_OFF.copy()
        rules[_KV], rules[_S + _KV] = 1.0, left
    else:  # the common plan: its configuration's rules (shared), its own number apart
        at = 3 * snap.one_class  # where in the policy's reason_rules
        if chosen is not None:
            own_rule, own, at = _NOT_CHOSEN, float(chosen), at + 1
        elif W is not None:
            own_rule, own, at = _TIME_BUDGET, W.item(0), at + 2
        rules = policy.reason_rules[at]
        if rules is None:
            rules = policy.reason_rules[at] = _sliding_rules(p, snap.one_class, own_rule)
        lost, mask = lost_from, lost_mask
        watermark = free is not None and left - (mark := p.kv_growth_iters * holders) < 1
        if watermark or held_back:  # rules of this plan alone: on a copy
            rules = rules.copy()
            if watermark:
                rules[_KV_WATERMARK], rules[_S + _KV_WATERMARK] = 1.0, mark
            if (h := held_back.get("held")) is not None:
                marked, rules[_CLASS_RESERVE], rules[_S + _CLASS_RESERVE] = h, 1.0, held_back["reserve_ms"]
            if (r := held_back.get("rescued")) is not None:
                marked, rules[_CLASS_RESCUE], rules[_S + _CLASS_RESCUE] = (np.concatenate([marked, r]), 1.0,
                                                                           len(r))
    # (under a hard limit no decode rule is on: the starvation bound and the skip go unread)
    verdicts = _verdicts(snap, held_back["rejections"]) if "rejections" in held_back else _NO_VERDICTS
    return lost, mask, marked, verdicts, rules, own_rule, own


def _allocated(snap: Snapshot, plan: PlanLike) -> tuple[np.ndarray, np.ndarray]:
    """``plan``'s allocations as (snapshot rows, tokens)."""
    if not plan.allocations:
        return _EMPTY, _EMPTY
    ids, toks = zip(*plan.allocations, strict=True)
    return (np.fromiter(map(snap.index_of.__getitem__, ids), dtype=np.int64, count=len(ids)),
            np.array(toks, dtype=np.int64))


def _verdicts(snap: Snapshot, rejections: Sequence[Rejection], preemptions: Sequence[str] = ()) -> np.ndarray:
    """The rejections and preemptions, which come before every rule: their rows, their
    codes and their KV tokens (int64, three rows)."""
    if not rejections and not preemptions:
        return _NO_VERDICTS
    index = snap.index_of
    rows = [index[r.id] for r in rejections] + [index[r] for r in preemptions]
    codes = [_C[r.reason] if r.reason in _C else _C["ttft_unreachable"] for r in rejections]
    codes += [_C["preempted"]] * len(preemptions)
    return np.array([rows, codes, snap.kv_tokens[rows]], dtype=np.int64)


def token_budget(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor) -> int:
    """The policy's total token budget for the iteration (decode tokens included)."""
    budget = getattr(policy, "iteration_budget", None)  # Sarathi, QoServe
    return snap.max_batch_tokens if budget is None else min(int(budget(snap, predictor)), snap.max_batch_tokens)


def kv_left(policy: Policy, snap: Snapshot, plan: PlanLike, gone: np.ndarray | None = None) -> int | None:
    """KV tokens the plan leaves free after its tokens, the preempted requests' KV counted
    as free, and the policy's per-decode reserve for every decode (None: KV unlimited)."""
    if snap.free_kv_tokens is None:
        return None
    reserve = int(getattr(policy.params, "kv_decode_reserve", 0))
    freed = int(snap.kv_tokens[gone].sum()) if gone is not None and gone.any() else 0
    if gone is None and plan.preemptions:
        freed = int(sum(int(snap.kv_tokens[snap.index_of[r]]) for r in plan.preemptions))
    return snap.free_kv_tokens + freed - plan.token_budget - reserve * int(np.count_nonzero(snap.is_decoding))


def kv_watermark(policy: Policy, snap: Snapshot, plan: PlanLike) -> int:
    """The KV a new admission must leave free (SlidingServe's growth watermark, else 0)."""
    iters = int(getattr(policy.params, "kv_growth_iters", 0))
    if not iters:
        return 0
    holders = int(np.count_nonzero(snap.started)) - len(plan.preemptions)
    return iters * holders


def _rule(rules: np.ndarray, code: str, value: float = 0.0) -> None:
    rules[_C[code]] = 1.0
    rules[_S + _C[code]] = value


def _limits(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: PlanLike,
            rules: np.ndarray, budget: int | None = None) -> bool:
    """The hard limits: sequences, tokens (``budget``: the policy's, when the decision
    kept it), KV, the KV-growth watermark; True when one holds for every waiting request
    (no later rule can be reached)."""
    if len(plan.allocations) >= snap.max_num_seqs:
        _rule(rules, "max_num_seqs", float(snap.max_num_seqs))
    if budget is None:
        budget = token_budget(policy, snap, predictor)
    if plan.token_budget >= budget:
        _rule(rules, "token_budget", float(budget))
        return True
    left = kv_left(policy, snap, plan)
    if left is None:
        return False
    if left < 1:
        _rule(rules, "kv", float(left))
        return True
    mark = kv_watermark(policy, snap, plan)
    if left - mark < 1:  # no new admission; the prefill stream stops at the first new request
        _rule(rules, "kv_watermark", float(mark))
    return False


def _sliding(policy: Any, snap: Snapshot, predictor: BatchLatencyPredictor, plan: PlanLike, got: np.ndarray,
             rules: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SlidingServe's own rules replayed (``got``: tokens per row): (lost rows, the rows
    held back by the class reserve or sat out by the class rescue), the rules switched on
    in ``rules`` with the starvation bound and the decode skip."""
    p = policy.params
    lost, held, rescued, W = _state(policy, snap, predictor, plan, got)
    if held is not None:
        _rule(rules, "class_reserve", reserve_ms(snap, predictor))
    if p.order == "mlps":
        _rule(rules, "given_up")
        _rule(rules, "expired")
    if rescued is not None:
        _rule(rules, "class_rescue", float(len(rescued)))
    _rule(rules, "late")
    _rule(rules, "ahead")
    if not snap.one_class:
        _rule(rules, "class_sit_out")
    if plan.path == "batch_constructor":  # the prefills it chose
        _rule(rules, "not_chosen", float(np.count_nonzero((got > 0) & ~snap.is_decoding)))
    elif W is not None:
        _rule(rules, "time_budget", float(W[0]))
    rules[RULE_STARVE], rules[RULE_SKIP] = p.starve_after, p.decode_skip_tbts
    return lost, np.concatenate([_EMPTY, *(m for m in (held, rescued) if m is not None)])


def _state(policy: Any, snap: Snapshot, predictor: BatchLatencyPredictor, plan: PlanLike, got: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Rows given up on, held by the class reserve (None: none), sat out by the class
    rescue (None: none), and the decode windows (None: no safe decode), replayed."""
    p = policy.params
    gone = np.zeros(len(snap), dtype=bool)
    if plan.preemptions:
        gone[[snap.index_of[r] for r in plan.preemptions]] = True
    lost, held, rescued = policy.held_back(snap, predictor, gone)
    W = kernels.ops().window_limits(snap, np.flatnonzero(snap.is_decoding & (got > 0)), p.window, p.margin)
    return lost, held if len(held) else None, rescued if len(rescued) else None, W


def reserve_ms(snap: Snapshot, predictor: BatchLatencyPredictor) -> float:
    """T̂_dec of the class reserve: the decodes plus the partial prefills, decode-only."""
    partial = np.flatnonzero(~snap.is_decoding & snap.started)
    dec_all = np.flatnonzero(snap.is_decoding)
    k = len(dec_all) + len(partial)
    u = float(snap.kv_tokens[dec_all].sum() + snap.prompt_tokens[partial].sum())
    return float(predictor.model(DECODE).base_ms(k, u)) if k else 0.0

