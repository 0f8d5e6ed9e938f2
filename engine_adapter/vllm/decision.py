"""The vLLM adapter's decision for one iteration, as pure functions (no vLLM import).

Given the snapshot builder's output (:class:`.fit.View`) and the adapter core's answer
(:class:`~engine_adapter.core.Decision`: the service's checked plan, or why there is none),
the adapter either executes a plan or leaves the iteration to vLLM's native scheduling
for a named reason.  That choice is a typed record, :class:`Outcome`; the scheduler class
only reads vLLM's state into the arguments and carries the outcome out.

It comes in two steps because a plan may ask vLLM to act before it schedules:

1. :func:`read_answer`: the decision → an :class:`Answer` (the plan's allocations, the
   requests it rejects and preempts, its predicted step time), or the fallback
   :class:`Outcome` when the core has no plan (``deadline``, ``error``, ``invalid_plan``,
   ``circuit_open``);
2. the scheduler finishes the rejected requests and preempts the listed ones (vLLM's
   calls), then :func:`fit_answer`: the allocations as vLLM can execute them on the view
   and vLLM's KV and admission state (:func:`.fit.fit_plan`), or the fallback
   (``empty_plan``: the plan allocates nothing; ``unallocatable``: the running requests
   need more KV blocks than are free, or vLLM would admit none of the planned requests).

:func:`settle` is both steps with nothing carried out between them.  A decision taken in
the background takes both there too (:func:`prepare`), on the KV state its projected view
carries (:attr:`.fit.View.kv`); the engine thread then only checks that the fit still
stands (:func:`reuse`): a plan that fit whole on that state fits whole on a looser one, less
the requests finished meanwhile.  The checks before
an answer exists (``unsupported``, ``kv_pressure``, ``snapshot_error``) are one line each
in the scheduler; :func:`fallback` makes their outcome.  While vLLM executes a plan, :func:`cap`
gives each request's token count (vLLM's per-request hooks call it).
Tests: tests/test_adapter_decision.py.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from engine_adapter.core import Decision
from scheduler_service.core import Rejection

from .fit import Fit, KvRules, View, fit_plan

__all__ = ["Answer", "Outcome", "Prepared", "cap", "fallback", "fit_answer", "prepare", "read_answer", "reuse",
           "settle"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one iteration does: execute ``fit`` or, when it is None, let vLLM schedule
    natively (for ``reason``; "" when there was nothing to decide)."""

    #: the plan as vLLM can execute it (request id → tokens, the queues' order)
    fit: Fit | None = None
    #: why vLLM schedules natively: a core reason (``deadline``, ``error``, ``invalid_plan``,
    #: ``circuit_open``) or a local one (:data:`.stats.LOCAL_REASONS`)
    reason: str = ""
    detail: str = ""
    #: running chunks shrunk and admissions dropped to fit vLLM (counted also on a fallback)
    trimmed: int = 0
    #: when the next iteration starts, as the executed plan predicts (s)
    ahead_s: float = 0.0

    @property
    def native(self) -> bool:
        return self.fit is None


@dataclass(frozen=True, slots=True)
class Answer:
    """A plan as the adapter reads it, before vLLM's KV and admission rules are applied."""

    #: request id → tokens (plan order)
    allocations: dict[str, int]
    #: requests to finish (overload control) and to preempt before vLLM schedules
    rejections: tuple[Rejection, ...] = ()
    preemptions: tuple[str, ...] = ()
    #: the plan's predicted step time (s) and the policy path that chose it
    ahead_s: float = 0.0
    path: str = ""


def fallback(reason: str, detail: str = "") -> Outcome:
    """vLLM's native scheduling this iteration, for ``reason``."""
    return Outcome(None, reason, detail)


def read_answer(decision: Decision, last_error: str = "") -> Answer | Outcome:
    """The core's decision → the plan's :class:`Answer`, or the fallback :class:`Outcome`
    when there is no plan (the core's reason; ``last_error``: its detail)."""
    plan = decision.plan
    if plan is None:
        return fallback(decision.reason or "error", last_error)
    return Answer(plan.tokens_by_id(), tuple(plan.rejections), tuple(plan.preemptions),
                  plan.predicted_latency_ms / 1e3, plan.path)


def fit_answer(answer: Answer, view: View, kv: KvRules, finished: Collection[str] = ()) -> Outcome:
    """``answer``'s allocations as vLLM can execute them on ``view`` with ``kv`` (vLLM's KV
    and admission state after the answer's rejections and preemptions); ``finished``: the
    requests finished since the view was taken.  A fallback when nothing can be executed."""
    if not answer.allocations:
        return fallback("empty_plan", f"policy path {answer.path!r} schedules nothing")
    fit = fit_plan(view, answer.allocations, kv, finished)
    if fit.why:
        return fallback("unallocatable", fit.why)  # nothing is executed: nothing trimmed
    if not fit.plan:  # finished meanwhile, or vLLM would admit none of them: vLLM decides
        return Outcome(None, "unallocatable", "no planned request fits vLLM's admission rules", fit.trimmed)
    return Outcome(fit, trimmed=fit.trimmed, ahead_s=answer.ahead_s)


def settle(view: View, decision: Decision, kv: KvRules, finished: Collection[str] = (),
           last_error: str = "") -> Outcome:
    """:func:`read_answer` then :func:`fit_answer`, with nothing carried out between them."""
    answer = read_answer(decision, last_error)
    if isinstance(answer, Outcome):
        return answer
    return fit_answer(answer, view, kv, finished)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A decision's :class:`Answer` and its fit, taken where the decision was (in the
    background), on the KV state ``kv`` of the view it was taken on."""

    answer: Answer
    outcome: Outcome
    kv: KvRules


def prepare(view: View, decision: Decision) -> Prepared | None:
    """:func:`read_answer` and :func:`fit_answer` on ``view``'s KV state, ahead of the
    iteration; None when there is nothing to prepare: no plan, no KV state read with the
    view, or a plan that rejects or preempts (carried out on the engine thread first)."""
    if decision.plan is None or view.kv is None or decision.plan.rejections or decision.plan.preemptions:
        return None
    answer = read_answer(decision)
    assert isinstance(answer, Answer)
    return Prepared(answer, fit_answer(answer, view, view.kv), view.kv)


def reuse(prepared: Prepared, kv: KvRules, finished: Collection[str] = ()) -> Outcome | None:
    """``prepared``'s outcome as :func:`fit_answer` would give it now on the view, with
    vLLM's state ``kv`` and the requests ``finished`` since the view was taken (prefix hits
    only grow meanwhile: nothing allocates blocks between steps); None when that takes a
    fit: the prepared one trimmed or fell back, ``kv`` is tighter than the view's in some
    way, or nothing is left once the finished requests are dropped.  A fit that took the
    whole plan on the tighter state takes it on the looser one: the same plan, less the
    finished requests (which only free blocks)."""
    out, then = prepared.outcome, prepared.kv
    fit = out.fit
    if (fit is None or out.trimmed or kv.free_blocks < then.free_blocks or kv.slots < then.slots
            or kv.watermark > then.watermark or (kv.block_size, kv.lookahead, kv.full_isl)
            != (then.block_size, then.lookahead, then.full_isl)):
        return None
    gone = [k for k in fit.plan if k in finished] if finished else ()
    if not gone:
        return out
    if len(gone) == len(fit.plan):
        return None
    kept = Fit({k: v for k, v in fit.plan.items() if k not in finished},
               [r for r in fit.run_order if r.request_id not in finished],
               [r for r in fit.admit if r.request_id not in finished])
    return Outcome(kept, ahead_s=out.ahead_s)


def cap(plan: Mapping[str, int] | None, blocked: Collection[str], request: Any, n: int, computed: int) -> int:
    """The tokens vLLM may schedule for ``request`` (``n``: what vLLM would, ``computed``: its
    tokens in KV with this step's prefix hit) while it executes ``plan`` (None: natively, all
    ``n``): the plan's allocation, none for a request the plan leaves out unless it is one of
    the ``blocked`` ids the view left out (vLLM promoted it during this step: vLLM's to
    schedule), and all of a decode's tokens (with its speculative ones: all-or-nothing)."""
    if plan is None:
        return n
    want = plan.get(request.request_id)
    if want is None:
        return n if request.request_id in blocked else 0
    if want >= n or computed >= request.num_tokens - 1:
        return n  # within the plan, or a decode (with any spec tokens): all-or-nothing
    return want
