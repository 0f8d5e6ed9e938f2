"""The adapter talking to a real scheduling service over gRPC on loopback: remote plans
executed exactly; the service killed, restarted on the same port, slow, or returning
invalid plans — the engine keeps serving on vLLM's native scheduling, loses nothing and
goes back to remote decisions by itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
from scheduler_service.core import Allocation, BatchLatencyPredictor, Plan, Snapshot
from tests.grpc_support import InjectedPolicy, inject, make_server

from .support import Driver, FakeClock, build_scheduler, make_request, scheduler_class, workload

CASES = [(RemoteSyncScheduler, False), (RemoteScheduler, True)]


def _engine(base: type, async_: bool, mdir: str, target: str, n: int, *, policy: str = "slidingserve",
            deadline_ms: float = 200.0, seed: int = 0, max_out: int = 24, **env: str) -> tuple[Any, Driver, int]:
    clock = FakeClock()
    e = {"SLIDINGSERVE_ADDRESS": target, "SLIDINGSERVE_DEPLOYMENT": policy,
         "SLIDINGSERVE_DEADLINE_MS": str(deadline_ms), "SLIDINGSERVE_RECONNECT_MAX_MS": "200",
         "SLIDINGSERVE_MAX_BACKOFF_DECISIONS": "8", **env}
    s = build_scheduler(scheduler_class(base, e, clock), mdir, async_scheduling=async_, num_blocks=400)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    for p, o in workload(n, seed, max_out=max_out):
        s.add_request(make_request(p, o))
    return s, Driver(s, clock, async_scheduling=async_, seed=seed, wall_ms=2.0), free0


def _done(s: Any, res: Any, n: int, free0: int) -> None:
    assert len(res.finished) == n
    assert not s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free0


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_remote_plans_executed_exactly(base: type, async_: bool, mdir: str) -> None:
    with make_server() as srv:
        s, d, free0 = _engine(base, async_, mdir, srv.target, 60, deadline_ms=2000)
        res = d.run()
        st = s.slidingserve_stats()
        s.slidingserve_close()
    _done(s, res, 60, free0)
    assert st["core"]["remote_decisions"] >= st["planned"] > 0.8 * st["iterations"]
    assert st["deviating_iterations"] == 0
    assert set(st["fallbacks"]) <= {"unallocatable", "kv_pressure", "empty_plan"}


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_service_killed_then_restarted_on_the_same_port(base: type, async_: bool, mdir: str) -> None:
    srv = make_server().start()
    port = srv.port
    s, d, free0 = _engine(base, async_, mdir, srv.target, 150, max_out=60)
    marks: dict[str, Any] = {}

    def on_step(k: int, so: Any) -> None:
        nonlocal srv
        if k == 30:
            srv.stop(grace=0)
            marks["kill"] = s.slidingserve_stats()["core"]["remote_decisions"]
        if k == 130:
            marks["down"] = s.slidingserve_stats()
            srv = make_server(port=port).start()
            marks["restart"] = s.slidingserve_stats()["core"]["remote_decisions"]

    try:
        res = d.run(on_step=on_step)
        st = s.slidingserve_stats()
    finally:
        s.slidingserve_close()
        srv.stop(grace=0)
    _done(s, res, 150, free0)
    down = marks["down"]
    assert down["core"]["remote_decisions"] == marks["kill"]  # nothing remote while it was down
    assert set(down["fallbacks"]) & {"error", "circuit_open", "deadline"}
    assert st["core"]["remote_decisions"] > marks["restart"] + 10  # decisions resumed by themselves


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_slow_service_falls_back_on_deadline(base: type, async_: bool, mdir: str) -> None:
    with make_server() as srv:
        inject(srv, InjectedPolicy(name="slow", delay_s=0.05))
        s, d, free0 = _engine(base, async_, mdir, srv.target, 30, policy="slow", deadline_ms=10)
        res = d.run()
        st = s.slidingserve_stats()
        s.slidingserve_close()
    _done(s, res, 30, free0)
    assert st["fallbacks"].get("deadline", 0) >= 1
    assert st["core"]["remote_decisions"] == 0
    assert st["native"] >= st["fallback_total"]


@dataclass(frozen=True)
class OverAllocating:
    """Gives every request one token more than it may take: never valid."""

    name: str = "overalloc"
    version: str = "test"
    params: Any = None

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
        need = [1 if d else int(r) for d, r in zip(snapshot.is_decoding, snapshot.remaining_prefill, strict=True)]
        allocs = tuple(Allocation(i, n + 1) for i, n in zip(snapshot.ids, need, strict=True))[:4]
        return Plan(self.name, self.version, predictor.version, "x", sum(a.tokens for a in allocs), 0.0, allocs)


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_invalid_plans_rejected_and_counted(base: type, async_: bool, mdir: str) -> None:
    with make_server() as srv:
        inject(srv, OverAllocating())  # type: ignore[arg-type]
        s, d, free0 = _engine(base, async_, mdir, srv.target, 20, policy="overalloc")
        res = d.run()
        st = s.slidingserve_stats()
        s.slidingserve_close()
    _done(s, res, 20, free0)
    assert st["planned"] == 0 and st["fallbacks"]["invalid_plan"] >= 5
    assert "gets" in st["core"]["last_error"]


def test_engines_follow_the_default_version_or_pin_one(mdir: str, tmp_path: Any) -> None:
    """SLIDINGSERVE_DEPLOYMENT=default follows the service's default version; a version name pins
    it; the adapter's settings file switches between them without a restart."""
    import json

    conf = tmp_path / "policies.json"
    conf.write_text(json.dumps({"default": "v2", "versions": {
        "v1": {"policy": "vllm-fcfs"}, "v2": {"policy": "slidingserve", "params": {"window": 1}}}}))
    settings = tmp_path / "adapter.yaml"
    settings.write_text("policy: default\n")
    with make_server(policy_config=str(conf)) as srv:
        s, d, free0 = _engine(RemoteSyncScheduler, False, mdir, srv.target, 60, deadline_ms=2000,
                              SLIDINGSERVE_CONFIG=str(settings))
        s._ss_live.watcher.period_s = 0

        def by_version(v: str) -> float:
            return srv.metrics.registry.get_sample_value("slidingserve_deployment_decisions_total",
                                                         {"deployment": v}) or 0

        marks: dict[str, float] = {}

        def on_step(k: int, _so: Any) -> None:
            if k == 15:
                marks["v2"] = by_version("v2")
                settings.write_text("policy: v1\n")  # pin v1 from now on
            if k == 16:
                marks["v1_at_switch"] = by_version("v1")

        res = d.run(on_step=on_step)
        st = s.slidingserve_stats()
        s.slidingserve_close()
    _done(s, res, 60, free0)
    assert marks["v2"] >= 10 and by_version("v2") <= marks["v2"] + 2  # pipelined decisions in flight
    assert by_version("v1") > marks["v1_at_switch"] + 10
    assert st["settings_reloads"] == 1 and st["policy"] == "v1" and st["deviating_iterations"] == 0
