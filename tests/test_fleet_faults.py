"""A simulated engine on the production adapter core keeps serving through service faults.

Each test runs the simulated engine (real trace lengths, ground-truth GPU, outputs capped so
that a run takes a few seconds) with :class:`~engine_adapter.remote.GrpcBackend` against a real
server, injects one fault mid-run from the engine's iteration hook, lifts it where the fault
is transient, and checks:

* no request lost: every request of the workload finishes, each with exactly its output
  length, and the KV cache is empty at the end;
* the fault is visible where it should be: fallbacks counted under the right reason;
* recovery: remote decisions resume by themselves once the fault is gone.

The engine is paced (``SPEEDUP``× real time) so that a restart, a reconnect back-off or a
circuit back-off has wall time to play out in, as on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import make_workload
from engine_adapter.core import DECISION_BUCKETS, AdapterCore, AdapterSettings
from engine_adapter.faults import FaultyPolicy, ServiceProcess, TcpProxy
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import SimResult, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.sim.pacing import WallClockPacer
from scheduler_service.client import SchedulerClient
from scheduler_service.core import Snapshot
from scheduler_service.server import SchedulerServer
from tests.grpc_support import inject, make_server

pytestmark = pytest.mark.timeout(60)

PROFILE = PROFILES[DEFAULT_PROFILE]
#: Simulated seconds per wall second.
SPEEDUP = 10.0


@pytest.fixture(scope="module", autouse=True)
def _quiet() -> None:
    quiet_logs()


def _workload(n: int = 48, rate: float = 4.0, seed: int = 0, max_output: int = 64) -> Workload:
    w = make_workload("sharegpt", n, rate, seed=seed)
    return dataclasses.replace(w, output_tokens=np.minimum(w.output_tokens, max_output))


def _fast_reconnect(target: str) -> Callable[[], grpc.Channel]:
    """As the vLLM adapter configures it: find a restarted service within ~0.2 s, not gRPC's
    default back-off of up to 120 s."""
    opts = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 200)]
    return lambda: grpc.insecure_channel(target, options=opts)


@dataclasses.dataclass
class Run:
    engine: SimulatedEngine
    result: SimResult
    adapter: AdapterCore
    workload: Workload
    #: adapter.stats() taken right after each action ran, by its label.
    marks: dict[str, dict[str, Any]]

    def remote_between(self, a: str, b: str | None = None) -> int:
        end = self.adapter.stats() if b is None else self.marks[b]
        return int(end["remote_decisions"] - self.marks[a]["remote_decisions"])

    def fallbacks_between(self, a: str, b: str | None = None) -> dict[str, int]:
        end = self.adapter.stats() if b is None else self.marks[b]
        return {k: v - self.marks[a]["fallbacks"].get(k, 0) for k, v in end["fallbacks"].items()
                if v - self.marks[a]["fallbacks"].get(k, 0)}


def run_engine(target: str, actions: dict[int, tuple[str, Callable[[], object]]], *, workload: Workload | None = None,
               policy: str = "slidingserve", deadline_ms: float = 500.0, **settings: Any) -> Run:
    """Run one paced engine to the end; ``actions[k] = (label, fn)`` runs fn at iteration k."""
    w = workload or _workload()
    pred = profile_predictor(DEFAULT_PROFILE)
    s = AdapterSettings(policy=policy, profile=PROFILE.key, deadline_ms=deadline_ms, engine_id="fault-test",
                        max_backoff_decisions=8, **settings)
    adapter = AdapterCore(GrpcBackend(target, s, channel_factory=_fast_reconnect(target)), s, pred)
    engine = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILE, adapter)
    marks: dict[str, dict[str, Any]] = {}
    k = 0
    pacer = WallClockPacer(SPEEDUP)

    def hook(eng: SimulatedEngine, snap: Any, _decision: Any) -> None:
        nonlocal k
        k += 1
        if k in actions:
            label, fn = actions[k]
            fn()
            marks[label] = adapter.stats()
            pacer.restart()  # an action may block: pace from here on
        pacer.wait(snap.now)

    engine.on_iteration = hook
    try:
        result = engine.run()
    finally:
        adapter.flush(2.0)
        adapter.close()
    assert set(marks) == {label for label, _ in actions.values()}, "the run ended before every fault ran"
    return Run(engine, result, adapter, w, marks)


def assert_nothing_lost(run: Run) -> None:
    w, eng, res = run.workload, run.engine, run.result
    assert res.completed == len(w) and eng.done.all()
    np.testing.assert_array_equal(eng.generated, w.output_tokens)  # every token, exactly once
    assert res.output_tokens == int(w.output_tokens.sum())
    assert eng.used_blocks == 0 and not eng.blocks.any()  # KV fully released
    assert not res.stopped_early


@pytest.fixture
def server() -> Iterator[SchedulerServer]:
    with make_server() as srv:
        yield srv


# ------------------------------------------------------------------ process faults
def test_service_killed_mid_run_engine_finishes_on_fallback(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path).start()
    try:
        run = run_engine(svc.target, {40: ("kill", svc.kill)})
    finally:
        svc.stop()
    assert_nothing_lost(run)
    assert run.marks["kill"]["remote_decisions"] >= 30  # it was serving before
    assert run.remote_between("kill") == 0  # nothing remote after the kill
    fb = run.fallbacks_between("kill")
    assert fb.get("error", 0) >= 1  # UNAVAILABLE
    # the circuit keeps a dead service from costing a failed call every iteration
    assert fb.get("circuit_open", 0) > 3 * fb.get("error", 0)
    assert "UNAVAILABLE" in run.adapter.last_error


def test_service_restarted_on_the_same_port_decisions_resume(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path).start()
    try:
        run = run_engine(svc.target, {40: ("kill", svc.kill), 150: ("restart", svc.start)})
        with SchedulerClient(svc.target, timeout_s=5.0) as c:
            after = c.get_predictor(PROFILE.key)
    finally:
        svc.stop()
    assert_nothing_lost(run)
    assert svc.starts == 2
    assert run.remote_between("kill", "restart") == 0
    assert run.fallbacks_between("kill", "restart").get("error", 0) >= 1
    assert run.remote_between("restart") >= 100  # remote again, without any help
    assert after.reports_accepted > 0  # the restarted service gets the engine's reports too


# ------------------------------------------------------------------ network faults
def test_slow_service_falls_back_on_deadline_then_recovers(server: SchedulerServer) -> None:
    with TcpProxy(server.target) as proxy:
        def slow() -> None:
            proxy.delay_s = 0.06  # each way: replies arrive ~120 ms after the request

        def fast() -> None:
            proxy.delay_s = 0.0

        run = run_engine(proxy.target, {30: ("slow", slow), 110: ("fast", fast)}, deadline_ms=50)
    assert_nothing_lost(run)
    assert run.remote_between("slow", "fast") == 0
    fb = run.fallbacks_between("slow", "fast")
    assert fb.get("deadline", 0) >= 3 and fb.get("error", 0) == 0
    assert run.remote_between("fast") >= 100
    # the engine-side decision-time histogram: every call to the service is in it, and each
    # late answer at the deadline it waited out (50 ms; the buckets from 20 ms up)
    end = run.adapter.stats()
    calls = end["remote_decisions"] + sum(n for r, n in end["fallbacks"].items() if r != "circuit_open")
    assert sum(end["decision_counts"]) == calls
    late = [b - a for a, b in zip(run.marks["slow"]["decision_counts"], run.marks["fast"]["decision_counts"],
                                  strict=True)]
    assert sum(late[DECISION_BUCKETS.index(0.02) + 1:]) >= fb["deadline"]


def test_a_decision_taken_ahead_is_late_only_when_the_engine_needs_it(server: SchedulerServer) -> None:
    """The pipelined adapter asks for the next plan while the running step has ``grace_s``
    to go: an answer that takes longer than the deadline but arrives before the step ends
    is on time.  The network here is slowed (~40 ms round trip) past a 15 ms deadline."""
    import json

    snap = Snapshot.from_json(json.loads((Path(__file__).parents[1] / "deploy/examples/snapshot.json").read_text()))
    with TcpProxy(server.target) as proxy:
        s = AdapterSettings(policy="slidingserve", profile=PROFILE.key, deadline_ms=15.0, engine_id="grace-test",
                            min_backoff_decisions=0, max_backoff_decisions=0)
        adapter = AdapterCore(GrpcBackend(proxy.target, s, channel_factory=_fast_reconnect(proxy.target)), s)
        try:
            assert adapter.decide(snap, grace_s=5.0).source == "remote"  # connects (no delay yet)
            proxy.delay_s = 0.02
            late = adapter.decide(snap)
            ahead = adapter.decide(snap, grace_s=0.5)  # the step has 0.5 s to go
        finally:
            adapter.close()
    assert (late.source, late.reason) == ("fallback", "deadline")  # the local fallback policy decided
    assert ahead.source == "remote" and ahead.plan is not None and ahead.elapsed_us > 15_000


def test_network_cut_and_restored(server: SchedulerServer) -> None:
    with TcpProxy(server.target) as proxy:
        run = run_engine(proxy.target, {40: ("cut", proxy.cut), 150: ("restore", proxy.restore)})
        accepted = proxy.accepted
    assert_nothing_lost(run)
    assert run.remote_between("cut", "restore") == 0
    fb = run.fallbacks_between("cut", "restore")
    assert fb.get("error", 0) >= 1 and fb.get("circuit_open", 0) >= 1
    assert run.remote_between("restore") >= 100
    assert accepted >= 2  # the engine reconnected through the restored relay


def test_report_backlog_overflows_while_the_network_is_down(server: SchedulerServer) -> None:
    with TcpProxy(server.target) as proxy:
        run = run_engine(proxy.target, {20: ("cut", proxy.cut), 300: ("restore", proxy.restore)},
                         report_queue=8, report_batch=4)
    assert_nothing_lost(run)
    restore, end = run.marks["restore"], run.adapter.stats()
    assert restore["reports_dropped"] > 50  # the queue holds 8; the rest were dropped, not buffered
    assert restore["report_errors"] >= 1
    assert end["reports_sent"] > restore["reports_sent"]  # shipping resumed
    assert run.remote_between("restore") >= 100  # decisions never waited on reports


# ------------------------------------------------------------------ service-side faults
def test_service_errors_counted_as_error_then_recover(server: SchedulerServer) -> None:
    policy = FaultyPolicy()
    inject(server, policy)  # type: ignore[arg-type]

    def mode(m: str) -> Callable[[], None]:
        return lambda: setattr(policy, "mode", m)

    run = run_engine(server.target, {30: ("error", mode("error")), 110: ("ok", mode("ok"))}, policy=policy.name)
    assert_nothing_lost(run)
    assert policy.calls["error"] >= 2
    fb = run.fallbacks_between("error", "ok")
    # every call in the error window failed and was counted as "error", nothing else
    assert fb == {"error": policy.calls["error"], "circuit_open": fb["circuit_open"]}
    assert "INTERNAL" in run.marks["ok"]["last_error"]
    assert "injected" not in run.marks["ok"]["last_error"]  # the servicer does not leak internals
    assert run.remote_between("ok") >= 100


@pytest.mark.parametrize("fault,message", [("unknown_id", "unknown request 'not-a-request'"),
                                           ("over_budget", "exceed max_batch_tokens")])
def test_invalid_plans_rejected_and_counted(server: SchedulerServer, fault: str, message: str) -> None:
    policy = FaultyPolicy()
    inject(server, policy)  # type: ignore[arg-type]

    def mode(m: str) -> Callable[[], None]:
        return lambda: setattr(policy, "mode", m)

    run = run_engine(server.target, {30: ("bad", mode(fault)), 90: ("ok", mode("ok"))}, policy=policy.name)
    assert_nothing_lost(run)
    fb = run.fallbacks_between("bad", "ok")
    # an invalid plan is rejected every time, and does not open the circuit (the service is up)
    assert fb == {"invalid_plan": policy.calls[fault]}
    assert fb["invalid_plan"] >= 50
    assert message in run.marks["ok"]["last_error"]
    assert run.remote_between("ok") >= 100
