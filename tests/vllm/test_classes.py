"""Request classes in the vLLM adapter: vLLM's own ``Request.priority`` and the class table
(``SLIDINGSERVE_SLO_CLASSES``) reach the snapshot, on real vLLM request objects."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
from engine_adapter.vllm.observe import collect_families
from engine_adapter.vllm.settings import SettingsError, VllmAdapterSettings, parse_slo_classes
from engine_adapter.vllm.snapshot import ClassSlo, SloDefaults, SnapshotBuilder, request_slo

from .support import Driver, FakeClock, build_scheduler, make_request, scheduler_class

TABLE = '{"0": {"ttft_ms": 400, "tbt_ms": 40}, "2": {"ttft_ms": 4000, "tbt_ms": 100, "sheddable": true}}'


def test_class_table_parses_from_env_and_file_mapping() -> None:
    s = VllmAdapterSettings.from_env({"SLIDINGSERVE_SLO_CLASSES": TABLE})
    assert parse_slo_classes(s.slo_classes) == {
        0: ClassSlo(0.4, 0.04, False), 2: ClassSlo(4.0, 0.1, True)}
    assert parse_slo_classes("") == {}


@pytest.mark.parametrize(("text", "msg"), [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"high": {}}', "integer priority"),
    ('{"1": {"ttft": 5}}', "keys from"),
    ('{"1": {"ttft_ms": -5}}', "ttft_ms must be a number"),
    ('{"1": {"tbt_ms": true}}', "tbt_ms must be a number"),
    ('{"1": {"sheddable": "yes"}}', "sheddable must be true or false"),
])
def test_bad_class_tables_fail_with_the_setting_named(text: str, msg: str) -> None:
    with pytest.raises(SettingsError, match=msg) as e:
        VllmAdapterSettings.from_env({"SLIDINGSERVE_SLO_CLASSES": text})
    assert "SLIDINGSERVE_SLO_CLASSES" in str(e.value)


def test_request_slo_precedence() -> None:
    d = SloDefaults(ttft_s=1.0, tbt_s=0.05, classes=parse_slo_classes(TABLE))
    # the class table for the request's priority ...
    assert request_slo(None, 100, d, priority=2) == request_slo({}, 100, d, priority=2)
    r = request_slo(None, 100, d, priority=2)
    assert (r.ttft_s, r.tbt_s, r.priority, r.sheddable) == (4.0, 0.1, 2, True)
    # ... its own extra_args win ...
    r = request_slo({"slo_ttft_ms": 900, "slo_sheddable": False}, 100, d, priority=2)
    assert (r.ttft_s, r.tbt_s, r.sheddable) == (0.9, 0.1, False)
    # ... and a priority outside the table gets the defaults
    r = request_slo({"slo": {"sheddable": True}}, 100, d, priority=7)
    assert (r.ttft_s, r.tbt_s, r.priority, r.sheddable) == (1.0, 0.05, 7, True)


def test_snapshot_carries_vllm_priority_and_class() -> None:
    b = SnapshotBuilder(SloDefaults(classes=parse_slo_classes(TABLE)), profile="")
    reqs = [make_request(64, 8, priority=2), make_request(64, 8), make_request(64, 8, priority=-3),
            make_request(64, 8, priority=2, extra_args={"slo_sheddable": False})]
    snap, rows = b.build([], reqs, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000)
    assert rows == reqs
    assert snap.priority.tolist() == [2, 0, -3, 2]
    assert snap.sheddable.tolist() == [True, False, False, False]
    assert snap.ttft_slo.tolist()[:2] == [4.0, 0.4]
    assert snap.tbt_slo.tolist()[:3] == [0.1, 0.04, 0.05]


# ------------------------------------------------------------------ shedding
CASES = [(RemoteSyncScheduler, False), (RemoteScheduler, True)]


def _run_keeping_final_outputs(s: Any, clock: FakeClock, async_: bool) -> tuple[Any, dict[str, Any]]:
    """Drive ``s`` to the end; the run's result and every request's final output, as its
    client receives it."""
    outs: list[Any] = []
    orig = s.update_from_output

    def spy(so: Any, out: Any) -> Any:
        eco = orig(so, out)
        outs.extend(o for v in eco.values() for o in v.outputs)
        return eco
    s.update_from_output = spy
    res = Driver(s, clock, async_scheduling=async_).run()
    return res, {o.request_id: o for o in outs if o.finish_reason is not None}


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_rejected_requests_finish_with_a_clear_reason_and_free_their_kv(base: type, async_: bool,
                                                                         mdir: str) -> None:
    """SlidingServe (in process) rejects the sheddable requests whose TTFT cannot be met;
    vLLM's real scheduler finishes them as aborted, their clients get a final output with
    the reason, their KV is freed, and every other request completes."""
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_DEPLOYMENT": "slidingserve"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    # already past their TTFT (arrived 5 s ago, 100 ms TTFT): sheddable or not.  Snapshots
    # are taken on the wall clock (the fake clock only times the steps), so the on-time ones
    # get a minute: a loaded machine must not make them late.
    now = time.time()
    late = {"slo_ttft_ms": 100, "slo_tbt_ms": 60}
    shed = [make_request(300, 4, arrival=now - 5, extra_args={**late, "slo_sheddable": True})
            for _ in range(3)]
    keep = [make_request(300, 4, arrival=now - 5, extra_args=late) for _ in range(2)]
    fresh = [make_request(64, 4, arrival=now, extra_args={"slo_ttft_ms": 60000, "slo_tbt_ms": 60000,
                                                             "slo_sheddable": True}) for _ in range(3)]
    for r in shed + keep + fresh:
        s.add_request(r)
    res, final = _run_keeping_final_outputs(s, clock, async_)
    for r in shed:
        o = final[r.request_id]
        assert o.finish_reason == FinishReason.ABORT and o.stop_reason == "slidingserve:ttft_expired"
        assert o.new_token_ids == [] and r.status == RequestStatus.FINISHED_ABORTED
        assert r.request_id not in res.scheduled  # never ran: the GPU time went to the others
    for r in keep + fresh:  # not sheddable, or still on time: served to the end
        assert res.finished[r.request_id] == 4 and final[r.request_id].finish_reason == FinishReason.LENGTH
    assert not s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    st = s.slidingserve_stats()
    assert st["rejected"] == {"ttft_expired": 3} and st["rejected_total"] == 3
    fam = next(f for f in collect_families(st, {}) if f.name == "slidingserve_adapter_rejected_requests")
    assert [(x.labels, x.value) for x in fam.samples if x.name.endswith("_total")] == [
        ({"reason": "ttft_expired"}, 3.0)]
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_the_wait_bound_rejects_requests_the_client_did_not_mark_sheddable(base: type, async_: bool,
                                                                           mdir: str) -> None:
    """With ``SLIDINGSERVE_SHED_AFTER`` a request still without its first token that many
    TTFTs after it arrived is rejected like a sheddable one, with its own reason (stop reason
    ``slidingserve:wait_bound``, counted under it); a request within the bound is served."""
    clock = FakeClock()
    env = {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_DEPLOYMENT": "slidingserve", "SLIDINGSERVE_SHED_AFTER": "3"}
    s = build_scheduler(scheduler_class(base, env, clock), mdir, async_scheduling=async_, num_blocks=400)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    now = time.time()  # 5 s ago with a 1 s TTFT: past 3 TTFTs; with a minute: within them
    old = [make_request(300, 4, arrival=now - 5, extra_args={"slo_ttft_ms": 1000, "slo_tbt_ms": 60})
           for _ in range(2)]
    fresh = [make_request(64, 4, arrival=now - 5, extra_args={"slo_ttft_ms": 60000, "slo_tbt_ms": 60000})]
    for r in old + fresh:
        s.add_request(r)
    res, final = _run_keeping_final_outputs(s, clock, async_)
    for r in old:
        o = final[r.request_id]
        assert o.finish_reason == FinishReason.ABORT and o.stop_reason == "slidingserve:wait_bound"
        assert r.request_id not in res.scheduled
    assert res.finished[fresh[0].request_id] == 4
    assert not s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    assert s.slidingserve_stats()["rejected"] == {"wait_bound": 2}
    s.slidingserve_close()


def test_the_wait_bound_setting_is_checked() -> None:
    assert VllmAdapterSettings.from_env({"SLIDINGSERVE_SHED_AFTER": "2.5"}).shed_after == 2.5
    with pytest.raises(SettingsError, match="SLIDINGSERVE_SHED_AFTER must be in"):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_SHED_AFTER": "-1"})


# ------------------------------------------------------- end-to-end objective
E2E_TABLE = ('{"0": {"ttft_ms": 400, "tbt_ms": 40, "e2e_ms": 20000}, '
             '"2": {"ttft_ms": 4000, "tbt_ms": 100, "sheddable": true, "e2e_ms": 1500}}')


def test_class_table_takes_an_e2e_objective() -> None:
    s = VllmAdapterSettings.from_env({"SLIDINGSERVE_SLO_CLASSES": E2E_TABLE})
    assert parse_slo_classes(s.slo_classes) == {
        0: ClassSlo(0.4, 0.04, False, e2e_s=20.0), 2: ClassSlo(4.0, 0.1, True, e2e_s=1.5)}
    assert parse_slo_classes(TABLE)[2].e2e_s == 0.0  # none unless set


@pytest.mark.parametrize(("text", "msg"), [
    ('{"1": {"e2e_ms": -1}}', r"SLIDINGSERVE_SLO_CLASSES\['1'\]\.e2e_ms must be a number of milliseconds >= 0"),
    ('{"1": {"e2e_ms": "10s"}}', r"e2e_ms must be a number of milliseconds >= 0, got '10s'"),
    ('{"1": {"e2e_ms": false}}', r"e2e_ms must be a number"),
    ('{"1": {"e2e_ms": 1e300}}', r"e2e_ms must be at most 1e\+15"),
    ('{"1": {"e2e": 5}}', r"keys from \['e2e_ms'"),
])
def test_bad_e2e_in_the_class_table_fails_with_the_entry_named(text: str, msg: str) -> None:
    with pytest.raises(SettingsError, match=msg):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_SLO_CLASSES": text})


def test_request_e2e_precedence() -> None:
    d = SloDefaults(ttft_s=1.0, tbt_s=0.05, classes=parse_slo_classes(E2E_TABLE))
    assert request_slo(None, 100, d, priority=2).e2e_s == 1.5  # the class's
    assert request_slo({"slo_e2e_ms": 900}, 100, d, priority=2).e2e_s == 0.9  # its own wins
    assert request_slo({"slo": {"e2e_ms": 700}}, 100, d, priority=7).e2e_s == 0.7  # nested form
    assert request_slo({"slo_e2e_ms": "soon"}, 100, d, priority=2).e2e_s == 1.5  # malformed: falls back
    assert request_slo({"slo_e2e_ms": float("nan")}, 100, d, priority=7).e2e_s == 0.0
    assert request_slo(None, 100, d, priority=7).e2e_s == 0.0  # no class, no objective
    assert request_slo({"slo_e2e_ms": 1e300}, 100, d).e2e_s == 1e12  # within the snapshot's bound


def test_snapshot_carries_the_e2e_objective() -> None:
    b = SnapshotBuilder(SloDefaults(classes=parse_slo_classes(E2E_TABLE)), profile="")
    reqs = [make_request(64, 8, priority=2), make_request(64, 8), make_request(64, 8, priority=-3),
            make_request(64, 8, priority=2, extra_args={"slo_e2e_ms": 2500}),
            make_request(64, 8, priority=-3, extra_args={"slo": {"e2e_ms": 300}})]
    snap, rows = b.build([], reqs, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000)
    assert rows == reqs
    assert snap.e2e_slo.tolist() == [1.5, 20.0, 0.0, 2.5, 0.3]
    assert snap.sheddable.tolist() == [True, False, False, True, False]
    assert snap.e2e_deadline.tolist()[2] == float("inf")
    arrival = [r.arrival_time for r in reqs]
    assert snap.e2e_deadline.tolist()[3] == arrival[3] + 2.5
    # the same again from the pool (SLOs are parsed once per request)
    again, _ = b.build([], reqs, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000)
    assert again.e2e_slo.tolist() == snap.e2e_slo.tolist()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_requests_past_their_e2e_deadline_are_rejected_with_that_reason(base: type, async_: bool,
                                                                         mdir: str) -> None:
    """Sheddable requests whose end-to-end deadline has passed (their TTFT has not) finish
    with ``slidingserve:e2e_expired``; the same requests not sheddable are served in full."""
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_DEPLOYMENT": "slidingserve"}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=400)
    now = time.time()
    # arrived 5 s ago: TTFT 60 s ahead, end to end 2 s already past
    late = {"slo_ttft_ms": 65_000, "slo_tbt_ms": 60, "slo_e2e_ms": 2000}
    shed = [make_request(300, 4, arrival=now - 5, extra_args={**late, "slo_sheddable": True}) for _ in range(2)]
    keep = [make_request(300, 4, arrival=now - 5, extra_args=late) for _ in range(2)]
    for r in shed + keep:
        s.add_request(r)
    res, final = _run_keeping_final_outputs(s, clock, async_)
    for r in shed:
        o = final[r.request_id]
        assert o.finish_reason == FinishReason.ABORT and o.stop_reason == "slidingserve:e2e_expired"
        assert r.request_id not in res.scheduled
    for r in keep:
        assert res.finished[r.request_id] == 4 and final[r.request_id].finish_reason == FinishReason.LENGTH
    st = s.slidingserve_stats()
    assert st["rejected"] == {"e2e_expired": 2}
    fam = next(f for f in collect_families(st, {}) if f.name == "slidingserve_adapter_rejected_requests")
    assert [(x.labels, x.value) for x in fam.samples if x.name.endswith("_total")] == [
        ({"reason": "e2e_expired"}, 2.0)]
    s.slidingserve_close()
