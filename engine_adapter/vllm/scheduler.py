"""vLLM scheduler classes (0.32 and 0.33, see :mod:`.compat`) that execute the scheduling service's plans.

How a plan is executed: vLLM's own ``schedule()`` still does all the work
(KV slot allocation, preemption, prefix caching, encoder inputs, the
``SchedulerOutput``), so every vLLM invariant holds.  The adapter only

1. orders ``self.running`` by the plan (stable; unplanned requests last, so
   they are the first preemption victims) and puts only the planned waiting
   requests, in plan order, into the FCFS ``self.waiting`` queue for the call
   (hiding the others saves vLLM a prefix-cache lookup per unplanned request);
2. caps every request's token count at its allocation through the per-request
   hooks vLLM calls on the way (``_mamba_block_aligned_split``,
   ``_try_schedule_encoder_inputs``, ``_reserve_prefill_lookahead``); a decode
   the plan schedules is all-or-nothing (spec-decode tokens stay intact);
3. restores vLLM's queue order afterwards, so an iteration that falls back
   behaves exactly like stock vLLM.

Before that, the plan is checked (``plan_violations``, in the adapter core)
and matched against vLLM's KV rules: a plan whose running requests need more
KV blocks than are free (vLLM would have to preempt), a deadline miss or an
error means ``_plan = None`` for this iteration, which is stock vLLM
behaviour.  Admission control stays vLLM's: waiting requests the plan admits
but vLLM would refuse (no sequence slot, whole prompt does not fit, watermark)
are dropped from the plan and counted (``trimmed_admissions``).  The reason is counted (:meth:`slidingserve_stats`) and
logged at most once per ``log_every``.  After ``super().schedule()`` the
scheduled tokens are compared with the plan and deviations counted.

Pipelining (``SLIDINGSERVE_PIPELINE``, on by default): the decision for the
next iteration is taken while the current one runs on the GPU.  Right after
``super().schedule()`` returns, vLLM has already advanced every scheduled
request's ``num_computed_tokens``; the adapter snapshots the queues as the
next ``schedule()`` will find them (a request that samples in the running step
counts as one in-flight token, as async scheduling books it) and hands the
snapshot to a background thread that asks the service (or the in-process
policy; a gRPC wait releases the GIL).  The next ``schedule()`` only collects
that plan and reconciles it with what happened meanwhile: requests that
finished in ``update_from_output`` (EOS, stop strings) are dropped from it; when
requests arrived since the snapshot and the plan leaves room (tokens or
sequence slots), the plan is taken again synchronously on the queues as they
are — the case of a lightly loaded engine, where queues and so decisions are
small — otherwise the arrivals are in the next plan.  With async
scheduling vLLM already calls ``schedule()`` for step k+1 while step k runs, so
even the synchronous path overlaps GPU work; pipelining also takes the
decision off that call.  When there is no plan in flight (first iteration,
after idling, pipelining off) the decision is taken synchronously.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import operator
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import vllm

from .compat import check_vllm_version
from .observe import MetricsEndpoint, attach_log_handler

# Before vLLM's internals are imported: on a version the adapter does not support they
# may not import, or import and break later; fail here with one line naming the versions.
attach_log_handler(fallback=False)  # vLLM's handlers if it has configured logging already
check_vllm_version(vllm.__version__)

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from engine_adapter.core import AdapterCore, AdapterSettings, Decision, IterationSample  # noqa: E402
from engine_adapter.inprocess import InProcessBackend  # noqa: E402
from engine_adapter.remote import GrpcBackend  # noqa: E402
from scheduler_service.core import Plan, Rejection, Snapshot, default_predictor  # noqa: E402
from scheduler_service.server.predictors import PredictorRegistry, RefitSettings  # noqa: E402

from .fit import Fit, KvRules, decodes_needing_block, execution_order, fit_plan  # noqa: E402
from .fit import View as _View  # noqa: E402
from .settings import (  # noqa: E402
    FOLLOW_DEFAULT,
    SettingsError,
    SettingsWatcher,
    VllmAdapterSettings,
    default_engine_id,
    parse_slo_classes,
)
from .snapshot import SloDefaults, SnapshotBuilder  # noqa: E402

__all__ = ["RemoteScheduler", "RemoteSyncScheduler", "SlidingServeMixin", "build_core"]

log = logging.getLogger("engine_adapter.vllm")

#: Request states a plan may name; the others (waiting for remote KV, a grammar,
#: streaming input) are vLLM's to promote.
_SCHEDULABLE = frozenset((RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING))

_status_of = operator.attrgetter("status")
_WAITING = frozenset((RequestStatus.WAITING, RequestStatus.PREEMPTED))


@dataclass(slots=True)
class _Pending:
    """A decision for the next iteration, taken in the background."""

    #: the snapshot and the decision on it; None when no snapshot could be taken
    future: concurrent.futures.Future[tuple[_View, Decision] | None]
    core: AdapterCore
    #: set once the job has read vLLM's queues: until then they must not change
    #: (``update_from_output`` waits for it; with a synchronous engine the job
    #: reads them in the background while the GPU step runs)
    snapped: threading.Event

#: Reasons counted besides AdapterCore's (deadline, error, invalid_plan, circuit_open).
LOCAL_REASONS = ("kv_pressure", "empty_plan", "unallocatable", "snapshot_error", "unsupported")


def _channel_factory(s: VllmAdapterSettings) -> Any:
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # find a restarted service within about a second, not gRPC's default 120 s
        ("grpc.initial_reconnect_backoff_ms", min(100, s.reconnect_max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, s.reconnect_max_ms)),
        ("grpc.max_reconnect_backoff_ms", s.reconnect_max_ms),
        # several replicas behind one name: streams spread over them (see scheduler_service/client.py)
        ("grpc.lb_policy_name", "round_robin"),
    ]

    def make() -> Any:
        if not s.tls:
            return grpc.insecure_channel(s.address, options=options)

        def read(p: str) -> bytes | None:
            if not p:
                return None
            with open(p, "rb") as fh:
                return fh.read()

        creds = grpc.ssl_channel_credentials(read(s.tls_ca), read(s.tls_key), read(s.tls_cert))
        return grpc.secure_channel(s.address, creds, options=options)

    return make


def build_core(s: VllmAdapterSettings, profile: str, predictors: PredictorRegistry | None = None) -> AdapterCore:
    """An :class:`AdapterCore` whose fallback is "no plan" (vLLM's native scheduling);
    in process, learning into ``predictors`` when given (it outlives the core)."""
    a = AdapterSettings(
        policy="" if s.policy == FOLLOW_DEFAULT else s.policy, params=dict(s.params), deadline_ms=s.deadline_ms, fallback_policy="",
        profile=profile, engine_id=s.engine_id or default_engine_id(), report_batch=s.report_batch,
        max_backoff_decisions=s.max_backoff_decisions,
    )
    backend: Any
    if s.address == "inproc":
        backend = InProcessBackend(a, predictors=predictors)
    else:
        backend = GrpcBackend(s.address, a, channel_factory=_channel_factory(s), security=s.client_security())
    return AdapterCore(backend, a)


def detect_profile(vllm_config: Any, s: VllmAdapterSettings) -> str:
    """``model|hardware|tp<N>``: the settings' values, else vLLM's config and platform.

    The hardware name comes from vLLM's platform layer (NVML on CUDA), which does
    not create a CUDA context in the EngineCore process."""
    model = s.profile_model
    if not model:
        mc = vllm_config.model_config
        name = getattr(mc, "served_model_name", None) or mc.model
        if isinstance(name, list | tuple):
            name = name[0]
        model = os.path.basename(str(name).rstrip("/")) or str(name)
    hw = s.profile_hardware
    if not hw:
        try:
            from vllm.platforms import current_platform  # lazy: resolving it probes the device

            hw = str(current_platform.get_device_name())
        except Exception:
            hw = ""
        hw = hw or "unknown"
    tp = s.profile_tp or int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    clean = [x.replace("|", "-").strip().replace(" ", "-")[:128] for x in (model, hw)]
    return f"{clean[0]}|{clean[1]}|tp{tp}"


class SlidingServeMixin:
    """The shared implementation; mixed into vLLM's ``Scheduler``/``AsyncScheduler``."""

    # vLLM attributes this mixin uses (set by Scheduler.__init__)
    running: list[Any]
    waiting: Any
    kv_holding_waiting: Any
    requests: dict[str, Any]
    kv_cache_manager: Any
    block_size: int
    max_num_scheduled_tokens: int
    max_num_running_reqs: int
    max_num_active_reqs: int
    num_lookahead_tokens: int
    #: requests freed since the last schedule() (vLLM resets it at the end of schedule())
    finished_req_ids: set[str]
    policy: Any
    vllm_config: Any

    #: Test hooks: settings from this mapping instead of ``os.environ``, and the
    #: clock that times iterations (a simulated clock makes reports deterministic).
    slidingserve_env: Any = None
    slidingserve_clock: Any = staticmethod(time.perf_counter)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        attach_log_handler()  # vLLM configures only its own logger: ours would print nothing
        check_vllm_version(vllm.__version__, self.slidingserve_env)  # raises VllmVersionError
        super().__init__(*args, **kwargs)
        self._plan: dict[str, int] | None = None
        self._ss_hidden = 0
        self._ss_blocked: set[str] = set()
        # pipelining: the decision in flight and the arrivals since its snapshot
        self._ss_pending: _Pending | None = None
        self._ss_arrivals: list[Any] = []
        self._ss_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._ss_ahead_s = 0.0
        self._ss_inner = 0.0  # seconds in vLLM's own schedule() during the last call
        self._ss_async = isinstance(self, AsyncScheduler)
        base = VllmAdapterSettings.from_env(self.slidingserve_env, apply_file=False)
        self._ss_watcher = SettingsWatcher(base)  # raises SettingsError on a bad file at start
        self._ss_settings = self._ss_watcher.current
        self._ss_profile = detect_profile(self.vllm_config, self._ss_settings)
        self._ss_builder = SnapshotBuilder(self._slo_defaults(self._ss_settings), self._ss_profile)
        self._ss_core: AdapterCore | None = None  # created on first schedule(): after vLLM forks
        self._ss_predictors: PredictorRegistry | None = None  # likewise (its refit thread)
        self._ss_unsupported = ""
        if self.policy != SchedulingPolicy.FCFS:
            self._ss_unsupported = f"scheduling policy {self.policy.name} (only fcfs)"
        elif not isinstance(self.waiting, FCFSRequestQueue):
            self._ss_unsupported = "waiting queue is not FCFS"
        if self._ss_unsupported:
            log.warning("slidingserve: %s; vLLM schedules natively", self._ss_unsupported)
        # counters
        self._ss_counts: collections.Counter[str] = collections.Counter()
        self._ss_fallbacks: collections.Counter[str] = collections.Counter()
        self._ss_last_reason = ""
        self._ss_deviated_requests = 0
        self._ss_retired: list[dict[str, Any]] = []
        #: requests a plan rejected, finished in schedule(): their outputs go out with the step's
        self._ss_rejected_out: list[tuple[Any, str]] = []
        self._ss_rejects: collections.Counter[str] = collections.Counter()
        # reporting
        self._ss_last_update: float | None = None
        self._ss_metrics: MetricsEndpoint | None = None
        if self._ss_settings.metrics_port:
            self._ss_metrics = self._serve_metrics(self._ss_settings)
        log.info("slidingserve: scheduler %s (vLLM %s), address=%s policy=%s deadline_ms=%g profile=%s%s",
                 type(self).__name__, vllm.__version__, self._ss_settings.address, self._ss_settings.policy,
                 self._ss_settings.deadline_ms, self._ss_profile,
                 f" metrics=http://{self._ss_settings.metrics_host}:{self._ss_metrics.port}/metrics"
                 if self._ss_metrics is not None else "")

    def _serve_metrics(self, s: VllmAdapterSettings) -> MetricsEndpoint:
        """The Prometheus endpoint on ``metrics_port`` + this engine's data-parallel rank
        (several engine cores of one ``vllm serve`` each get their own port)."""
        rank = int(getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        port = s.metrics_port + rank
        engine_id = s.engine_id or default_engine_id()
        cls, version = type(self).__name__, str(vllm.__version__)

        def info() -> dict[str, str]:
            cur = self._ss_settings
            return {"scheduler": cls, "vllm_version": version, "engine_id": engine_id,
                    "address": cur.address, "policy": cur.policy, "profile": self._ss_profile}

        try:
            return MetricsEndpoint(self.slidingserve_stats, info, s.metrics_host, port)
        except OSError as e:
            raise SettingsError(f"SLIDINGSERVE_METRICS_PORT: cannot listen on {s.metrics_host}:{port}: "
                                f"{e.strerror or e}") from None

    @staticmethod
    def _slo_defaults(s: VllmAdapterSettings) -> SloDefaults:
        return SloDefaults(ttft_s=s.default_ttft_ms / 1e3, tbt_s=s.default_tbt_ms / 1e3,
                           classes=parse_slo_classes(s.slo_classes))

    # ------------------------------------------------------------ core/settings
    def _core(self) -> AdapterCore:
        core = self._ss_core
        if core is None:
            core = self._ss_core = build_core(self._ss_settings, self._ss_profile, self._predictors())
        new = self._ss_watcher.poll()
        if new is not None:
            self._swap(new)
            core = self._ss_core
            assert core is not None
        return core

    def _predictors(self) -> PredictorRegistry:
        """The in-process predictor registry, one per engine: a settings reload (another
        policy, in process again after a remote spell) keeps what it learned of this engine."""
        if self._ss_predictors is None:
            self._ss_predictors = PredictorRegistry(default_predictor(), RefitSettings())
        return self._ss_predictors

    def _swap(self, new: VllmAdapterSettings) -> None:
        """Hot reload: a new core (backend, policy, deadline); the old one is closed in
        the background so its queued reports are still delivered."""
        old = self._ss_core
        try:
            core = build_core(new, self._ss_profile, self._predictors())
        except Exception as e:
            log.error("slidingserve: cannot apply the new settings, keeping the old ones: %s", e)
            return
        self._ss_settings = new
        self._ss_builder.defaults = self._slo_defaults(new)
        self._ss_core = core
        if old is not None:
            self._ss_retired.append(old.stats())
            threading.Thread(target=old.close, name="slidingserve-close", daemon=True).start()

    # ----------------------------------------------------------------- snapshot
    def _free_kv_tokens(self) -> tuple[int, int]:
        """(free blocks, headroom in tokens): free blocks plus the unused tail of
        every running request's last block."""
        free_blocks = int(self.kv_cache_manager.block_pool.get_num_free_blocks())
        b = self.block_size
        tail = 0
        for r in self.running:
            tail += -r.num_computed_tokens % b
        return free_blocks, free_blocks * b + tail

    def _view(self, *, project: str = "", ahead_s: float = 0.0) -> _View:
        """The snapshot of the queues (``project``: "sync"/"async", as the next
        ``schedule()`` will find them, see :meth:`SnapshotBuilder.build`;
        ``ahead_s``: when that will be)."""
        _, free_tokens = self._free_kv_tokens()
        # Blocked requests (remote KV load, grammar, streaming input) are left out: the
        # plan cannot know whether they become ready.  vLLM promotes them inside
        # schedule() and schedules them uncapped from the budget the plan left (_cap).
        waiting: list[Any] = [*self.kv_holding_waiting, *self.waiting]
        blocked: set[str] = set()
        if not _SCHEDULABLE.issuperset(map(_status_of, waiting)):
            blocked = {r.request_id for r in waiting if r.status not in _SCHEDULABLE}
            waiting = [r for r in waiting if r.status in _SCHEDULABLE]
        builder = self._ss_builder
        snap, rows = builder.build(
            self.running, waiting, max_batch_tokens=self.max_num_scheduled_tokens,
            max_num_seqs=self.max_num_running_reqs, free_kv_tokens=free_tokens,
            now=time.time() + ahead_s, project=project)
        rr = builder.last_running_rows
        # a view taken now is checked with _kv_short instead, before it is taken
        kv_need = decodes_needing_block(snap, builder.last_computed, rr, self.block_size) if project else 0
        return _View(snap, rows, builder.last_computed, rr, blocked, kv_need)

    def _snapshot(self) -> tuple[Snapshot, list[Any], int]:
        """(snapshot, request objects per row, free KV blocks) of the queues now."""
        v = self._view()
        self._ss_blocked = v.blocked
        return v.snap, v.rows, int(self.kv_cache_manager.block_pool.get_num_free_blocks())

    def _kv_short(self) -> str:
        """Non-empty when the free KV blocks cannot give every running decode its next
        token (the simulator's preemption rule, docs/simulator.md): then only vLLM's
        preemption can make progress, and the iteration is scheduled natively."""
        b = self.block_size
        need = 0
        for r in self.running:
            comp = r.num_computed_tokens
            if comp % b == 0 and r.num_tokens + r.num_output_placeholders - comp <= 1:
                need += 1
        if need == 0:
            return ""
        free = int(self.kv_cache_manager.block_pool.get_num_free_blocks())
        return f"{need} decodes need a new KV block, {free} free" if need > free else ""

    def _fit(self, view: _View, plan: dict[str, int], free_blocks: int, *, stale: bool = False) -> Fit:
        """:func:`fit_plan` with this engine's KV and admission state; ``stale``: the view
        was taken before the last ``update_from_output`` (vLLM collects the requests freed
        since the last ``schedule()`` in ``finished_req_ids``, exactly that window)."""
        rules = KvRules(
            block_size=self.block_size, lookahead=self.num_lookahead_tokens, free_blocks=free_blocks,
            slots=min(self.max_num_running_reqs, self.max_num_active_reqs) - len(self.running),
            watermark=int(getattr(self.kv_cache_manager, "watermark_blocks", 0)) if self.running else 0,
            full_isl=bool(getattr(self, "scheduler_reserve_full_isl", False)))
        return fit_plan(view, plan, rules, self.finished_req_ids if stale else ())

    # ----------------------------------------------------------------- decision
    def _fallback(self, reason: str, detail: str) -> None:
        self._ss_fallbacks[reason] += 1
        self._ss_last_reason = f"{reason}: {detail}"
        n = self._ss_fallbacks[reason]
        if n == 1 or n % self._ss_settings.log_every == 0:
            log.warning("slidingserve: native scheduling (%s, %d so far): %s", reason, n, detail)

    def _decide(self) -> Fit | None:
        """The plan to execute this iteration, fitted to vLLM, or None for native scheduling:
        the one decided in the background when there is one, else decided now."""
        pending, self._ss_pending = self._ss_pending, None
        if self._ss_unsupported:
            self._fallback("unsupported", self._ss_unsupported)
            return None
        core = pending.core if pending is not None else self._core()
        view: _View | None = None
        if pending is not None:
            t = time.perf_counter()
            try:
                done = pending.future.result()  # bounded: the backend has the deadline
            except Exception as e:  # a bug in the job must not break vLLM
                self._fallback("error", f"background decision: {type(e).__name__}: {e}")
                return None
            self._ss_counts["wait_us"] += int((time.perf_counter() - t) * 1e6)
            if done is None:
                pending = None
            else:
                view, decision = done
                if decision.plan is not None and self._stale(view, decision.plan):
                    self._ss_counts["resyncs"] += 1
                    pending = None  # decide again, on the queues as they are now
                else:
                    self._ss_counts["pipelined"] += 1
        free_blocks = int(self.kv_cache_manager.block_pool.get_num_free_blocks())
        if pending is not None and view is not None:
            # counted on the snapshot, in the background (finished requests only free blocks)
            short = f"{view.kv_need} decodes need a new KV block, {free_blocks} free" \
                if view.kv_need > free_blocks else ""
        else:
            short = self._kv_short()
        if short:
            # vLLM must preempt to let every decode advance; a plan cannot preempt
            self._fallback("kv_pressure", short)
            return None
        self._ss_arrivals = []
        if pending is None:
            try:
                view = self._view()
            except Exception as e:  # a request state we cannot express: never break vLLM
                self._fallback("snapshot_error", f"{type(e).__name__}: {e}")
                return None
            if len(view.snap) == 0:
                return None
            decision = core.decide(view.snap)
        self._ss_blocked = view.blocked
        if decision.plan is None:
            self._fallback(decision.reason, core.last_error)
            return None
        return self._take(view, decision.plan, free_blocks, stale=pending is not None)

    def _take(self, view: _View, decided: Plan, free_blocks: int, *, stale: bool) -> Fit | None:
        """The plan's rejections and preemptions carried out now, and its allocations as
        vLLM can execute them (:meth:`_fit`); None for native scheduling."""
        if decided.rejections:
            self._reject(decided.rejections)
        if decided.preemptions and self._preempt(decided.preemptions):
            free_blocks = int(self.kv_cache_manager.block_pool.get_num_free_blocks())
        plan = decided.tokens_by_id()
        if not plan:
            self._fallback("empty_plan", f"policy path {decided.path!r} schedules nothing")
            return None
        fit = self._fit(view, plan, free_blocks, stale=stale)
        if fit.why:
            self._fallback("unallocatable", fit.why)
            return None
        if fit.trimmed:
            self._ss_counts["trimmed_admissions"] += fit.trimmed
        if not fit.plan:  # finished meanwhile, or our estimate ignores prefix hits: vLLM decides
            self._fallback("unallocatable", "no planned request fits vLLM's admission rules")
            return None
        self._ss_ahead_s = decided.predicted_latency_ms / 1e3
        return fit

    def _reject(self, rejections: Sequence[Rejection]) -> None:
        """Finish the requests a plan rejects (overload control), now, before vLLM schedules:
        their KV is freed and their clients get a final output (finish reason ``abort``,
        stop reason ``slidingserve:<reason>``) with this step's outputs.  The plan check
        let through only sheddable requests; those finished since the plan's view was
        taken are skipped."""
        reason = {r.id: r.reason for r in rejections}
        live = [rid for rid in reason if (q := self.requests.get(rid)) is not None and not q.is_finished()]
        if not live:
            return
        for req in self.finish_requests(live, RequestStatus.FINISHED_ABORTED):
            why = reason[req.request_id]
            self._ss_rejected_out.append((req, why))
            self._ss_rejects[why] += 1

    def _preempt(self, ids: Sequence[str]) -> int:
        """Preempt the requests a plan lists (to free KV for a higher class), now, before
        vLLM schedules, as vLLM's own preemption does: their KV is freed and they wait at
        the front of the queue to be recomputed.  The plan check let through only requests
        holding KV; those no longer running (finished, or preempted by vLLM since the
        plan's view was taken) are skipped.  Returns how many were preempted."""
        now = time.monotonic()
        done = 0
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or req not in self.running:
                continue
            if not self._request_blocks_can_be_freed(req):
                continue  # a KV connector still reads them
            self.running.remove(req)
            self._preempt_request(req, now)
            done += 1
        self._ss_counts["plan_preemptions"] += done
        return done

    def _rejected_outputs(self, outputs: dict[int, Any]) -> None:
        """Add the final outputs of the requests rejected in this step to vLLM's."""
        for req, why in self._ss_rejected_out:
            eco = outputs.get(req.client_index)
            if eco is None:
                eco = outputs[req.client_index] = EngineCoreOutputs()
            eco.outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
                stop_reason=f"slidingserve:{why}", events=req.take_events(),
                trace_headers=req.trace_headers))
        self._ss_rejected_out = []

    def _stale(self, view: _View, plan: Plan) -> bool:
        """Whether what happened since the view was taken could change the plan enough
        to decide again: the projection broke (a running request changed state outside
        ``schedule()``, e.g. a KV-connector failure or a test preempting by hand), KV
        was tight and finished requests freed some, or arrivals could use room the plan
        left.  Otherwise the plan stands (finished requests are dropped from it)."""
        rr = view.running_rows
        statuses = list(map(_status_of, view.rows[:rr]))
        running = statuses.count(RequestStatus.RUNNING)
        if running != rr and running + sum(map(RequestStatus.is_finished, statuses)) != rr:
            return True
        free = view.snap.free_kv_tokens
        if self.finished_req_ids and free is not None and free < self.max_num_scheduled_tokens:
            return True
        return bool(self._ss_arrivals) and self._room_for_arrivals(plan, view.snap)

    def _room_for_arrivals(self, plan: Plan, snap: Snapshot) -> bool:
        """Whether requests that arrived after the plan's snapshot could have been
        given something: the plan serves every request it knew of and leaves tokens
        and sequence slots unused.  (A plan that leaves known requests waiting
        chose its budget — e.g. for the TBT of running decodes — and would leave
        the arrivals waiting too; they are in the next plan.)"""
        return (len(plan.allocations) == len(snap)
                and plan.token_budget < self.max_num_scheduled_tokens
                and len(plan.allocations) < self.max_num_running_reqs
                and any(r.status in _WAITING for r in self._ss_arrivals))

    def _decide_ahead(self) -> None:
        """Start the next iteration's decision in the background (called at the end
        of ``schedule()``) on the queues as the next ``schedule()`` will find them.

        With async scheduling vLLM applies the previous step's output right after
        this call, so the snapshot is taken here, on the engine thread (inside
        ``schedule()``, which async scheduling overlaps with the GPU).  A
        synchronous engine leaves the queues alone until the GPU step is over, so
        the background job reads them itself and ``update_from_output`` waits for
        that read (about a millisecond, far shorter than a step) before changing
        them: the engine thread pays only for the hand-over."""
        self._ss_arrivals = []
        if self._ss_unsupported or not (self.running or self.waiting or self.kv_holding_waiting):
            return
        core = self._core()  # nothing is in flight: a settings swap is safe here
        if not self._ss_settings.pipeline:
            return
        view: _View | None = None
        if self._ss_async:
            try:
                view = self._view(project="async", ahead_s=self._ss_ahead_s)
            except Exception:
                return  # the next schedule() decides synchronously and counts the error
            if len(view.snap) == 0:
                return
        ex = self._ss_executor
        if ex is None:  # created on first use: after vLLM forks the engine process
            ex = self._ss_executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="slidingserve-decide")
        snapped = threading.Event()
        ahead_s = self._ss_ahead_s

        def job() -> tuple[_View, Decision] | None:
            v = view
            try:
                if v is None:
                    v = self._view(project="sync", ahead_s=ahead_s)
            except Exception:
                v = None  # the next schedule() decides synchronously and counts the error
            finally:
                snapped.set()
            if v is None or len(v.snap) == 0:
                return None
            return v, core.decide(v.snap)  # its plan check builds v.snap.index_of, here

        if view is not None:
            snapped.set()
        self._ss_pending = _Pending(ex.submit(job), core, snapped)

    def add_request(self, request: Any) -> None:
        self._quiesce()
        super().add_request(request)  # type: ignore[misc]
        if self._ss_pending is not None:
            self._ss_arrivals.append(request)

    # ------------------------------------------------------------------- hooks
    def _cap(self, request: Any, n: int, computed: int) -> int:
        plan = self._plan
        if plan is None:
            return n
        want = plan.get(request.request_id)
        if want is None:
            # unplanned: nothing, unless it became ready during this schedule()
            return n if request.request_id in self._ss_blocked else 0
        if want >= n or computed >= request.num_tokens - 1:
            return n  # within the plan, or a decode (with any spec tokens): all-or-nothing
        return want

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        computed = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return super()._mamba_block_aligned_split(  # type: ignore[misc]
            request, self._cap(request, num_new_tokens, computed),
            num_new_local_computed_tokens, num_external_computed_tokens)

    def _try_schedule_encoder_inputs(self, request: Any, num_computed_tokens: int, num_new_tokens: int,
                                     *args: Any, **kwargs: Any) -> Any:
        return super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request, num_computed_tokens, self._cap(request, num_new_tokens, num_computed_tokens),
            *args, **kwargs)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        if self._plan is not None:  # called for every request vLLM schedules: keep it lean
            num_new_tokens = self._cap(request, num_new_tokens, num_computed_tokens)
        return super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens)

    # ---------------------------------------------------------------- schedule
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._ss_counts["iterations"] += 1
        t0 = time.perf_counter()
        if self.running or self.waiting or self.kv_holding_waiting:
            fit = self._decide()
        else:
            fit, self._ss_pending = None, None
        t1 = time.perf_counter()
        self._ss_counts["decide_us"] += int((t1 - t0) * 1e6)
        if fit is None:
            self._ss_counts["native"] += 1
            self._ss_ahead_s = 0.0
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
            self._ss_inner = time.perf_counter() - t1
        else:
            out = self._execute(fit, args, kwargs)
        t2 = time.perf_counter()
        self._decide_ahead()
        t3 = time.perf_counter()
        c = self._ss_counts
        c["ahead_us"] += int((t3 - t2) * 1e6)
        # the adapter's own time in this call: all of it but vLLM's schedule()
        c["own_us"] += int((t3 - t0 - self._ss_inner) * 1e6)
        return out

    def _execute(self, fit: Fit, args: Any, kwargs: Any) -> Any:
        """``super().schedule()`` with the queues ordered and the hooks capping by the fitted plan."""
        plan = fit.plan
        running0 = list(self.running)
        waiting0 = list(self.waiting)
        order, planned_waiting = execution_order(
            running0, fit, holding=self.kv_holding_waiting,
            blocked=[r for r in waiting0 if r.status not in _SCHEDULABLE] if self._ss_blocked else ())
        self.running[:] = order
        self.waiting.clear()
        self.waiting.extend(planned_waiting)
        self._ss_hidden = len(waiting0) - len(planned_waiting)
        self._plan = plan
        t = time.perf_counter()
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._ss_inner = time.perf_counter() - t
            self._plan = None
            self._ss_hidden = 0
            self._restore(running0, waiting0, planned_waiting)
        self._ss_counts["planned"] += 1
        self._count_deviations(plan, out)
        return out

    def get_request_counts(self) -> tuple[int, int]:
        """vLLM's counts, including the waiting requests hidden during a planned
        ``schedule()`` (vLLM's long-prefill threshold and prefill-capacity logic
        read them)."""
        n_run, n_wait = super().get_request_counts()  # type: ignore[misc]
        return n_run, n_wait + self._ss_hidden

    def _restore(self, running0: list[Any], waiting0: list[Any], shown: list[Any] | None = None) -> None:
        """vLLM's own queue order again: survivors in their old order, newcomers where
        vLLM put them (admitted requests at the end of running, preempted ones at the
        front of waiting).  ``shown``: the part of ``waiting0`` vLLM saw (default all)."""
        was_running = set(running0)
        now_running = set(self.running)
        newcomers = [r for r in self.running if r not in was_running]
        if len(now_running) - len(newcomers) == len(running0):  # nothing left running
            survivors = running0
        else:
            survivors = [r for r in running0 if r in now_running]
        self.running[:] = survivors + newcomers
        seen = set(waiting0 if shown is None else shown)
        # preempted (from running) or promoted (from kv_holding_waiting) in this step
        front = [r for r in self.waiting if r not in seen]
        gone = set(newcomers)  # admitted from waiting0 (nothing in waiting0 ran before)
        gone.update(self.kv_holding_waiting)
        rest = [r for r in waiting0 if r not in gone] if gone else waiting0
        self.waiting.clear()
        self.waiting.extend(front + rest)

    def _count_deviations(self, plan: dict[str, int], out: Any) -> None:
        got = out.num_scheduled_tokens
        differ = [rid for rid, n in plan.items() if got.get(rid, 0) != n]
        if not differ:
            return
        bad = 0
        for rid in differ:
            n, g = plan[rid], got.get(rid, 0)
            r = self.requests.get(rid)
            if r is not None and g > 0:
                # decode with spec tokens, or a prefill shortened by a prefix-cache hit
                if g > n and n == 1 and not r.is_prefill_chunk:
                    continue
                if g < n and r.num_computed_tokens >= r.num_tokens:
                    continue
            bad += 1
        if bad:
            self._ss_counts["deviating_iterations"] += 1
            self._ss_deviated_requests += bad

    # --------------------------------------------------------------- reporting
    def _quiesce(self) -> None:
        """Wait until a background job has finished reading vLLM's queues; called
        before anything changes them (output, aborts, arrivals)."""
        pending = self._ss_pending
        if pending is not None and not pending.snapped.is_set():
            t0 = time.perf_counter()
            pending.snapped.wait()
            self._ss_counts["snap_wait_us"] += int((time.perf_counter() - t0) * 1e6)

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        self._quiesce()
        return super().finish_requests(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t_in = time.perf_counter()
        self._quiesce()
        t = self.slidingserve_clock()
        prev = self._ss_last_update
        self._ss_last_update = t
        if prev is not None and scheduler_output.total_num_scheduled_tokens > 0 and self._ss_core is not None:
            try:
                self._report(scheduler_output, (t - prev) * 1e3)
            except Exception as e:  # reporting must never break the engine loop
                self._ss_counts["report_errors"] += 1
                self._ss_last_reason = f"report: {type(e).__name__}: {e}"
        t_v = time.perf_counter()
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._ss_rejected_out:
            self._rejected_outputs(result)
        t_v2 = time.perf_counter()
        if not (self.running or self.waiting or self.kv_holding_waiting):
            self._ss_last_update = None  # the next gap would include idle time
        self._ss_builder.prune(self.requests)
        self._ss_counts["own_us"] += int((time.perf_counter() - t_v2 + t_v - t_in) * 1e6)
        return result

    def _report(self, so: Any, latency_ms: float) -> None:
        """c = tokens each request got, u = its tokens in KV before the step."""
        # Only the multiset of (c, u) pairs matters: walk the cached and new request lists,
        # which carry u, and look c up (no per-request dict to build).
        nst = so.num_scheduled_tokens
        cached = so.scheduled_cached_reqs
        ids: list[str] = cached.req_ids
        u_list: list[int] = cached.num_computed_tokens
        new = so.scheduled_new_reqs
        if new:
            ids = [*ids, *(nr.req_id for nr in new)]
            u_list = [*u_list, *(nr.num_computed_tokens for nr in new)]
        n = len(nst)
        if len(ids) == n:
            c = np.fromiter(map(nst.__getitem__, ids), np.int64, n)
            u = np.array(u_list, np.int64)
        else:  # not expected: fall back to the general mapping (unknown u = 0)
            computed = dict(zip(ids, u_list, strict=False))
            c = np.fromiter(nst.values(), np.int64, n)
            u = np.fromiter((computed.get(rid, 0) for rid in nst), np.int64, n)
        assert self._ss_core is not None
        self._ss_core.report(IterationSample(c, u, latency_ms))
        self._ss_counts["reports"] += 1

    # ------------------------------------------------------------------ public
    def slidingserve_stats(self) -> dict[str, Any]:
        """Counters for operators and tests (cheap; safe to call from any thread)."""
        core = self._ss_core.stats() if self._ss_core is not None else {}
        # the counters of cores retired by settings reloads plus the current one's
        totals: dict[str, int] = {}
        for st in [*self._ss_retired, core]:
            for k in ("remote_decisions", "reports_sent", "reports_dropped", "report_errors"):
                totals[k] = totals.get(k, 0) + int(st.get(k, 0))
        c = self._ss_counts
        return {
            "iterations": c["iterations"],
            "planned": c["planned"],
            "native": c["native"],
            "fallbacks": dict(self._ss_fallbacks),
            "fallback_total": sum(self._ss_fallbacks.values()),
            "deviating_iterations": c["deviating_iterations"],
            "deviated_requests": self._ss_deviated_requests,
            "trimmed_admissions": c["trimmed_admissions"],
            "rejected": dict(self._ss_rejects),
            "rejected_total": sum(self._ss_rejects.values()),
            "plan_preemptions": c["plan_preemptions"],
            "reports": c["reports"],
            "report_errors": c["report_errors"],
            "mean_decide_us": c["decide_us"] / max(1, c["iterations"]),
            "pipelined": c["pipelined"],
            "mean_wait_us": c["wait_us"] / max(1, c["pipelined"]),
            "mean_ahead_us": c["ahead_us"] / max(1, c["iterations"]),
            #: the adapter's own engine-thread time per iteration (schedule() and
            #: update_from_output() minus vLLM's own work in them)
            "mean_own_us": c["own_us"] / max(1, c["iterations"]),
            "own_us": c["own_us"],
            "decide_us": c["decide_us"],
            "snap_waits_us": c["snap_wait_us"],
            "resyncs": c["resyncs"],
            "last_reason": self._ss_last_reason,
            "settings_reloads": self._ss_watcher.reloads,
            "settings_errors": self._ss_watcher.errors,
            "policy": self._ss_settings.policy,
            "address": self._ss_settings.address,
            "profile": self._ss_profile,
            "core": core,
            "core_totals": totals,
        }

    def slidingserve_close(self) -> None:
        self._ss_pending = None
        if self._ss_metrics is not None:
            self._ss_metrics.close()
            self._ss_metrics = None
        if self._ss_executor is not None:
            self._ss_executor.shutdown(wait=True, cancel_futures=True)
            self._ss_executor = None
        if self._ss_core is not None:
            self._ss_core.close()
            self._ss_core = None
        if self._ss_predictors is not None:
            self._ss_predictors.close()
            self._ss_predictors = None

    def shutdown(self) -> None:
        try:
            self.slidingserve_close()
        finally:
            super().shutdown()  # type: ignore[misc]


class RemoteScheduler(SlidingServeMixin, AsyncScheduler):
    """``--scheduler-cls engine_adapter.vllm.RemoteScheduler`` (async scheduling, the default)."""


class RemoteSyncScheduler(SlidingServeMixin, Scheduler):
    """``--scheduler-cls engine_adapter.vllm.RemoteSyncScheduler`` (sync scheduling)."""

