"""The adapter on vLLM's real schedulers, policy in-process: requests complete, tokens are
conserved, no KV leaks, valid plans are executed exactly, reports carry the step times."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler

from .support import (
    Driver,
    FakeClock,
    build_scheduler,
    check_prepared_fits,
    make_request,
    scheduler_class,
    workload,
)

CASES = [(RemoteSyncScheduler, False), (RemoteScheduler, True)]


def _run(base: type, async_: bool, mdir: str, policy: str, *, n: int = 80, num_blocks: int = 400,
         seed: int = 0, on_build: Callable[[Any], None] | None = None) -> tuple[Any, Any, list[Any], Driver, int]:
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_DEPLOYMENT": policy}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=num_blocks)
    if on_build is not None:
        on_build(s)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    reqs = [make_request(p, o, extra_args={"slo_ttft_ms": 400, "slo_tbt_ms": 60, "slo_protected": i % 7 == 0})
            for i, (p, o) in enumerate(workload(n, seed))]
    for r in reqs:
        s.add_request(r)
    samples: list[Any] = []
    d = Driver(s, clock, async_scheduling=async_, seed=seed)

    def hook(k: int, so: Any) -> None:
        if k == 0:  # the core exists after the first schedule(); record what it is given
            core = s._ss_live.core
            orig = core.report
            core.report = lambda smp: (samples.append(smp), orig(smp))
    res = d.run(on_step=hook)
    return s, res, samples, d, free0


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["slidingserve", "vllm-fcfs"])
@pytest.mark.parametrize("num_blocks", [400, 90], ids=["roomy", "kv-pressure"])
def test_plans_honoured_and_invariants(base: type, async_: bool, policy: str, num_blocks: int, mdir: str) -> None:
    s, res, samples, _, free0 = _run(base, async_, mdir, policy, num_blocks=num_blocks)
    st = s.slidingserve_stats()
    # every request completed with exactly its max_tokens (under KV pressure too)
    assert sorted(res.finished.values()) == sorted(o for _, o in workload(80, 0))
    assert not s.requests and not s.running and not s.waiting
    # no KV leak
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    # plans executed exactly whenever one was executed
    assert st["planned"] > 0.8 * st["iterations"], st
    assert st["deviating_iterations"] == 0, st
    assert set(st["fallbacks"]) <= {"unallocatable", "kv_pressure", "empty_plan"}, st
    if num_blocks == 90:
        assert res.preempted or st["fallbacks"] or st["trimmed_admissions"]
        assert st["resyncs"] > 0  # KV tight and requests finished: the pending plan is redone
    assert st["pipelined"] > 0.5 * st["iterations"], st
    # reports: one per executed step after the first, with the ground-truth step time
    assert st["core"]["remote_decisions"] >= st["planned"]
    lat = [x.latency_ms for x in samples]
    assert lat == pytest.approx(res.step_ms[1:len(lat) + 1], rel=1e-6)
    assert len(lat) >= len(res.step_ms) - 2
    for smp in samples:
        assert smp.c.shape == smp.u.shape and (smp.c >= 1).all() and (smp.u >= 0).all()
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [400, 90], ids=["roomy", "kv-pressure"])
def test_a_fit_prepared_ahead_is_the_one_the_step_would_make(base: type, async_: bool, num_blocks: int,
                                                             mdir: str) -> None:
    """A decision taken in the background is fitted to vLLM there, on the KV state its view
    projects; wherever the step keeps that fit, it is the fit the step would have made on
    vLLM's state then (its prefix hits looked up again)."""
    seen: dict[str, int] = {}
    s, res, _, _, _ = _run(base, async_, mdir, "slidingserve", num_blocks=num_blocks, on_build=lambda s: check_prepared_fits(s, seen))
    st = s.slidingserve_stats()
    assert sorted(res.finished.values()) == sorted(o for _, o in workload(80, 0))
    assert st["deviating_iterations"] == 0, st
    assert seen.get("reused", 0) > 0.2 * st["pipelined"] and st["prefitted"] == seen["reused"], (seen, st)
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_tokens_conserved(base: type, async_: bool, mdir: str) -> None:
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=800)
    spec = workload(40, 3)
    reqs = [make_request(p, o) for p, o in spec]
    for r in reqs:
        s.add_request(r)
    res = Driver(s, clock, async_scheduling=async_).run()
    assert not res.preempted
    for r, (p, o) in zip(reqs, spec, strict=True):
        assert res.finished[r.request_id] == o
        assert res.scheduled[r.request_id] == p + o - 1
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_unplanned_requests_wait_and_native_order_is_restored(base: type, async_: bool, mdir: str) -> None:
    """A plan that serves one request only: vLLM schedules exactly that; the queues keep
    vLLM's own order for later native iterations."""
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "vllm-fcfs"})
    s = build_scheduler(cls, mdir, async_scheduling=async_)
    reqs = [make_request(40, 4) for _ in range(5)]
    for r in reqs:
        s.add_request(r)
    order = [r.request_id for r in s.waiting]
    core = s._core()
    from scheduler_service.core import Allocation, Plan

    def plan_last(snap: Any, timeout_s: float) -> Plan:
        rid = snap.ids[-1]
        return Plan("t", "1", "p", "t", 7, 0.0, (Allocation(rid, 7),))

    core.backend.schedule = plan_last  # type: ignore[method-assign]
    so = s.schedule()
    assert dict(so.num_scheduled_tokens) == {reqs[-1].request_id: 7}
    assert [r.request_id for r in s.waiting] == order[:-1]
    assert [r.request_id for r in s.running] == [reqs[-1].request_id]
    s.slidingserve_close()


def test_snapshot_mapping_and_slos(mdir: str) -> None:
    from engine_adapter.vllm.snapshot import SloDefaults, request_slo

    d = SloDefaults(ttft_s=0.0, tbt_s=0.05)
    assert request_slo({"slo_ttft_ms": 200, "slo_tbt_ms": 40, "slo_protected": 1}, 100, d).protected
    assert request_slo({"slo_ttft_ms": 200}, 100, d).ttft_s == pytest.approx(0.2)
    assert request_slo(None, 1000, d).ttft_s == pytest.approx(0.3 + 0.15)
    assert request_slo({"slo": {"ttft_ms": 100, "tbt_ms": 10}}, 1, d).tbt_s == pytest.approx(0.01)
    bad = request_slo({"slo_ttft_ms": "x", "slo_tbt_ms": -1}, 0, d)
    assert bad.ttft_s == pytest.approx(0.3) and bad.tbt_s == pytest.approx(0.05)

    cls = scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_DEFAULT_TBT_MS": "80"})
    s = build_scheduler(cls, mdir, async_scheduling=False)
    a, b = make_request(50, 5, extra_args={"slo_ttft_ms": 250}), make_request(30, 5)
    s.add_request(a)
    s.add_request(b)
    snap, _, free_blocks = s._snapshot()
    assert list(snap.ids) == [a.request_id, b.request_id]
    assert np.allclose(snap.ttft_slo, [0.25, 0.3 + 0.15 * 30 / 1000]) and np.allclose(snap.tbt_slo, 0.08)
    assert list(snap.prompt_tokens) == [50, 30] and list(snap.computed_tokens) == [0, 0]
    assert snap.free_kv_tokens == free_blocks * 16
    assert snap.profile.endswith("|tp1") and snap.profile.startswith("tiny-llama|")
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_pipelined_snapshot_matches_the_queues_it_predicts(base: type, async_: bool, mdir: str) -> None:
    """The snapshot taken at the end of schedule() for the next one (pipelining) is the
    snapshot the next schedule() would take itself, except for requests that finished
    or arrived in between; arrivals that the plan leaves room for trigger a fresh decision."""
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    spec = workload(40, 5, max_out=40)
    for p, o in spec[:8]:
        s.add_request(make_request(p, o))
    late = iter(spec[8:])
    checked = {"rows": 0, "steps": 0}
    orig = s._decide

    def checking_decide() -> Any:
        pending = s._ss_pipe.pending
        if pending is not None:
            done = pending.future.result()
            assert done is not None
            fresh = s._view().snap
            old = done[0].snap
            for i, rid in enumerate(old.ids):
                j = fresh.index_of.get(rid)
                if j is None:  # finished in update_from_output
                    assert rid not in s.requests or s.requests[rid].is_finished(), rid
                    continue
                row_old = (old.prompt_tokens[i], old.computed_tokens[i], old.output_tokens[i])
                row_new = (fresh.prompt_tokens[j], fresh.computed_tokens[j], fresh.output_tokens[j])
                assert row_old == row_new, (rid, row_old, row_new)
                checked["rows"] += 1
            arrived = {r.request_id for r in s._ss_pipe.arrivals}
            assert set(fresh.ids) - set(old.ids) <= arrived
            checked["steps"] += 1
        return orig()

    s._decide = checking_decide  # type: ignore[method-assign]

    def add_late(k: int, so: Any) -> None:
        if k % 2 == 0:
            nxt = next(late, None)
            if nxt is not None:
                s.add_request(make_request(*nxt))

    res = Driver(s, clock, async_scheduling=async_).run(on_step=add_late)
    st = s.slidingserve_stats()
    assert sorted(res.finished.values()) == sorted(o for _, o in spec)
    assert checked["steps"] > 20 and checked["rows"] > 100, checked
    assert st["pipelined"] + st["resyncs"] >= checked["steps"] and st["pipelined"] > 0, st
    assert st["deviating_iterations"] == 0, st
    assert st["resyncs"] > 0, st
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_pipeline_off_decides_synchronously(base: type, async_: bool, mdir: str) -> None:
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve", "SLIDINGSERVE_PIPELINE": "off"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    spec = workload(30, 2)
    for p, o in spec:
        s.add_request(make_request(p, o))
    res = Driver(s, clock, async_scheduling=async_).run()
    st = s.slidingserve_stats()
    assert sorted(res.finished.values()) == sorted(o for _, o in spec)
    assert st["pipelined"] == 0 and st["planned"] > 0.8 * st["iterations"] and st["deviating_iterations"] == 0
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_requests_aborted_between_steps_leave_the_pending_plan(base: type, async_: bool, mdir: str) -> None:
    """Aborts (like stop strings) end requests after the next plan was decided: they are
    dropped from it, never scheduled again, and everything else completes exactly."""
    from vllm.v1.request import RequestStatus

    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    spec = workload(30, 9, max_out=30)
    reqs = [make_request(p, o) for p, o in spec]
    for r in reqs:
        s.add_request(r)
    aborted: list[str] = []

    def abort_some(k: int, so: Any) -> None:
        for rid in aborted:  # nothing scheduled for a request after its abort
            assert rid not in so.num_scheduled_tokens
        if k in (5, 9, 13) and s.running:
            victim = s.running[len(s.running) // 2].request_id
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)

    res = Driver(s, clock, async_scheduling=async_).run(on_step=abort_some)
    st = s.slidingserve_stats()
    assert len(aborted) == 3
    for r, (_, o) in zip(reqs, spec, strict=True):
        if r.request_id not in aborted:
            assert res.finished[r.request_id] == o
    assert not s.requests and st["deviating_iterations"] == 0 and st["pipelined"] > 0, st
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_observe_records_vllms_own_scheduling(base: type, async_: bool, mdir: str, tmp_path: Any) -> None:
    """``SLIDINGSERVE_OBSERVE``: vLLM schedules every iteration itself; the recording holds
    every request with its prompt and output length, and the iterations' costs."""
    from scheduler_service.recording import read_recording

    clock = FakeClock()
    env = {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_OBSERVE": "true", "SLIDINGSERVE_RECORD": str(tmp_path)}
    cls = scheduler_class(base, env, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    spec = workload(30, 5)
    for p, o in spec:
        s.add_request(make_request(p, o))
    res = Driver(s, clock, async_scheduling=async_).run()
    st = s.slidingserve_stats()
    assert sorted(res.finished.values()) == sorted(o for _, o in spec)
    assert st["planned"] == 0 and st["native"] == st["iterations"] and not st["fallbacks"], st
    s.slidingserve_close()
    rec = read_recording(tmp_path)
    assert rec.policies == {"vllm": len(spec)}
    assert sorted(rec.requests["output"].astype(int)) == sorted(o for _, o in spec)
    assert sorted(rec.requests["prompt"].astype(int)) == sorted(p for p, _ in spec)
    assert len(rec.latency_ms) >= len(res.step_ms) - 2
