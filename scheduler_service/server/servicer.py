"""The SchedulerService implementation: decode at the edge, call the core, encode.

Every RPC maps a :class:`ValidationError` to INVALID_ARGUMENT (with BadRequest details) and
any other exception to INTERNAL with a reference id that is logged with the traceback, so
that a bad or unlucky request never takes the server down and never leaks internals; the
mapping is :mod:`.errors` (one decorator for the unary and client-streaming RPCs, the same
classification per message on ``ScheduleStream``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from time import perf_counter_ns
from typing import Any

import grpc
import structlog

from scheduler_service.core import Plan, Policy, ValidationError, registry
from scheduler_service.core.reasons import plan_explained, reason_counts
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.predictors import PredictorRegistry
from scheduler_service.recording import Recorder, params_text
from scheduler_service.wire.convert import (
    describe_to_pb,
    encode_plan,
    predictor_sample_counts,
    profile_from_pb,
    report_from_pb,
    snapshot_from_pb,
)
from scheduler_service.wire.status import MAX_MESSAGE_BYTES, clip

from .config import ServerConfig
from .deployments import PolicySet, ShadowRunner
from .engines import EngineTable
from .errors import failure, rpc_errors
from .handlers import Undecodable
from .identity import DEFAULT_TENANT, scoped_key, tenant_of
from .metrics import Metrics
from .whatif import run_child, whatif_args

__all__ = ["PolicyCache", "SchedulerServicer"]

log = structlog.get_logger("slidingserve.server")

#: Trailing metadata of GetPredictor: the pid of the worker process that answered.
WORKER_PID_KEY = "slidingserve-worker-pid"
#: At most this many rejection reasons travel back in a ReportSummary.
MAX_REASONS = 10


def _explained(policy: Any, snap: Any, predictor: Any) -> tuple[Plan, bool]:
    """The plan with its reasons, and True; without them, and False, when they cannot be
    given (a plan that names requests the snapshot does not have: the engine's plan check
    refuses it, and an explanation must never fail a decision)."""
    plan = plan_explained(policy, snap, predictor)
    try:
        len(plan.reasons)  # classified here, not while encoding
    except (KeyError, IndexError, ValueError) as e:
        log.warning("plan_not_explained", policy=plan.policy, error=f"{type(e).__name__}: {e}")
        return dataclasses.replace(plan, reasons=()), False
    return plan, True


class PolicyCache:
    """Policies by (name, params).  Policies are immutable, so building one per distinct
    parameter set once and sharing it is safe and keeps ``registry.create`` (validation,
    version hashing) off the hot path.  Bounded LRU: params come from clients."""

    def __init__(self, capacity: int = 256) -> None:
        self._items: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], Policy] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity

    def get(self, name: str, params: Mapping[str, str]) -> Policy:
        key = (name, tuple(sorted(params.items())))
        with self._lock:
            p = self._items.get(key)
            if p is not None:
                self._items.move_to_end(key)
                return p
        p = registry.create(name, dict(params) or None)  # raises ValidationError
        with self._lock:
            self._items[key] = p
            if len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return p


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(
        self, config: ServerConfig, predictors: PredictorRegistry, metrics: Metrics, policies: PolicyCache,
        *, policyset: PolicySet | None = None, shadow: ShadowRunner | None = None,
        engines: EngineTable | None = None, recorder: Recorder | None = None,
    ) -> None:
        self._cfg = config
        self._predictors = predictors
        self._metrics = metrics
        self._policies = policies
        self._deployments = policyset or PolicySet(config.default_policy, policies)
        self._shadow = shadow
        self.engines = engines or EngineTable(metrics, config.engine_ttl_s, config.max_engines)
        self.ready = threading.Event()
        self._metric_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._deployment_counters: dict[str, Any] = {}
        # one decision in explain_every is explained (next() on a count is atomic under the GIL)
        self._ticks = itertools.count()
        self._every_plan = config.reasons == "every"  # compact reasons in every plan
        self._waiting: dict[str, dict[str, Any]] = {}  # deployment -> reason -> gauge child
        self._waiting_lock = threading.Lock()
        #: the traffic recording (server.yaml ``record``), None without one
        self.recorder = recorder
        self._served: dict[int, tuple[Policy, str, dict[str, str]]] = {}  # id(policy) -> its name and params
        self._whatif_lock = threading.Lock()

    # ------------------------------------------------------------ decisions
    def _decide(self, request: pb.ScheduleRequest, t0: int, tenant: str = DEFAULT_TENANT) -> pb.ScheduleResponse:
        rec = self.recorder
        if rec is None:
            return self._decision(request, t0, tenant)
        return rec.while_deciding(self._decision, request, t0, tenant)  # its thread waits until the answer is out

    def _decision(self, request: pb.ScheduleRequest, t0: int, tenant: str) -> pb.ScheduleResponse:
        if isinstance(request, Undecodable):  # bytes that are no ScheduleRequest (handlers.py)
            raise request.error
        snap, profile = snapshot_from_pb(request.snapshot, max_requests=self._cfg.max_requests_per_snapshot)
        policy, deployment = self._deployments.resolve(request.policy, request.params)
        predictor = self._predictors.current(scoped_key(tenant, profile.key))
        every = self._cfg.explain_every
        sampled = every > 0 and next(self._ticks) % every == every - 1  # the N-th, 2N-th, ...
        full = sampled or request.explain  # asked for (`slidingserve explain --server`) or sampled
        explained = False
        if full or self._every_plan:
            plan, explained = _explained(policy, snap, predictor)
        else:
            plan = policy.plan(snap, predictor)
        # every explained plan carries the compact reasons; PlanReason messages only the
        # sampled and asked ones, as before the compact form (what older engines read)
        resp = pb.ScheduleResponse(request_id=request.request_id, plan=encode_plan(plan, snap.ids, full=full))
        if deployment:
            resp.plan.deployment = deployment
            counter = self._deployment_counters.get(deployment)
            if counter is None:  # names come from the operator's config: bounded
                counter = self._deployment_counters[deployment] = self._metrics.deployment_decisions.labels(deployment)
            counter.inc()
        if explained and sampled:  # the gauge follows the engines' own sampled plans only
            self._waiting_by_reason(plan, deployment)
        if self._shadow is not None:  # one queue put at most; the comparison runs elsewhere
            self._shadow.offer(snap, predictor, plan, deployment)
        if self.recorder is not None:  # one queue append; the recording is written elsewhere
            self._record(snap, tenant, request.snapshot.engine_id, policy, deployment)
        self.engines.seen(tenant, request.snapshot.engine_id, deployment)
        dt = perf_counter_ns() - t0
        resp.server_us = dt // 1000
        decisions, seconds = self._decision_metrics(plan.policy, plan.path)
        decisions.inc()
        seconds.observe(dt * 1e-9)
        return resp

    def _record(self, snap: Any, tenant: str, engine_id: str, policy: Policy, deployment: str) -> None:
        served = self._served.get(id(policy))
        if served is None or served[0] is not policy:  # policies are cached, immutable: named once
            served = self._served[id(policy)] = (policy, policy.name, params_text(policy))
            if len(self._served) > 1024:
                self._served.clear()
        assert self.recorder is not None
        self.recorder.offer(snap, scoped_key(tenant, engine_id), served[1], served[2], deployment)

    def _waiting_by_reason(self, plan: Plan, deployment: str) -> None:
        """``slidingserve_requests_waiting_by_reason`` of ``deployment`` from an explained plan:
        its counts, and 0 for the codes of the previous explained plan that are gone.
        Bounded: deployments come from the operator's config, codes are a fixed set."""
        counts = reason_counts(plan.reasons)
        with self._waiting_lock:
            children = self._waiting.setdefault(deployment, {})
            for code, child in children.items():
                if code not in counts:
                    child.set(0)
            for code, n in counts.items():
                child = children.get(code)
                if child is None:
                    child = children[code] = self._metrics.waiting_by_reason.labels(deployment, code)
                child.set(n)

    def _decision_metrics(self, policy: str, path: str) -> tuple[Any, Any]:
        """The decision counter and histogram children of (policy, path), looked up once:
        ``labels()`` validates and locks on every call.  Bounded: policies are registry
        names and paths a fixed set per policy."""
        key = (policy, path)
        children = self._metric_children.get(key)
        if children is None:
            children = (self._metrics.decisions.labels(policy, path),
                        self._metrics.decision_seconds.labels(policy))
            self._metric_children[key] = children
        return children

    def _check_ready(self, context: grpc.ServicerContext) -> None:
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is still loading")

    @rpc_errors()
    def Schedule(self, request: pb.ScheduleRequest, context: grpc.ServicerContext) -> pb.ScheduleResponse:
        return self._decide(request, perf_counter_ns(), tenant_of(context))

    def ScheduleStream(
        self, request_iterator: Iterator[pb.ScheduleRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ScheduleResponse]:
        self._check_ready(context)
        self._metrics.active_streams.inc()
        tenant = tenant_of(context)
        try:
            for request in request_iterator:
                t0 = perf_counter_ns()
                try:
                    resp = self._decide(request, t0, tenant)
                except Exception as e:  # answered in the stream, which stays open
                    resp = failure(e, self._metrics, "ScheduleStream", request.request_id).to_pb(request.request_id)
                yield resp
        finally:
            self._metrics.active_streams.dec()

    # -------------------------------------------------------------- reports
    @rpc_errors()
    def ReportIterations(
        self, request_iterator: Iterator[pb.IterationReport], context: grpc.ServicerContext
    ) -> pb.ReportSummary:
        summary = pb.ReportSummary()
        m = self._metrics
        tenant = tenant_of(context)
        for i, msg in enumerate(request_iterator):
            try:
                if isinstance(msg, Undecodable):
                    raise msg.error
                profile, x, scen, lat = report_from_pb(
                    msg, max_requests=self._cfg.max_requests_per_snapshot, field=f"report[{i}]"
                )
                key = scoped_key(tenant, profile.key)
                err = self._predictors.add(key, x, scen, lat, tenant=tenant)
                if self.recorder is not None:
                    self.recorder.offer_iteration(scoped_key(tenant, msg.engine_id), x, scen, lat)
            except ValidationError as e:  # a rejected report, counted; the call goes on
                summary.rejected += 1
                m.reports.labels("rejected").inc()
                if len(summary.rejection_reasons) < MAX_REASONS:
                    summary.rejection_reasons.append(clip(str(e), MAX_MESSAGE_BYTES))
                continue
            summary.accepted += 1
            m.reports.labels("accepted").inc()
            m.predictor_abs_error_ms.labels(key).observe(err)
            summary.predictor_version = self._predictors.current(key).version
        if summary.rejected:
            log.info("reports_rejected", rejected=summary.rejected, accepted=summary.accepted,
                     first=summary.rejection_reasons[0])
        return summary

    # ------------------------------------------------------------ metadata
    @rpc_errors(ready=False, log_rejected=False)
    def ListPolicies(self, request: pb.ListPoliciesRequest, context: grpc.ServicerContext) -> pb.ListPoliciesResponse:
        resp = pb.ListPoliciesResponse(default_policy=self._deployments.default)
        resp.policies.extend(describe_to_pb(registry.describe(n)) for n in registry.names())
        c = self._deployments.config
        if c is not None:  # the wire field keeps its pre-rename name (the proto is frozen)
            for name, d in sorted(c.deployments.items()):
                resp.versions.add(name=name, policy=d.policy, params=dict(d.params),
                                  policy_version=c.built[name].version)
            resp.shadow = c.shadow
            resp.config_digest = c.digest
        return resp

    def WhatIf(self, request: pb.WhatIfRequest, context: grpc.ServicerContext) -> pb.WhatIfResponse:
        """A what-if on the recording, in a process of its own (see the proto); one at a time."""
        self._check_ready(context)
        try:
            if isinstance(request, Undecodable):
                raise request.error
            args = whatif_args(request, tenant_of(context))
        except ValidationError as e:
            failure(e, self._metrics, "WhatIf", log_rejected=False).abort(context)
        recorder = self.recorder
        if recorder is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this service keeps no recording: set record: DIR in its server.yaml")
            raise AssertionError("context.abort raises")
        if not self._whatif_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "another what-if is running; try again when it ends")
        try:
            recorder.flush()
            code, text = run_child(self._cfg, args)
        finally:
            self._whatif_lock.release()
        if code is not None:
            context.abort(code, text)
        doc = json.loads(text)
        return pb.WhatIfResponse(result_json=text, table=str(doc.get("table", "")))

    @rpc_errors(ready=False, log_rejected=False)
    def GetPredictor(self, request: pb.GetPredictorRequest, context: grpc.ServicerContext) -> pb.GetPredictorResponse:
        # Which process answered: with several workers (workers.py) each has its own
        # predictors until the next board poll, so an operator can tell them apart.
        context.set_trailing_metadata(((WORKER_PID_KEY, str(os.getpid())),))
        profile = profile_from_pb(request.engine_profile, "engine_profile")
        key = scoped_key(tenant_of(context), profile.key)  # only the caller's tenant
        p = self._predictors.current(key)
        resp = pb.GetPredictorResponse(
            predictor_json=p.to_json(indent=None),
            version=p.version,
            profile_key=profile.key,
            sample_counts=predictor_sample_counts(p),
        )
        st = self._predictors.state(key)
        if st is not None:
            with st.lock:
                resp.reports_accepted = st.accepted
                resp.buffered_samples = len(st.window)
                resp.refits = st.refits
                resp.published = st.published
        return resp
