"""Pipelining: the next iteration's decision taken in the background (no vLLM import).

:class:`Pipeline` holds the decision in flight (:class:`Pending`), the requests that
arrived since its snapshot and the background thread.  The scheduler starts a decision
at the end of ``schedule()`` (:meth:`Pipeline.start`) and collects it in the next one
(:meth:`Pipeline.collect`), which keeps it unless :func:`is_stale` says that what
happened meanwhile could change the plan enough to decide again.  vLLM's request
states come in through :class:`Statuses`, so that this module and its tests
(tests/test_vllm_pipeline.py) do not need vLLM.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from engine_adapter.core import AdapterCore, Decision
from scheduler_service.core import Plan, Snapshot

from .decision import Prepared, prepare
from .fit import View
from .stats import AdapterStats

__all__ = ["MAX_GRACE_S", "CoreSource", "Pending", "Pipeline", "Ready", "Statuses", "is_stale",
           "room_for_arrivals"]

#: The most a decision taken ahead may add to the deadline (the running step's predicted
#: time, :attr:`Pipeline.ahead_s`): a wild prediction must not let the engine wait long.
MAX_GRACE_S = 0.5

_status_of = operator.attrgetter("status")


@dataclass(frozen=True, slots=True)
class Statuses:
    """How to read a request's ``status`` (vLLM's ``RequestStatus``)."""

    running: Any
    #: waiting for admission (new or preempted)
    waiting: Set[Any]
    is_finished: Callable[[Any], bool]


class CoreSource(Protocol):
    """Where the pipeline gets the core to decide with (:class:`.live.LiveCore`)."""

    @property
    def settings(self) -> Any: ...

    def get(self) -> AdapterCore: ...


class Ready(NamedTuple):
    """A decision taken in the background: the view, the decision on it, and its answer
    read and fitted on the view's KV state (:func:`.decision.prepare`; None: not prepared)."""

    view: View
    decision: Decision
    prepared: Prepared | None


@dataclass(slots=True)
class Pending:
    """A decision for the next iteration, taken in the background."""

    #: the snapshot and the decision on it; None when no snapshot could be taken
    future: concurrent.futures.Future[Ready | None]
    core: AdapterCore
    #: set once the job has read vLLM's queues: until then they must not change
    #: (``update_from_output`` waits for it; with a synchronous engine the job
    #: reads them in the background while the GPU step runs)
    snapped: threading.Event


def room_for_arrivals(plan: Plan, snap: Snapshot, arrivals: Sequence[Any], waiting: Set[Any],
                      max_tokens: int, max_seqs: int) -> bool:
    """Whether requests that arrived after the plan's snapshot could have been given
    something: the plan serves every request it knew of and leaves tokens and sequence
    slots unused, and some arrival still waits (status in ``waiting``).  (A plan that
    leaves known requests waiting chose its budget — e.g. for the TBT of running decodes —
    and would leave the arrivals waiting too; they are in the next plan.)"""
    return (len(plan.allocations) == len(snap)
            and plan.token_budget < max_tokens
            and len(plan.allocations) < max_seqs
            and any(r.status in waiting for r in arrivals))


def is_stale(view: View, plan: Plan, statuses: Statuses, *, finished_since: bool, arrivals: Sequence[Any],
             max_tokens: int, max_seqs: int) -> bool:
    """Whether what happened since ``view`` was taken could change ``plan`` enough to decide
    again: the projection broke (a running request changed state outside ``schedule()``,
    e.g. a KV-connector failure or a test preempting by hand), KV was tight and requests
    finished since (``finished_since``) freed some, or ``arrivals`` could use room the plan
    left.  Otherwise the plan stands (finished requests are dropped from it)."""
    rr = view.running_rows
    states = list(map(_status_of, view.rows[:rr]))
    running = states.count(statuses.running)
    if running != rr and running + sum(map(statuses.is_finished, states)) != rr:
        return True
    free = view.snap.free_kv_tokens
    if finished_since and free is not None and free < max_tokens:
        return True
    return bool(arrivals) and room_for_arrivals(plan, view.snap, arrivals, statuses.waiting, max_tokens, max_seqs)


class Pipeline:
    """The decision in flight and what it needs; counts into ``stats`` (``wait_us``,
    ``snap_wait_us``, ``pipelined``, ``resyncs``).  ``max_tokens``/``max_seqs``: the
    engine's token budget and sequence limit per iteration."""

    def __init__(self, stats: AdapterStats, statuses: Statuses, max_tokens: int, max_seqs: int) -> None:
        self.stats = stats
        self.statuses = statuses
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.pending: Pending | None = None
        #: requests added since the pending decision's snapshot
        self.arrivals: list[Any] = []
        #: when the next iteration will start, as the last executed plan predicts
        self.ahead_s = 0.0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def take(self) -> Pending | None:
        """The decision in flight, if any; none is in flight afterwards."""
        pending, self.pending = self.pending, None
        return pending

    def arrived(self, request: Any) -> None:
        if self.pending is not None:
            self.arrivals.append(request)

    def ahead(self, live: CoreSource, take_view: Callable[[str, float], View], *, project_now: bool) -> None:
        """Start the next iteration's decision (called at the end of ``schedule()``, with work
        queued) on the queues as the next ``schedule()`` will find them, with ``live``'s core
        after applying a changed settings file (nothing is in flight: a swap is safe here);
        nothing when its settings turn pipelining off.  ``take_view(project, ahead_s)``:
        the projected view; ``project_now``: take it here (async scheduling, where vLLM
        applies the running step's output right after this call), else in the background."""
        core = live.get()
        if not live.settings.pipeline:
            return
        ahead_s = self.ahead_s
        # the plan is needed when the running step ends, about ahead_s from now: the
        # deadline counts from then (a service answering in 25 ms during a 40 ms step is
        # on time; counted from the call, it was late and the engine scheduled natively)
        grace_s = min(max(ahead_s, 0.0), MAX_GRACE_S)
        if not project_now:
            self.start(core, take_view=lambda: take_view("sync", ahead_s), grace_s=grace_s)
            return
        try:
            view = take_view("async", ahead_s)
        except Exception:
            return  # the next schedule() decides synchronously and counts the error
        if len(view.snap):
            self.start(core, view=view, grace_s=grace_s)

    def start(self, core: AdapterCore, *, view: View | None = None,
              take_view: Callable[[], View] | None = None, grace_s: float = 0.0) -> None:
        """Decide on ``view`` in the background, or on the view ``take_view`` takes there
        (an error, or an empty snapshot, leaves nothing to collect), within the core's
        deadline plus ``grace_s`` (the time left until the engine needs the plan)."""
        ex = self._executor
        if ex is None:  # created on first use: after vLLM forks the engine process
            ex = self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slidingserve-decide")
        snapped = threading.Event()

        def job() -> Ready | None:
            v = view
            try:
                if v is None and take_view is not None:
                    v = take_view()
            except Exception:
                v = None  # the next schedule() decides synchronously and counts the error
            finally:
                snapped.set()
            if v is None or len(v.snap) == 0:
                return None
            decision = core.decide(v.snap, grace_s)  # its plan check builds v.snap.index_of, here
            return Ready(v, decision, prepare(v, decision))

        if view is not None:
            snapped.set()
        self.pending = Pending(ex.submit(job), core, snapped)

    def collect(self, pending: Pending, *, finished_since: bool) -> Ready | None:
        """``pending``'s view and decision when its plan stands (:func:`is_stale`), None when
        the iteration must decide on the queues as they are now.  Raises what the job raised."""
        t = time.perf_counter()
        done = pending.future.result()  # bounded: the backend has the deadline
        c = self.stats.counts
        c["wait_us"] += int((time.perf_counter() - t) * 1e6)
        if done is None:
            return None
        view, decision, _ = done
        if decision.plan is not None and is_stale(
                view, decision.plan, self.statuses, finished_since=finished_since, arrivals=self.arrivals,
                max_tokens=self.max_tokens, max_seqs=self.max_seqs):
            c["resyncs"] += 1
            return None
        c["pipelined"] += 1
        return done

    def quiesce(self) -> None:
        """Wait until a background job has finished reading vLLM's queues; called before
        anything changes them (output, aborts, arrivals)."""
        pending = self.pending
        if pending is not None and not pending.snapped.is_set():
            t0 = time.perf_counter()
            pending.snapped.wait()
            self.stats.counts["snap_wait_us"] += int((time.perf_counter() - t0) * 1e6)

    def close(self) -> None:
        self.pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
