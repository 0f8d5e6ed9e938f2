"""Simulated engine invariants on the real traces and the real ground truth, and the
adapter core's fallback paths.

The invariants are what make goodput numbers trustworthy: a simulator that
loses tokens, drops requests, runs its clock backwards or over-commits KV
would report goodput for an engine that cannot exist.  Fallback faults
(exceptions, deadline misses, invalid plans) cannot be produced with the real
backends on demand, so hand-written failing backends stand in for them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings, IterationSample
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import EngineConfig, SimResult, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from scheduler_service.core import Plan, Snapshot
from scheduler_service.core.plan import Allocation

KEY = DEFAULT_PROFILE


@pytest.fixture(scope="module", autouse=True)
def _quiet() -> None:
    quiet_logs()


def _run(policy: str, w: Workload, *, config: EngineConfig | None = None, profile: Any = None,
         backend: Any = None, settings: AdapterSettings | None = None,
         hook: Any = None) -> tuple[SimulatedEngine, SimResult, AdapterCore]:
    pred = profile_predictor(KEY)
    settings = settings or AdapterSettings(policy=policy, profile=KEY, report_inline=True)
    adapter = AdapterCore(backend or InProcessBackend(settings, pred), settings, pred)
    try:
        eng = SimulatedEngine(w, load_ground_truth(KEY), profile or PROFILES[KEY], adapter, config)
        eng.on_iteration = hook
        res = eng.run()
    finally:
        adapter.close()
    return eng, res, adapter


def _check_conservation(eng: SimulatedEngine, res: SimResult, w: Workload) -> None:
    done = eng.done
    # conservation of requests
    assert res.completed == int(done.sum())
    assert res.completed + int((~done).sum()) == len(w)
    # no token lost: each completed request emitted exactly its output length ...
    np.testing.assert_array_equal(eng.generated[done], w.output_tokens[done])
    # ... unfinished ones fewer, and the emitted total is the sum of what each request emitted
    assert np.all(eng.generated[~done] < w.output_tokens[~done])
    assert res.output_tokens == int(eng.generated.sum())
    # TTFT recorded exactly for the requests that produced a first token
    assert len(res.ttft_s) == int(np.count_nonzero(eng.generated > 0))
    assert np.all(res.ttft_s > 0)
    # scheduled (vLLM's prefill time counts from there) after arriving, before the first token
    started = ~np.isnan(eng.first_token)
    assert not np.isnan(eng.first_scheduled[started]).any()
    assert np.all(eng.first_scheduled[started] >= w.arrival[started] - 1e-9)
    assert np.all(eng.first_scheduled[started] < eng.first_token[started])
    # KV: nothing held by finished requests, never over capacity
    assert np.all(eng.blocks[done] == 0)
    assert res.max_kv_used_blocks <= res.kv_total_blocks


@pytest.mark.parametrize("policy", ["vllm-fcfs", "sarathi-edf", "qoserve", "slidingserve"])
def test_invariants_at_moderate_load(policy: str) -> None:
    w = make_workload("mixed-v1", 120, 2.5, seed=3)
    clocks: list[float] = []

    def hook(engine: SimulatedEngine, snap: Snapshot, decision: Any) -> None:
        clocks.append(snap.now)
        assert snap.free_kv_tokens >= 0
        assert engine.used_blocks <= engine.total_blocks

    eng, res, adapter = _run(policy, w, hook=hook)
    assert res.completed == len(w) and not res.stopped_early
    _check_conservation(eng, res, w)
    assert res.output_tokens == int(w.output_tokens.sum())
    assert len(clocks) >= res.iterations and np.all(np.diff(clocks) >= 0)
    assert adapter.fallback_total == 0 and adapter.remote_decisions == len(clocks)


def test_kv_capacity_under_overload_with_preemptions() -> None:
    """vllm-fcfs keeps no KV reserve for decodes: under overload with a small KV cache
    running decodes run out of blocks, get recompute-preempted, and still finish."""
    small = dataclasses.replace(PROFILES[KEY], gpu_memory_utilization=0.12)
    w = make_workload("mixed-v1", 80, 40.0, seed=1)
    used: list[int] = []

    def hook(engine: SimulatedEngine, snap: Snapshot, decision: Any) -> None:
        used.append(engine.used_blocks)

    eng, res, _ = _run("vllm-fcfs", w, profile=small, hook=hook)
    assert res.preemptions > 0
    assert res.completed == len(w)
    _check_conservation(eng, res, w)
    assert max(used) <= res.kv_total_blocks == small.kv_capacity_blocks
    assert res.max_kv_used_blocks <= res.kv_total_blocks


def test_conservation_when_stopped_early() -> None:
    w = make_workload("mixed-v1", 150, 30.0, seed=2)
    eng, res, _ = _run("sarathi-edf", w, config=EngineConfig(stop_violation_fraction=0.01))
    assert res.stopped_early and res.completed < len(w)
    _check_conservation(eng, res, w)
    assert res.violation_rate > 0.01


def test_same_seed_same_result() -> None:
    w1 = make_workload("mixed-v1", 80, 3.0, seed=5)
    w2 = make_workload("mixed-v1", 80, 3.0, seed=5)
    cfg = EngineConfig(noise_seed=5)
    _, a, _ = _run("slidingserve", w1, config=cfg)
    _, b, _ = _run("slidingserve", w2, config=cfg)
    assert (a.iterations, a.preemptions, a.completed, a.output_tokens) == (
        b.iterations, b.preemptions, b.completed, b.output_tokens)
    np.testing.assert_array_equal(a.violated, b.violated)
    np.testing.assert_array_equal(a.ttft_s, b.ttft_s)
    np.testing.assert_array_equal(a.tbt_s, b.tbt_s)
    assert a.sim_time_s == b.sim_time_s


# ------------------------------------------------------------- fallback paths
class _Faulty:
    """A backend that fails in one way for its first ``fail`` calls, then answers
    through a real in-process backend (so the circuit breaker can recover)."""

    def __init__(self, mode: str, fail: int, settings: AdapterSettings) -> None:
        self.mode = mode
        self.fail = fail
        self.calls = 0
        self.inner = InProcessBackend(settings, profile_predictor(KEY))

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan:
        self.calls += 1
        if self.calls <= self.fail:
            if self.mode == "raise":
                raise ConnectionError("scheduler unreachable")
            if self.mode == "slow":
                time.sleep(timeout_s)  # a client with a deadline gives up after it
                raise TimeoutError("deadline exceeded")
            if self.mode == "invalid":
                plan = self.inner.schedule(snapshot, timeout_s)
                bogus = (*plan.allocations, Allocation("no-such-request", 1))
                return dataclasses.replace(plan, allocations=bogus, token_budget=plan.token_budget + 1)
        return self.inner.schedule(snapshot, timeout_s)

    def report(self, samples: Sequence[IterationSample]) -> None:
        self.inner.report(samples)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("mode", "reason"), [("raise", "error"), ("slow", "deadline"),
                                              ("invalid", "invalid_plan")])
def test_fallback_paths_complete_every_request(mode: str, reason: str) -> None:
    settings = AdapterSettings(policy="slidingserve", profile=KEY, deadline_ms=2.0,
                               min_backoff_decisions=1, max_backoff_decisions=4)
    backend = _Faulty(mode, fail=25, settings=settings)
    w = make_workload("sharegpt", 40, 2.0, seed=4)
    eng, res, adapter = _run("slidingserve", w, backend=backend, settings=settings)
    assert res.completed == len(w)
    _check_conservation(eng, res, w)
    # every failure was counted under its reason, and only there
    assert adapter.fallbacks[reason] == backend.fail
    assert set(adapter.fallbacks) <= {reason, "circuit_open"}
    if reason != "invalid_plan":  # an invalid plan does not open the circuit
        assert adapter.fallbacks["circuit_open"] > 0
    # the breaker retried and recovered: the remote path served the rest
    assert backend.calls > backend.fail
    assert adapter.remote_decisions == backend.calls - backend.fail > 0
    assert res.paths.get("vllm-fcfs", 0) >= backend.fail  # the fallback policy's plans were executed
    assert adapter.remote_decisions + adapter.fallback_total == sum(res.paths.values())


def test_reports_lost_to_a_dead_service_are_counted() -> None:
    """Reports are best effort, but none vanishes uncounted: sent + dropped = reported."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = AdapterSettings(deadline_ms=50, report_batch=4)
    core = AdapterCore(GrpcBackend(f"127.0.0.1:{port}", settings), settings)
    try:
        for _ in range(10):
            core.report(IterationSample(np.array([1, 8]), np.array([10, 0]), 5.0))
        assert core.flush(10.0)
        st = core.stats()
    finally:
        core.close()
    assert st["reports_sent"] == 0 and st["reports_dropped"] == 10 and st["report_errors"] >= 1
