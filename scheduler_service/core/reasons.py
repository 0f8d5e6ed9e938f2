"""Why a request waited: one reason for every request a plan does not fully serve.

One classifier explains every plan: :func:`classify` (and :func:`classify_fill`, which
fills the sliding chunker's prefills in the same compiled call) reads a :class:`Facts`
record, what the decision knew (its token budget, the KV it keeps, the prefills it gave up
on, the decode sit-out rules it applies, the rows the class rules held back, the batch
it chose, its verdicts), and the rows the plan serves.  A policy that explains itself
(``explains``: every registered one) hands its decision's facts over as it decides
(``plan(..., explain=True)``, what :func:`plan_explained` asks for); ``explain(policy,
snapshot, predictor, plan)`` is the post-pass for a plan made before: the policy's
``facts(snapshot, predictor, plan)`` replays its rules to rebuild the record (a policy
without that method gets the engine's limits only).  Neither changes an allocation, a
path, a rejection or a preemption (docs/reasons.md).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import kernels
from .features import DECODE
from .plan import CODES, REASON_CODES, Plan, Reason, Reasons, Rejection
from .predictor import BatchLatencyPredictor
from .rule_codes import RULE_SCALAR, RULE_SKIP, RULE_STARVE, RULES_LEN, reason_tokens
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .batch import CandidateQueue
    from .policy import Policy

__all__ = ["CODES", "REASON_CODES", "Facts", "Reason", "Reasons", "allocated_rows", "classify", "classify_fill", "explain",
           "plan_explained", "reason_counts", "reserve_ms"]

_C = {c: k for k, c in enumerate(CODES)}
_EMPTY = np.zeros(0, dtype=np.int64)
_NO_MASK = np.zeros(0, dtype=bool)
_NO_VERDICTS = np.zeros((3, 0), dtype=np.int64)


@dataclass(slots=True)
class Facts:
    """What a decision knew when it made its plan, for the plan's reasons: the one input of
    the classifier besides the rows the plan serves.  Which rules a waiting request can
    get follows from it (docs/reasons.md, How a reason is chosen)."""

    #: The policy's token budget of the iteration, decode tokens included (the snapshot's
    #: ``max_batch_tokens``, Sarathi's chunk, QoServe's budget): ``token_budget`` once used up.
    budget: int
    #: KV tokens kept free per running decode, and the watermark a new admission must leave
    #: free (``kv``, ``kv_watermark``).
    kv_decode_reserve: int = 0
    kv_watermark: int = 0
    #: The prefills the decision considered, and a mask over them of those it gave up on
    #: (``given_up``, switched on by ``given_up``); ``expired``: expired prefills go last.
    lost_from: np.ndarray | None = None
    lost_mask: np.ndarray | None = None
    given_up: bool = False
    expired: bool = False
    #: The decode sit-out rules (``late``, ``ahead``): (starvation bound, decode skip) in
    #: TBTs; None: the policy has none.  ``class_sit_out``: lower-class decodes sit out.
    sit_out: tuple[float, float] | None = None
    class_sit_out: bool = False
    #: The new requests the class reserve held back (rows) and its time (ms); the decodes
    #: the class rescue sat out (rows).
    held: np.ndarray | None = None
    reserve_ms: float = 0.0
    rescued: np.ndarray | None = None
    #: The batch the plan was not in: how many prefills BatchConstructor chose
    #: (``not_chosen``), else the first decode window W_1 in ms (``time_budget``).
    chosen: int | None = None
    window_ms: float | None = None
    #: The verdicts, which come before every rule.
    rejections: Sequence[Rejection] = ()
    preemptions: Sequence[str] = ()


def plan_explained(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
    """``policy.plan(snapshot, predictor)`` with its reasons: a policy whose class sets
    ``explains`` (every registered one) explains from what its decision knew
    (``plan(..., explain=True)``), any other by the post-pass (:func:`explain`)."""
    if getattr(policy, "explains", False):
        return policy.plan(snapshot, predictor, explain=True)  # type: ignore[call-arg]
    return explain(policy, snapshot, predictor, policy.plan(snapshot, predictor))


def reason_counts(reasons: Sequence[Reason]) -> dict[str, int]:
    """Code → how many requests wait for it (``plan.reasons`` of any origin: explained
    here, or decoded from JSON or protobuf), codes in :data:`REASON_CODES` order."""
    if isinstance(reasons, Reasons):
        return reasons.counts()
    n = Counter(r.code for r in reasons)
    return {c: n[c] for c in (*CODES, *sorted(set(n) - set(CODES))) if n[c]}


def explain(policy: Policy, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan) -> Plan:
    """``plan`` (made by ``policy`` for ``snapshot``) with a reason for every request it
    does not fully serve, from the facts the policy's rules give when replayed; the plan is
    otherwise returned as it is.  The reasons are classified when first read (their inputs,
    the snapshot and the plan, are immutable), so a caller that never reads them pays only
    for this call."""
    if len(snapshot) == 0:
        return plan
    reasons = Reasons(snapshot.ids, compute=lambda: _replayed(policy, snapshot, predictor, plan))
    return Plan(plan.policy, plan.policy_version, plan.predictor_version, plan.path, plan.token_budget,
                plan.predicted_latency_ms, plan.allocations, plan.decision_us, plan.breakdown_us, plan.deployment,
                plan.rejections, plan.preemptions, reasons)


def _replayed(policy: Policy, snap: Snapshot, predictor: BatchLatencyPredictor, plan: Plan
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pre_rows, pre_toks = allocated_rows(snap, plan)
    got = reason_tokens(len(snap), _EMPTY, pre_rows, pre_toks)
    if not (got < np.where(snap.is_decoding, 1, snap.remaining_prefill)).any():
        return _EMPTY, np.zeros(0, dtype=np.int8), np.zeros(0)  # nothing waits: no rule to replay
    replay = getattr(policy, "facts", None)  # the hook of the Policy protocol (optional)
    facts = (replay(snap, predictor, plan) if replay is not None else
             Facts(snap.max_batch_tokens, rejections=plan.rejections, preemptions=plan.preemptions))
    return classify(snap, facts, _EMPTY, pre_rows, pre_toks)


def classify(snap: Snapshot, facts: Facts, decodes: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(waiting rows, their code indices, their values) of the plan that gives one token
    to each of ``decodes`` and ``pre_toks[j]`` to row ``pre_rows[j]``, decided with
    ``facts``: the ``reason_codes`` kernel, the first rule that holds for each row."""
    tokens = len(decodes) + int(pre_toks.sum())
    rules, lost_from, lost_mask, marked, verdicts = _rules(snap, facts, tokens)
    if len(decodes) + len(pre_rows) >= snap.max_num_seqs:  # (the fill kernel sees it as it fills)
        _on(rules, "max_num_seqs", snap.max_num_seqs)
    return kernels.ops().reason_codes(snap, decodes, pre_rows, pre_toks, lost_from, lost_mask, marked, verdicts,
                                      rules)


def classify_fill(snap: Snapshot, facts: Facts, cq: CandidateQueue, p1: int
                  ) -> tuple[np.ndarray, np.ndarray, Reasons]:
    """The greedy fill of ``p1`` prompt tokens over ``cq`` (rows, tokens) beside its
    decodes, and the reasons of that plan, in one compiled call (in a decision's wake a
    compiled call's own cost is about that of the classification).  The fill gives all
    ``p1`` tokens (``p1 <= first_cap``, which the queue's supply bounds); whether it
    reaches ``max_num_seqs`` the kernel sees as it fills."""
    assert 0 <= p1 <= cq.first_cap, (p1, cq.first_cap)
    rules, lost_from, lost_mask, marked, verdicts = _rules(snap, facts, len(cq.decodes) + p1)
    pre_rows, pre_toks, *arrays = kernels.ops().fill_reason_codes(snap, cq, p1, cq.decodes, lost_from, lost_mask,
                                                                  marked, verdicts, rules)
    return pre_rows, pre_toks, Reasons(snap.ids, *arrays)


def _rules(snap: Snapshot, f: Facts, tokens: int) -> tuple[np.ndarray, ...]:
    """The kernel's inputs from ``f`` for a plan of ``tokens`` tokens, but the
    ``max_num_seqs`` rule: the rules switched on with their numbers (laid out as
    ``rule_codes.RULE_SCALAR`` says), the lost set, the marked rows, the verdicts.  A hard
    limit that holds for every row (the token budget, KV) closes the policy's own rules."""
    rules = np.zeros(RULES_LEN)
    verdicts = _verdicts(snap, f.rejections, f.preemptions)
    if tokens >= f.budget:
        _on(rules, "token_budget", f.budget)
        return rules, _EMPTY, _NO_MASK, _EMPTY, verdicts
    if snap.free_kv_tokens is not None:
        freed = int(snap.kv_tokens[verdicts[0, verdicts[1] == _C["preempted"]]].sum()) if f.preemptions else 0
        left = (snap.free_kv_tokens + freed - tokens
                - f.kv_decode_reserve * int(np.count_nonzero(snap.is_decoding)))
        if left < 1:
            _on(rules, "kv", left)
            return rules, _EMPTY, _NO_MASK, _EMPTY, verdicts
        if left - f.kv_watermark < 1:  # no new admission; the prefill stream stops at the first new request
            _on(rules, "kv_watermark", f.kv_watermark)
    if f.held is not None:
        _on(rules, "class_reserve", f.reserve_ms)
    if f.given_up:
        _on(rules, "given_up")
    if f.expired:
        _on(rules, "expired")
    if f.rescued is not None:
        _on(rules, "class_rescue", len(f.rescued))
    if f.sit_out is not None:
        _on(rules, "late")
        _on(rules, "ahead")
        rules[RULE_STARVE], rules[RULE_SKIP] = f.sit_out
    if f.class_sit_out:
        _on(rules, "class_sit_out")
    if f.chosen is not None:
        _on(rules, "not_chosen", f.chosen)
    elif f.window_ms is not None:
        _on(rules, "time_budget", f.window_ms)
    marked = [m for m in (f.held, f.rescued) if m is not None]
    return (rules, _EMPTY if f.lost_from is None else f.lost_from, _NO_MASK if f.lost_mask is None else f.lost_mask,
            np.concatenate([_EMPTY, *marked]) if marked else _EMPTY, verdicts)


def _on(rules: np.ndarray, code: str, value: float = 0.0) -> None:
    """Rule ``code`` on, with its own number ``value``."""
    c = _C[code]
    rules[c] = 1.0
    rules[RULE_SCALAR + c] = value


def allocated_rows(snap: Snapshot, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
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


def reserve_ms(snap: Snapshot, predictor: BatchLatencyPredictor) -> float:
    """T̂_dec of the class reserve: the decodes plus the partial prefills, decode-only."""
    partial = np.flatnonzero(~snap.is_decoding & snap.started)
    dec_all = np.flatnonzero(snap.is_decoding)
    k = len(dec_all) + len(partial)
    u = float(snap.kv_tokens[dec_all].sum() + snap.prompt_tokens[partial].sum())
    return float(predictor.model(DECODE).base_ms(k, u)) if k else 0.0
