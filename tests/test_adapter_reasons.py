"""The adapter reads the plans that carry reasons: counts by reason (stats, the vLLM
adapter's metrics endpoint) and a DEBUG line per request whenever its reason changes."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import pytest

from benchmarks.snapshots import busy_snapshot
from engine_adapter.core import AdapterCore, AdapterSettings, IterationSample, ReasonLog
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.vllm.observe import collect_families
from engine_adapter.vllm.stats import AdapterStats
from scheduler_service.core import Plan, Snapshot, default_predictor, registry
from scheduler_service.core.reasons import CODES, plan_explained, reason_counts
from scheduler_service.wire.convert import plan_from_pb, plan_to_pb

LOGGER = "engine_adapter.reasons"


@pytest.fixture(scope="module")
def busy() -> Snapshot:
    return busy_snapshot(n_decode=48, n_queued=80, seed=4)


def _core(every: int) -> AdapterCore:
    s = AdapterSettings(policy="slidingserve", explain_every=every, report_inline=True)
    return AdapterCore(InProcessBackend(s, refit=False), s)


def _subset(snap: Snapshot, keep: int) -> Snapshot:
    data = json.loads(snap.to_json())
    data["requests"] = data["requests"][:keep]
    return Snapshot.from_json(data)


def test_the_in_process_planner_explains_one_plan_in_n(busy: Snapshot) -> None:
    s = AdapterSettings(explain_every=3)
    backend = InProcessBackend(s, refit=False)
    carried = [ReasonLog.carries(backend.schedule(busy, 1.0)) for _ in range(6)]
    assert carried == [False, False, True, False, False, True]
    never = InProcessBackend(AdapterSettings(explain_every=0), refit=False)
    assert not any(ReasonLog.carries(never.schedule(busy, 1.0)) for _ in range(4))
    backend.close()
    never.close()


def test_counts_and_one_debug_line_per_change(busy: Snapshot, caplog: pytest.LogCaptureFixture) -> None:
    core = _core(1)
    want = plan_explained(registry.create("slidingserve"), busy, default_predictor())
    counts = reason_counts(want.reasons)
    assert counts
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        d = core.decide(busy)
        assert d.source == "remote" and list(d.plan.reasons) == list(want.reasons)
        assert core.stats()["waiting_by_reason"] == counts
        lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert len(lines) == len(want.reasons)
        for r in want.reasons:  # grep <id> shows the request's reason
            mine = [line for line in lines if f"request {r.id} " in line]
            assert len(mine) == 1 and r.code in mine[0]
        caplog.clear()
        core.decide(busy)  # nothing changed: nothing logged
        assert [r for r in caplog.records if r.name == LOGGER] == []
        small = _subset(busy, 60)  # fewer requests: some served now, the rest gone
        plan = core.decide(small).plan
        assert plan is not None
        now = {r.id for r in plan.reasons}
        lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    served = [r.id for r in want.reasons if r.id in set(small.ids) and r.id not in now]
    assert served, "the smaller snapshot serves some request that waited"
    for rid in served:
        assert any(f"request {rid} served (was " in line for line in lines)
    assert set(core.reasons._last) == now  # finished ids are forgotten
    assert core.stats()["waiting_by_reason"] == reason_counts(plan.reasons)
    core.close()


def test_without_debug_nothing_is_tracked(busy: Snapshot, caplog: pytest.LogCaptureFixture) -> None:
    core = _core(1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        core.decide(busy)
    assert core.stats()["waiting_by_reason"] and core.reasons._last == {}
    assert [r for r in caplog.records if r.name == LOGGER] == []
    core.close()


class _Received:
    """A remote planner: the service's explained plan as the engine decodes it."""

    def __init__(self, every: int) -> None:
        self.policy = registry.create("sarathi")
        self.every, self.n = every, 0

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan:
        self.n += 1
        if self.n % self.every:
            return self.policy.plan(snapshot, default_predictor())
        return plan_from_pb(plan_to_pb(plan_explained(self.policy, snapshot, default_predictor())))

    def report(self, samples: Sequence[IterationSample]) -> None:
        pass

    def close(self) -> None:
        pass


def test_received_reasons_are_counted_and_exported(busy: Snapshot) -> None:
    core = AdapterCore(_Received(2), AdapterSettings(report_inline=True))
    core.decide(busy)
    assert core.stats()["waiting_by_reason"] == {} and core.reasons.explained == 0
    core.decide(busy)
    counts = reason_counts(plan_explained(registry.create("sarathi"), busy, default_predictor()).reasons)
    assert core.stats()["waiting_by_reason"] == counts and core.reasons.explained == 1
    stats = AdapterStats().as_dict(core.stats(), settings_reloads=0, settings_errors=0)
    fams = {f.name: f for f in collect_families(stats, {"policy": "sarathi"})}
    fam = fams["vllm:slidingserve_requests_waiting_by_reason"]
    assert fam.type == "gauge"
    got = {s.labels["reason"]: s.value for s in fam.samples}
    assert got == counts and set(got) <= set(CODES)
    core.close()
