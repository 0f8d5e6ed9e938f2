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

Prefix caching (``SLIDINGSERVE_PREFIX_LOOKUP``, on by default): a waiting request
with nothing computed shows its prefix-cache hit as computed tokens (the lookup
vLLM runs when it admits it, :meth:`_ss_prefix_hit`, remembered between snapshots
by :class:`.snapshot.PrefixHits`), so a plan allocates the tokens beyond the hit,
as vLLM's ``num_new_tokens`` counts them; the admissions' hits are looked up again
for the KV fit.  A hit that changed before vLLM looks only changes how much of the
allocation vLLM computes (:func:`.decision.cap`), never whether the request stays known to it.

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

The class keeps vLLM's hooks and the glue to vLLM's objects; what it decides lives in
modules that import nothing of vLLM (tested without it): :mod:`.decision` (the view and the
core's answer → the plan to execute or the fallback reason, a typed :class:`.decision.Outcome`),
:mod:`.fit` (the plan vLLM can execute, queue order), :mod:`.pipeline` (the decision in
flight, staleness),
:mod:`.stats` (counters, deviations, iteration samples), :mod:`.effects` (rejections and
preemptions that still apply), :mod:`.live` (the core and its hot reload), and
:mod:`.observe` (logs, the metrics endpoint).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import vllm

from .compat import check_vllm_version, prefix_lookup_off
from .observe import MetricsEndpoint, attach_log_handler, serve_metrics

# Before vLLM's internals are imported: on a version the adapter does not support they
# may not import, or import and break later; fail here with one line naming the versions.
attach_log_handler(fallback=False)  # vLLM's handlers if it has configured logging already
check_vllm_version(vllm.__version__)

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from engine_adapter.core import AdapterCore, Decision  # noqa: E402
from scheduler_service.core import Rejection, Snapshot  # noqa: E402
from scheduler_service.recording import NATIVE as NATIVE_POLICY  # noqa: E402

from .decision import Answer, Outcome, Prepared, cap, fallback, fit_answer, read_answer, reuse  # noqa: E402
from .effects import live_rejections, preemptible  # noqa: E402
from .fit import (  # noqa: E402
    Fit,
    KvRules,
    decodes_at_block_boundary,
    decodes_needing_block,
    execution_order,
    kv_headroom,
    kv_short,
    restored_order,
    split_blocked,
)
from .fit import View as _View  # noqa: E402
from .live import LiveCore, build_core  # noqa: E402
from .pipeline import Pipeline, Statuses  # noqa: E402
from .settings import SettingsWatcher, VllmAdapterSettings, default_engine_id, slo_defaults  # noqa: E402
from .snapshot import PrefixHits, SnapshotBuilder  # noqa: E402
from .stats import LOCAL_REASONS, AdapterStats, deviations, iteration_sample  # noqa: E402

__all__ = ["LOCAL_REASONS", "RemoteScheduler", "RemoteSyncScheduler", "SlidingServeMixin", "build_core"]

log = logging.getLogger("engine_adapter.vllm")

#: Request states a plan may name; the others (waiting for remote KV, a grammar,
#: streaming input) are vLLM's to promote.
_SCHEDULABLE = frozenset((RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING))
_STATUSES = Statuses(running=RequestStatus.RUNNING,
                     waiting=frozenset((RequestStatus.WAITING, RequestStatus.PREEMPTED)),
                     is_finished=RequestStatus.is_finished)


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


def _unsupported(policy: Any, waiting: Any) -> str:
    """Why vLLM's configuration rules plans out ("" when it does not)."""
    if policy != SchedulingPolicy.FCFS:
        return f"scheduling policy {policy.name} (only fcfs)"
    if not isinstance(waiting, FCFSRequestQueue):
        return "waiting queue is not FCFS"
    return ""


if TYPE_CHECKING:
    #: What the mixin is mixed into: its ``super()`` calls and the vLLM attributes it reads
    #: (``running``, ``waiting``, ``kv_holding_waiting``, ``requests``, ``kv_cache_manager``,
    #: the batch limits, ``finished_req_ids``, ``policy``, ``vllm_config``) are type-checked
    #: against vLLM's ``Scheduler``.
    _VllmScheduler = Scheduler
else:
    _VllmScheduler = object


class SlidingServeMixin(_VllmScheduler):
    """vLLM's hooks, mixed into vLLM's ``Scheduler``/``AsyncScheduler``; the decisions are
    the plain objects' it holds: ``_ss_live`` (:class:`.live.LiveCore`), ``_ss_pipe``
    (:class:`.pipeline.Pipeline`), ``_ss_stats`` (:class:`.stats.AdapterStats`), and the
    functions of :mod:`.decision` and :mod:`.fit`."""

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
        self._ss_inner = 0.0  # seconds in vLLM's own schedule() during the last call
        self._ss_async = isinstance(self, AsyncScheduler)
        watcher = SettingsWatcher(VllmAdapterSettings.from_env(self.slidingserve_env, apply_file=False))
        s = watcher.current  # raised SettingsError on a bad file at start
        profile = detect_profile(self.vllm_config, s)
        self._ss_builder = SnapshotBuilder(slo_defaults(s), profile)
        self._ss_live = LiveCore(watcher, profile, self._ss_builder)
        self._ss_stats = AdapterStats()
        self._ss_counts = self._ss_stats.counts  # read by benchmarks/vllm_adapter_overhead.py
        self._ss_pipe = Pipeline(self._ss_stats, _STATUSES, self.max_num_scheduled_tokens, self.max_num_running_reqs)
        self._ss_unsupported = _unsupported(self.policy, self.waiting)
        if self._ss_unsupported:
            log.warning("slidingserve: %s; vLLM schedules natively", self._ss_unsupported)
        #: waiting requests' prefix-cache hits for the snapshot, unless vLLM computes them
        #: another way (asked at every snapshot: a connector may be attached after start)
        self._ss_hits = PrefixHits(self._ss_prefix_hit)
        off = prefix_lookup_off(self)
        if off and getattr(self.kv_cache_manager, "enable_caching", False):
            log.info("slidingserve: waiting requests' prefix-cache hits are not looked up (%s)", off)
        #: requests a plan rejected, finished in schedule(): their outputs go out with the step's
        self._ss_rejected_out: list[tuple[Any, str]] = []
        self._ss_last_update: float | None = None
        self._ss_metrics: MetricsEndpoint | None = None
        if s.metrics_port:
            static = {"scheduler": type(self).__name__, "vllm_version": str(vllm.__version__),
                      "engine_id": s.engine_id or default_engine_id()}
            rank = int(getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
            self._ss_metrics = serve_metrics(s, rank, self.slidingserve_stats,
                                             lambda: {**static, **self._ss_live.labels()})
        log.info("slidingserve: scheduler %s (vLLM %s), address=%s policy=%s deadline_ms=%g profile=%s%s",
                 type(self).__name__, vllm.__version__, s.address, s.policy, s.deadline_ms, profile,
                 f" metrics=http://{s.metrics_host}:{self._ss_metrics.port}/metrics"
                 if self._ss_metrics is not None else "")

    # --------------------------------------------------------- glue to vLLM
    def _core(self) -> AdapterCore:
        return self._ss_live.get()

    def _ss_free_blocks(self) -> int:
        return int(self.kv_cache_manager.block_pool.get_num_free_blocks())

    def _ss_prefix_hit(self, request: Any) -> tuple[int, int]:
        """(prompt tokens in the prefix cache, evictable blocks among them) of a waiting
        request with nothing computed: the lookup of ``KVCacheManager.get_computed_blocks``
        (``find_longest_cache_hit`` up to ``num_tokens - 1``), without its side effects
        (prefix-cache stats, KV events).  A KV connector's external hits are not counted."""
        kvm = self.kv_cache_manager
        if not kvm.prefix_cache_lookup_enabled(request):
            return 0, 0
        if getattr(request, "resumable", False) and getattr(self, "num_hash_lookahead_tokens", 0):
            return 0, 0  # vLLM rehashes such a request before its lookup
        blocks, hit, _ = kvm.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        if hit <= 0:
            return 0, 0
        return int(hit), sum(b.ref_cnt == 0 and not b.is_null for group in blocks for b in group)

    def _view(self, *, project: str = "", ahead_s: float = 0.0) -> _View:
        """The snapshot of the queues (``project``: "sync"/"async", as the next
        ``schedule()`` will find them, see :meth:`SnapshotBuilder.build`;
        ``ahead_s``: when that will be)."""
        free_blocks = self._ss_free_blocks()
        free_tokens = kv_headroom(self.running, self.block_size, free_blocks)
        # Blocked requests (remote KV load, grammar, streaming input) are left out: the
        # plan cannot know whether they become ready.  vLLM promotes them inside
        # schedule() and schedules them uncapped from the budget the plan left (decision.cap).
        waiting, blocked = split_blocked([*self.kv_holding_waiting, *self.waiting], _SCHEDULABLE)
        builder = self._ss_builder
        hits = self._ss_hits if self._ss_live.settings.prefix_lookup and not prefix_lookup_off(self) else None
        snap, rows = builder.build(
            self.running, waiting, max_batch_tokens=self.max_num_scheduled_tokens,
            max_num_seqs=self.max_num_running_reqs, free_kv_tokens=free_tokens,
            now=time.time() + ahead_s, project=project, hits=hits)
        rr = builder.last_running_rows
        # a view taken now is checked with kv_short instead, before it is taken
        kv_need = decodes_needing_block(snap, builder.last_computed, rr, self.block_size) if project else 0
        # the KV state a decision taken ahead is fitted on (.decision.prepare; checked against
        # the state then, .decision.reuse), with the slots of the requests finishing in the step
        # that runs free; a view taken now is fitted on the state after the plan's preemptions
        kv = self._kv_rules(free_blocks, rr) if project else None
        if hits is None:
            return _View(snap, rows, builder.last_computed, rr, blocked, kv_need, kv=kv)
        return _View(snap, rows, builder.last_computed, rr, blocked, kv_need, builder.last_hits,
                     builder.last_evictable, kv)

    def _snapshot(self) -> tuple[Snapshot, list[Any], int]:
        """(snapshot, request objects per row, free KV blocks) of the queues now."""
        v = self._view()
        self._ss_blocked = v.blocked
        return v.snap, v.rows, self._ss_free_blocks()

    def _kv_rules(self, free_blocks: int, running: int | None = None) -> KvRules:
        """vLLM's KV and admission state now, with ``free_blocks`` free (``running``: the
        requests that hold a slot, default vLLM's running queue's)."""
        return KvRules(
            block_size=self.block_size, lookahead=self.num_lookahead_tokens, free_blocks=free_blocks,
            slots=min(self.max_num_running_reqs, self.max_num_active_reqs) - (
                len(self.running) if running is None else running),
            watermark=int(getattr(self.kv_cache_manager, "watermark_blocks", 0)) if self.running else 0,
            full_isl=bool(getattr(self, "scheduler_reserve_full_isl", False)))

    def _ss_hits_now(self, view: _View, plan: dict[str, int]) -> _View:
        """``view`` with the prefix-cache hits of the waiting requests ``plan`` admits looked
        up again: blocks may have been cached, evicted or freed since the snapshot, and the
        admission's KV blocks are counted as vLLM's lookup right after will find them."""
        index, rr = view.snap.index_of, view.running_rows
        rows = [i for i in map(index.get, plan) if i is not None and i >= rr]
        if not rows or view.hits is None or view.evictable is None:
            return view
        hits, ev = view.hits.copy(), view.evictable.copy()
        for i in rows:
            r = view.rows[i]
            if r.num_computed_tokens == 0 and not r.is_finished():
                hits[i], ev[i] = self._ss_prefix_hit(r)
        return replace(view, hits=hits, evictable=ev)

    def _queued(self) -> bool:
        """Whether vLLM's queues hold a request (running, waiting or holding KV)."""
        return bool(self.running or self.waiting or self.kv_holding_waiting)

    def _fallback(self, reason: str, detail: str) -> None:
        self._ss_stats.fallback(reason, detail, self._ss_live.settings.log_every)

    # ----------------------------------------------------------------- decision
    def _decide(self) -> Fit | None:
        """The plan to execute this iteration, fitted to vLLM, or None for native scheduling
        (:meth:`_outcome`, carried out by :meth:`_apply`)."""
        return self._apply(self._outcome())

    def _outcome(self) -> Outcome:
        """This iteration's :class:`.decision.Outcome`: on the view and decision taken in the
        background when there is one (and it stands), else on a view and decision taken now."""
        pending = self._ss_pipe.take()
        if self._ss_unsupported:
            return fallback("unsupported", self._ss_unsupported)
        if self._ss_live.settings.observe:
            return self._observe()
        core = pending.core if pending is not None else self._core()
        done = None
        if pending is not None:
            try:
                done = self._ss_pipe.collect(pending, finished_since=bool(self.finished_req_ids))
            except Exception as e:  # a bug in the job must not break vLLM
                return fallback("error", f"background decision: {type(e).__name__}: {e}")
        free_blocks = self._ss_free_blocks()
        # counted on the snapshot, in the background, for a pipelined view (finished requests only free blocks)
        need = done[0].kv_need if done is not None else decodes_at_block_boundary(self.running, self.block_size)
        short = kv_short(need, free_blocks)
        if short:  # vLLM must preempt to let every decode advance; a plan cannot preempt
            return fallback("kv_pressure", short)
        self._ss_pipe.arrivals = []
        prepared = None
        if done is None:
            try:
                view = self._view()
            except Exception as e:  # a request state we cannot express: never break vLLM
                return fallback("snapshot_error", f"{type(e).__name__}: {e}")
            if len(view.snap) == 0:
                return Outcome()
            decision = core.decide(view.snap)
        else:
            view, decision, prepared = done
        self._ss_blocked = view.blocked
        return self._take(view, decision, core.last_error, free_blocks, stale=done is not None, prepared=prepared)

    def _observe(self) -> Outcome:
        """vLLM schedules; the queues go to the recording as vLLM's own (``observe``)."""
        try:
            view = self._view()
        except Exception as e:  # a request state we cannot express: never break vLLM
            return fallback("snapshot_error", f"{type(e).__name__}: {e}")
        if len(view.snap):
            self._core().record(view.snap, NATIVE_POLICY, {})
        return Outcome()

    def _take(self, view: _View, decision: Decision, last_error: str, free_blocks: int, *,
              stale: bool, prepared: Prepared | None = None) -> Outcome:
        """:func:`.decision.read_answer`, the answer's rejections and preemptions carried out
        now, and :func:`.decision.fit_answer` on vLLM's state after them; a fit ``prepared``
        in the background when it still stands (:func:`.decision.reuse`).  ``stale``: the view
        was taken before the last ``update_from_output`` (vLLM collects the requests freed
        since the last ``schedule()`` in ``finished_req_ids``, exactly that window)."""
        finished = self.finished_req_ids if stale else ()
        if prepared is not None:
            out = reuse(prepared, self._kv_rules(free_blocks), finished)
            if out is not None:
                self._ss_counts["prefitted"] += 1
                return out
            answer: Answer | Outcome = prepared.answer
        else:
            answer = read_answer(decision, last_error)
        if isinstance(answer, Outcome):
            return answer
        if answer.rejections:
            self._reject(answer.rejections)
        if answer.preemptions and self._preempt(answer.preemptions):
            free_blocks = self._ss_free_blocks()
        if view.hits is not None:
            view = self._ss_hits_now(view, answer.allocations)
        return fit_answer(answer, view, self._kv_rules(free_blocks), finished)

    def _apply(self, outcome: Outcome) -> Fit | None:
        """Count ``outcome``; its fit, or None for native scheduling."""
        if outcome.trimmed:
            self._ss_counts["trimmed_admissions"] += outcome.trimmed
        if outcome.fit is None:
            if outcome.reason:
                self._fallback(outcome.reason, outcome.detail)
            return None
        self._ss_pipe.ahead_s = outcome.ahead_s
        return outcome.fit

    def _reject(self, rejections: Sequence[Rejection]) -> None:
        """Finish the requests a plan rejects (overload control), now, before vLLM schedules:
        their KV is freed and their clients get a final output (finish reason ``abort``,
        stop reason ``slidingserve:<reason>``) with this step's outputs.  The plan check
        let through only sheddable requests; those finished since the plan's view was
        taken are skipped."""
        reason = live_rejections(rejections, self.requests)
        if not reason:
            return
        for req in self.finish_requests(list(reason), RequestStatus.FINISHED_ABORTED):
            why = reason[req.request_id]
            self._ss_rejected_out.append((req, why))
            self._ss_stats.rejects[why] += 1

    def _preempt(self, ids: Sequence[str]) -> int:
        """Preempt the requests a plan lists (to free KV for a higher class), now, before
        vLLM schedules, as vLLM's own preemption does: their KV is freed and they wait at
        the front of the queue to be recomputed.  The plan check let through only requests
        holding KV; those no longer running (finished, or preempted by vLLM since the
        plan's view was taken) are skipped.  Returns how many were preempted."""
        now = time.monotonic()
        done = 0
        for req in preemptible(ids, self.requests, self.running, RequestStatus.RUNNING):
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
        self._ss_pipe.arrivals = []
        if self._ss_unsupported or self._ss_live.settings.observe or not self._queued():
            return
        self._ss_pipe.ahead(self._ss_live, lambda project, ahead_s: self._view(project=project, ahead_s=ahead_s),
                            project_now=self._ss_async)

    # ------------------------------------------------------------ vLLM's hooks
    def add_request(self, request: Any) -> None:
        self._ss_pipe.quiesce()
        super().add_request(request)
        self._ss_pipe.arrived(request)

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        computed = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return super()._mamba_block_aligned_split(
            request, cap(self._plan, self._ss_blocked, request, num_new_tokens, computed),
            num_new_local_computed_tokens, num_external_computed_tokens)

    def _try_schedule_encoder_inputs(self, request: Any, num_computed_tokens: int, num_new_tokens: int,
                                     *args: Any, **kwargs: Any) -> Any:
        return super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, cap(self._plan, self._ss_blocked, request, num_new_tokens,
                                              num_computed_tokens),
            *args, **kwargs)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        if self._plan is not None:  # called for every request vLLM schedules: keep it lean
            num_new_tokens = cap(self._plan, self._ss_blocked, request, num_new_tokens, num_computed_tokens)
        return super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        c = self._ss_counts
        c["iterations"] += 1
        t0 = time.perf_counter()
        if self._queued():
            fit = self._decide()
        else:
            fit, self._ss_pipe.pending = None, None
        t1 = time.perf_counter()
        c["decide_us"] += int((t1 - t0) * 1e6)
        if fit is None:
            c["native"] += 1
            self._ss_pipe.ahead_s = 0.0
            out = super().schedule(*args, **kwargs)
            self._ss_inner = time.perf_counter() - t1
        else:
            out = self._execute(fit, args, kwargs)
        t2 = time.perf_counter()
        self._decide_ahead()
        t3 = time.perf_counter()
        c["ahead_us"] += int((t3 - t2) * 1e6)
        # the adapter's own time in this call: all of it but vLLM's schedule()
        c["own_us"] += int((t3 - t0 - self._ss_inner) * 1e6)
        return out

    def _execute(self, fit: Fit, args: Any, kwargs: Any) -> Any:
        """``super().schedule()`` with the queues ordered and the hooks capping by the fitted
        plan; vLLM's own queue order again afterwards (:func:`.fit.restored_order`)."""
        plan = fit.plan
        running0 = list(self.running)
        waiting0 = list(self.waiting)
        order, shown = execution_order(
            running0, fit, holding=list(self.kv_holding_waiting),
            blocked=[r for r in waiting0 if r.status not in _SCHEDULABLE] if self._ss_blocked else ())
        self._set_queues(order, shown)
        self._ss_hidden = len(waiting0) - len(shown)
        self._plan = plan
        t = time.perf_counter()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._ss_inner = time.perf_counter() - t
            self._plan = None
            self._ss_hidden = 0
            self._set_queues(*restored_order(running0, waiting0, self.running, list(self.waiting),
                                             list(self.kv_holding_waiting), shown))
            if fit.admit:
                # admitted (their hits are vLLM's now) or refused (the hit planned with may be stale)
                self._ss_hits.forget([r.request_id for r in fit.admit])
        self._ss_counts["planned"] += 1
        self._ss_stats.deviated(deviations(plan, out.num_scheduled_tokens, self.requests))
        return out

    def _set_queues(self, running: list[Any], waiting: list[Any]) -> None:
        """vLLM's running and waiting queues, in place (vLLM holds references to both).  Plans
        run only on vLLM's FCFS waiting queue (:func:`_unsupported`), a deque."""
        self.running[:] = running
        fcfs = self.waiting
        assert isinstance(fcfs, FCFSRequestQueue)
        fcfs.clear()
        fcfs.extend(waiting)

    def get_request_counts(self) -> tuple[int, int]:
        """vLLM's counts, including the waiting requests hidden during a planned
        ``schedule()`` (vLLM's long-prefill threshold and prefill-capacity logic
        read them)."""
        n_run, n_wait = super().get_request_counts()
        return n_run, n_wait + self._ss_hidden

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        self._ss_pipe.quiesce()
        return super().finish_requests(*args, **kwargs)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t_in = time.perf_counter()
        self._ss_pipe.quiesce()
        t = self.slidingserve_clock()
        prev = self._ss_last_update
        self._ss_last_update = t
        core = self._ss_live.core
        if prev is not None and scheduler_output.total_num_scheduled_tokens > 0 and core is not None:
            try:
                core.report(iteration_sample(scheduler_output, (t - prev) * 1e3))
                self._ss_counts["reports"] += 1
            except Exception as e:  # reporting must never break the engine loop
                self._ss_stats.report_failed(e)
        t_v = time.perf_counter()
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._ss_rejected_out:
            self._rejected_outputs(result)
        t_v2 = time.perf_counter()
        if not self._queued():
            self._ss_last_update = None  # the next gap would include idle time
        self._ss_builder.prune(self.requests)
        self._ss_hits.prune(self.requests)
        self._ss_counts["own_us"] += int((time.perf_counter() - t_v2 + t_v - t_in) * 1e6)
        return result

    # ------------------------------------------------------------------ public
    def slidingserve_stats(self) -> dict[str, Any]:
        """Counters for operators and tests (cheap; safe to call from any thread)."""
        core, live = self._ss_live.stats()
        return self._ss_stats.as_dict(core, self._ss_live.retired, **live)

    def slidingserve_close(self) -> None:
        self._ss_pipe.close()
        if self._ss_metrics is not None:
            self._ss_metrics.close()
            self._ss_metrics = None
        self._ss_live.close()

    def shutdown(self) -> None:
        try:
            self.slidingserve_close()
        finally:
            super().shutdown()


class RemoteScheduler(SlidingServeMixin, AsyncScheduler):
    """``--scheduler-cls engine_adapter.vllm.RemoteScheduler`` (async scheduling, the default)."""


class RemoteSyncScheduler(SlidingServeMixin, Scheduler):
    """``--scheduler-cls engine_adapter.vllm.RemoteSyncScheduler`` (sync scheduling)."""
