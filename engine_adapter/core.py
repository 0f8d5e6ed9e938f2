"""The engine-agnostic adapter core that every engine (simulated or vLLM) uses.

One call per iteration: :meth:`AdapterCore.decide` takes the engine's
snapshot and returns a plan that is *safe to execute*:

1. ask the scheduler within a per-iteration deadline, through the small planner
   interface :class:`SchedulerBackend` that is handed to the core: the policy in this
   process (:class:`engine_adapter.inprocess.InProcessBackend`) or the remote service
   (:class:`engine_adapter.remote.GrpcBackend`), so this module depends on neither the server
   nor the client;
2. check the plan against the engine's own limits
   (:func:`scheduler_service.core.plan_violations`): unknown requests,
   budgets, KV, remaining tokens;
3. on a deadline miss, an error or a rejected plan, decide locally with the
   fallback policy and count the reason.

Plans that carry reasons (the service explains one in ``explain_every``, the in-process
planner one in :attr:`AdapterSettings.explain_every`) are read by :class:`ReasonLog`: the
waiting requests counted by reason (``stats()["waiting_by_reason"]``) and, at DEBUG on the
``engine_adapter.reasons`` logger, each request's reason whenever it changes.

After a failure the remote path is skipped for a number of decisions
(doubling up to ``max_backoff_decisions``) so that a dead service costs one
deadline per back-off, not one per iteration; the first success closes the
circuit again.

Measured latencies go to :meth:`AdapterCore.report`, which only appends to a
bounded queue: a background thread ships them in batches and never makes the
engine wait; when the queue is full the oldest reports are dropped and
counted.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Snapshot,
    default_predictor,
    plan_violations,
    registry,
)
from scheduler_service.core.plan import Reasons, Rejection
from scheduler_service.core.reasons import reason_counts
from scheduler_service.recording import Recorder

__all__ = [
    "AdapterCore",
    "AdapterSettings",
    "Decision",
    "IterationSample",
    "ReasonLog",
    "SchedulerBackend",
]

reason_log = logging.getLogger("engine_adapter.reasons")

#: Fallback reasons, as counted in :attr:`AdapterCore.fallbacks`.
REASONS = ("deadline", "error", "invalid_plan", "circuit_open")

#: Upper bounds (s) of :attr:`AdapterCore.decision_counts`: how long the scheduler took to
#: answer, as the engine saw it (remote: the whole round trip, a late answer counted at the
#: deadline it missed; in process: the policy).
DECISION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """How an engine talks to the scheduler.  Every engine adapter builds one
    (the vLLM adapter from environment variables, the simulator from flags)."""

    #: Policy the service runs for this engine ("" = the service's default).
    policy: str = "slidingserve"
    params: Mapping[str, str] = field(default_factory=dict)
    #: Per-iteration deadline for the remote decision.
    deadline_ms: float = 20.0
    #: Local policy used when the remote decision is late, fails or is invalid.
    #: "" means no local policy: :meth:`AdapterCore.decide` returns a decision
    #: without a plan and the engine uses its own native scheduling (vLLM).
    fallback_policy: str = "vllm-fcfs"
    #: Engine profile key (model/hardware/TP) under which reports are pooled.
    profile: str = ""
    engine_id: str = ""
    report_queue: int = 8192
    report_batch: int = 256
    #: Hand each report to the backend inside :meth:`AdapterCore.report`
    #: instead of a background thread.  Only for replays that must be
    #: deterministic (the simulator in-process); a real engine never waits.
    report_inline: bool = False
    #: After a failure the remote path is skipped for this many decisions,
    #: doubling per consecutive failure up to the maximum.  Counted in
    #: decisions, not seconds, so it means the same on a GPU and in the
    #: simulator (whose iterations take microseconds of wall time).
    min_backoff_decisions: int = 1
    max_backoff_decisions: int = 64
    #: The in-process planner explains one plan in this many (0 = never): the plan
    #: carries the reasons why requests wait (:class:`ReasonLog`).  The remote service
    #: has its own knob (server.yaml ``explain_every``).
    explain_every: int = 16
    #: Wait bound under overload (docs/operations.md, "Bounded waits"): a request still
    #: without its first token this many times its TTFT SLO after it arrived becomes
    #: sheddable, so a policy that sheds (slidingserve) rejects it, and the engine finishes it
    #: as aborted with reason ``wait_bound``, instead of letting it wait behind every live
    #: request for as long as the overload lasts.  0 = off (nothing is rejected that the
    #: client did not mark sheddable).
    shed_after: float = 0.0
    #: Directory of a traffic recording (:mod:`scheduler_service.recording`, for
    #: ``slidingserve whatif``); "" = none.  A remote engine's service can record instead
    #: (server.yaml ``record``).
    record: str = ""
    #: Bound on the recording's size on disk (MiB); the oldest files go first.
    record_max_mb: int = 256


@dataclass(frozen=True, slots=True)
class IterationSample:
    """One executed iteration: per-request tokens c, KV tokens u, measured time."""

    c: np.ndarray
    u: np.ndarray
    latency_ms: float


class SchedulerBackend(Protocol):
    """The planner interface: what :class:`AdapterCore` needs from a scheduler."""

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan: ...

    def report(self, samples: Sequence[IterationSample]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Decision:
    #: None only on a fallback with ``fallback_policy=""`` (the engine schedules natively).
    plan: Plan | None
    #: "remote" when the scheduler's plan is executed, else "fallback".
    source: str
    #: Why the fallback was used ("" for remote decisions).
    reason: str = ""
    #: Wall time the engine spent in :meth:`AdapterCore.decide`.
    elapsed_us: int = 0


class ReasonLog:
    """What the explained plans say: ``counts`` (code → waiting requests) of the latest
    plan that carried reasons, and, when DEBUG is on for ``engine_adapter.reasons``, one
    line per request whenever its reason changes (``grep <id>`` shows its history); the
    ids of finished requests (gone from the snapshot) are forgotten.

    A service set to ``reasons: every`` puts reasons in every plan; reading them stays off
    the engine's hot path: the counts of a :class:`Reasons` (compact or computed here)
    are one ``bincount`` over its code array, no object per request, and only one plan in
    ``count_every`` is counted (``counts`` is a gauge: the latest counted plan's); the
    per-request objects are built only while DEBUG is on."""

    def __init__(self, count_every: int = 1) -> None:
        self.counts: dict[str, int] = {}
        self.explained = 0
        self.count_every = max(1, count_every)
        self._last: dict[str, str] = {}  # request id -> its last code

    @staticmethod
    def carries(plan: Plan) -> bool:
        """Whether ``plan`` was explained: reasons computed here or received (even none)."""
        return isinstance(plan.reasons, Reasons) or bool(plan.reasons)

    def observe(self, snapshot: Snapshot, plan: Plan) -> None:
        self.explained += 1
        debug = reason_log.isEnabledFor(logging.DEBUG)
        if self.explained % self.count_every and not debug:
            return
        self.counts = reason_counts(plan.reasons)
        if not debug:
            if self._last:
                self._last.clear()
            return
        now = {r.id: r for r in plan.reasons}
        live = set(snapshot.ids)
        last = self._last
        for rid in [rid for rid in last if rid not in now]:
            if rid in live:
                reason_log.debug("slidingserve: request %s served (was %s)", rid, last[rid])
            del last[rid]
        for rid, r in now.items():
            if last.get(rid) != r.code:
                reason_log.debug("slidingserve: request %s waits: %s (%g)", rid, r.code, r.value)
                last[rid] = r.code


class AdapterCore:
    def __init__(self, backend: SchedulerBackend, settings: AdapterSettings,
                 fallback_predictor: BatchLatencyPredictor | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self._fallback = registry.create(settings.fallback_policy) if settings.fallback_policy else None
        self._fallback_predictor = fallback_predictor or default_predictor()
        self.remote_decisions = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.last_error = ""
        self._skip = 0
        self._backoff = settings.min_backoff_decisions
        self.reasons = ReasonLog()
        #: scheduler answers by time taken (:data:`DECISION_BUCKETS`, then one for longer), and their sum (s)
        self.decision_counts = [0] * (len(DECISION_BUCKETS) + 1)
        self.decision_seconds = 0.0
        # reports
        self._reports: collections.deque[IterationSample] = collections.deque(maxlen=settings.report_queue)
        self.reports_dropped = 0
        self.reports_sent = 0
        self.report_errors = 0
        self._cv = threading.Condition()
        self._closed = False
        self._sending = False
        self._thread = threading.Thread(target=self._ship_reports, name="adapter-reports", daemon=True)
        self._thread.start()
        self.recorder: Recorder | None = None
        if settings.record:
            self.recorder = Recorder.within(settings.record, settings.record_max_mb, source="engine",
                                            inline=settings.report_inline)

    def record(self, snapshot: Snapshot, policy: str = "", params: Mapping[str, str] | None = None) -> None:
        """Hand ``snapshot`` to the recording, if one is kept (decided by ``policy``: by
        default the settings' policy)."""
        if self.recorder is not None:
            s = self.settings
            self.recorder.offer(snapshot, s.engine_id, policy or s.policy, s.params if params is None else params)

    # ------------------------------------------------------------- decisions
    def decide(self, snapshot: Snapshot, grace_s: float = 0.0) -> Decision:
        """Ask the scheduler, within the deadline plus ``grace_s``: a decision taken ahead,
        while the engine's running step still has ``grace_s`` to go (the pipelined adapter),
        is late only once the engine needs it, not a deadline after it was asked."""
        rec = self.recorder
        if rec is None:
            return self._decide(snapshot, grace_s)
        self.record(snapshot)
        return rec.while_deciding(self._decide, snapshot, grace_s)

    def _decide(self, snapshot: Snapshot, grace_s: float) -> Decision:
        t0 = time.perf_counter()
        overdue: frozenset[str] = frozenset()
        if self.settings.shed_after > 0:
            snapshot, overdue = mark_overdue(snapshot, self.settings.shed_after)
        reason = ""
        if self._skip > 0:
            self._skip -= 1
            reason = "circuit_open"
        else:
            try:
                plan = self.backend.schedule(snapshot, self.settings.deadline_ms / 1e3 + max(0.0, grace_s))
            except Exception as e:  # every remote failure mode ends in the fallback
                self._timed(time.perf_counter() - t0)
                reason = _classify(e)
                self.last_error = f"{type(e).__name__}: {e}"
            else:
                self._timed(time.perf_counter() - t0)
                problems = plan_violations(snapshot, plan)
                if not problems:
                    self.remote_decisions += 1
                    if ReasonLog.carries(plan):
                        self.reasons.observe(snapshot, plan)
                    self._backoff = self.settings.min_backoff_decisions
                    if overdue and plan.rejections:
                        plan = _wait_bound(plan, overdue)
                    return Decision(plan, "remote", "", int((time.perf_counter() - t0) * 1e6))
                reason = "invalid_plan"
                self.last_error = "; ".join(problems[:3])
            if reason != "invalid_plan":
                self._skip = self._backoff
                self._backoff = min(self._backoff * 2, self.settings.max_backoff_decisions)
        self.fallbacks[reason] += 1
        if self._fallback is None:
            return Decision(None, "fallback", reason, int((time.perf_counter() - t0) * 1e6))
        plan = self._fallback.plan(snapshot, self._fallback_predictor)
        return Decision(plan, "fallback", reason, int((time.perf_counter() - t0) * 1e6))

    def _timed(self, seconds: float) -> None:
        self.decision_counts[bisect.bisect_left(DECISION_BUCKETS, seconds)] += 1
        self.decision_seconds += seconds

    @property
    def fallback_total(self) -> int:
        return sum(self.fallbacks.values())

    # --------------------------------------------------------------- reports
    def report(self, sample: IterationSample) -> None:
        """Queue one measured iteration; never blocks on the network."""
        if self.recorder is not None:
            self.recorder.offer_batch(self.settings.engine_id, sample.c, sample.u, sample.latency_ms)
        if self.settings.report_inline:
            self.backend.report([sample])
            self.reports_sent += 1
            return
        with self._cv:
            if len(self._reports) == self._reports.maxlen:
                self.reports_dropped += 1
            self._reports.append(sample)
            if len(self._reports) >= self.settings.report_batch:
                self._cv.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued report has been handed to the backend."""
        end = time.monotonic() + timeout
        with self._cv:
            self._cv.notify()
            while self._reports or self._sending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
                self._cv.notify()
        return True

    def _ship_reports(self) -> None:
        while True:
            with self._cv:
                while not self._reports and not self._closed:
                    self._cv.wait(0.5)
                if self._closed and not self._reports:
                    return
                batch = [self._reports.popleft()
                         for _ in range(min(len(self._reports), self.settings.report_batch))]
                self._sending = True
            try:
                self.backend.report(batch)
                self.reports_sent += len(batch)
            except Exception:
                # the batch is lost (reports are best-effort): count every report in it
                self.report_errors += 1
                self.reports_dropped += len(batch)
                time.sleep(0.1)
            finally:
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        return {
            "remote_decisions": self.remote_decisions,
            "fallbacks": dict(self.fallbacks),
            "reports_sent": self.reports_sent,
            "reports_dropped": self.reports_dropped,
            "report_errors": self.report_errors,
            "last_error": self.last_error,
            "waiting_by_reason": dict(self.reasons.counts),
            "explained_plans": self.reasons.explained,
            "decision_counts": list(self.decision_counts),
            "decision_seconds": self.decision_seconds,
            **({"recording": self.recorder.stats()} if self.recorder is not None else {}),
        }

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        if self.recorder is not None:
            self.recorder.close()
        self.backend.close()


def mark_overdue(snapshot: Snapshot, factor: float) -> tuple[Snapshot, frozenset[str]]:
    """``snapshot`` with the requests still waiting for their first token ``factor`` times
    their TTFT SLO after they arrived marked sheddable (:attr:`AdapterSettings.shed_after`),
    and the ids of those it marked (not those the client marked itself)."""
    late = (snapshot.output_tokens == 0) & ~snapshot.sheddable & (snapshot.now - snapshot.arrival >= factor * snapshot.ttft_slo)
    if not late.any():
        return snapshot, frozenset()
    marked = frozenset(snapshot.ids[i] for i in np.flatnonzero(late).tolist())
    return replace(snapshot, sheddable=snapshot.sheddable | late), marked


def _wait_bound(plan: Plan, overdue: frozenset[str]) -> Plan:
    """``plan`` with its rejections of the ``overdue`` requests (which only the wait bound
    made sheddable) giving that reason."""
    return replace(plan, rejections=tuple(Rejection(r.id, "wait_bound") if r.id in overdue else r
                                          for r in plan.rejections))


def _classify(e: Exception) -> str:
    """"deadline" for a late answer (a slow service), "error" for the rest."""
    code = getattr(e, "code", None)
    if getattr(code, "name", "") == "DEADLINE_EXCEEDED" or isinstance(e, TimeoutError):
        return "deadline"
    return "error"
