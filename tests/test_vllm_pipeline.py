"""The vLLM adapter's plain objects, without vLLM: pipelining (engine_adapter/vllm/pipeline.py),
counters and samples (stats.py), the effects of a plan's rejections and preemptions
(effects.py), the core and its hot reload (live.py), the queue helpers of fit.py, and
the metrics endpoint's port check (observe.py).

tests/vllm/ runs the same code inside vLLM's real scheduler classes."""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_adapter.core import Decision
from engine_adapter.vllm.effects import live_rejections, preemptible
from engine_adapter.vllm.fit import (
    View,
    decodes_at_block_boundary,
    kv_headroom,
    kv_short,
    restored_order,
    split_blocked,
)
from engine_adapter.vllm.pipeline import MAX_GRACE_S, Pipeline, Statuses, is_stale, room_for_arrivals
from engine_adapter.vllm.settings import SettingsError, SettingsWatcher, VllmAdapterSettings
from engine_adapter.vllm.snapshot import SloDefaults, SnapshotBuilder
from engine_adapter.vllm.stats import AdapterStats, core_totals, deviations, iteration_sample
from scheduler_service.core import Allocation, Plan, Rejection, Request, Snapshot


class St(enum.IntEnum):
    """Stands in for vLLM's ``RequestStatus``."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_ABORTED = 4
    WAITING_FOR_REMOTE_KVS = 5

    def is_finished(self) -> bool:
        return self >= St.FINISHED_STOPPED and self != St.WAITING_FOR_REMOTE_KVS


STATUSES = Statuses(running=St.RUNNING, waiting=frozenset((St.WAITING, St.PREEMPTED)), is_finished=St.is_finished)
MAX_TOKENS, MAX_SEQS = 512, 8


@dataclass(eq=False)
class Req:
    """What the adapter reads of a vLLM request."""

    request_id: str
    status: St = St.WAITING
    num_computed_tokens: int = 0
    num_tokens: int = 100
    num_output_placeholders: int = 0
    is_prefill_chunk: bool = False

    def is_finished(self) -> bool:
        return self.status.is_finished()


def view_of(running: list[Req], waiting: list[Req], free_kv_tokens: int | None = 10_000) -> View:
    reqs = [Request(r.request_id, 0.0, r.num_tokens, computed_tokens=min(r.num_computed_tokens, r.num_tokens), ttft_slo=1.0, tbt_slo=0.1) for r in running]
    reqs += [Request(r.request_id, 0.0, r.num_tokens, ttft_slo=1.0, tbt_slo=0.1) for r in waiting]
    snap = Snapshot.from_requests(reqs, now=0.0, max_batch_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                                  free_kv_tokens=free_kv_tokens)
    rows = [*running, *waiting]
    return View(snap, rows, np.array([r.num_computed_tokens for r in rows], np.int64), len(running), set())


def plan_of(alloc: dict[str, int]) -> Plan:
    return Plan("p", "1", "m", "path", sum(alloc.values()), 5.0, tuple(Allocation(k, v) for k, v in alloc.items()))


def two_running_one_waiting() -> tuple[list[Req], list[Req]]:
    return [Req("a", St.RUNNING, 100, 101), Req("b", St.RUNNING, 40, 100)], [Req("c")]


# ------------------------------------------------------------------ staleness
def stale(view: View, plan: Plan, *, finished: bool = False, arrivals: list[Req] | None = None) -> bool:
    return is_stale(view, plan, STATUSES, finished_since=finished, arrivals=arrivals or [],
                    max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS)


def test_a_plan_on_unchanged_queues_stands() -> None:
    running, waiting = two_running_one_waiting()
    assert not stale(view_of(running, waiting), plan_of({"a": 1, "b": 60, "c": 100}))


def test_requests_that_finished_since_the_view_keep_the_plan() -> None:
    running, waiting = two_running_one_waiting()
    view = view_of(running, waiting)
    running[0].status = St.FINISHED_STOPPED  # EOS in update_from_output
    assert not stale(view, plan_of({"a": 1, "b": 60}), finished=True)


def test_a_running_request_that_changed_state_outside_schedule_breaks_the_projection() -> None:
    running, waiting = two_running_one_waiting()
    view = view_of(running, waiting)
    running[1].status = St.PREEMPTED  # a KV-connector failure, a test preempting by hand
    assert stale(view, plan_of({"a": 1, "b": 60}))
    running[0].status = St.FINISHED_STOPPED  # a finished one does not make up for it
    assert stale(view, plan_of({"a": 1, "b": 60}))


def test_finished_requests_make_a_plan_stale_only_when_kv_was_tight() -> None:
    running, waiting = two_running_one_waiting()
    plan = plan_of({"a": 1, "b": 60})
    assert stale(view_of(running, waiting, free_kv_tokens=MAX_TOKENS - 1), plan, finished=True)
    assert not stale(view_of(running, waiting, free_kv_tokens=MAX_TOKENS - 1), plan, finished=False)
    assert not stale(view_of(running, waiting, free_kv_tokens=MAX_TOKENS), plan, finished=True)
    assert not stale(view_of(running, waiting, free_kv_tokens=None), plan, finished=True)


def test_arrivals_make_a_plan_stale_only_when_it_left_them_room() -> None:
    running, waiting = two_running_one_waiting()
    view = view_of(running, waiting)
    all_served = plan_of({"a": 1, "b": 60, "c": 100})
    new = Req("d")
    assert stale(view, all_served, arrivals=[new])
    assert not stale(view, all_served)  # nobody arrived
    # the arrival was already admitted (or aborted) by the time the plan is collected
    assert not stale(view, all_served, arrivals=[Req("d", St.RUNNING)])
    assert not stale(view, all_served, arrivals=[Req("d", St.FINISHED_ABORTED)])
    # a plan that leaves a known request waiting chose its budget: it would leave the arrival too
    assert not stale(view, plan_of({"a": 1, "b": 60}), arrivals=[new])
    # no tokens left in the budget, or no sequence slot left
    assert not room_for_arrivals(plan_of({"a": 1, "b": 60, "c": MAX_TOKENS - 61}), view.snap, [new],
                                 STATUSES.waiting, MAX_TOKENS, MAX_SEQS)
    assert not room_for_arrivals(all_served, view.snap, [new], STATUSES.waiting, MAX_TOKENS, max_seqs=3)
    assert room_for_arrivals(all_served, view.snap, [new], STATUSES.waiting, MAX_TOKENS, max_seqs=4)


# ------------------------------------------------------------------- pipeline
@dataclass
class FakeCore:
    """Decides ``plan`` (or raises ``error``) after ``gate`` opens; records the snapshots."""

    plan: Plan | None
    error: Exception | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    seen: list[Snapshot] = field(default_factory=list)
    graces: list[float] = field(default_factory=list)

    def decide(self, snap: Snapshot, grace_s: float = 0.0) -> Decision:
        self.gate.wait(10)
        self.seen.append(snap)
        self.graces.append(grace_s)
        if self.error is not None:
            raise self.error
        return Decision(self.plan, "remote")


def new_pipeline() -> tuple[Pipeline, AdapterStats]:
    stats = AdapterStats()
    return Pipeline(stats, STATUSES, MAX_TOKENS, MAX_SEQS), stats


def test_pipeline_collects_the_background_decision_on_the_view_it_was_given() -> None:
    pipe, stats = new_pipeline()
    running, waiting = two_running_one_waiting()
    view = view_of(running, waiting)
    core = FakeCore(plan_of({"a": 1, "b": 60}))
    core.gate.set()
    pipe.start(core, view=view)  # type: ignore[arg-type]
    pending = pipe.take()
    assert pending is not None and pipe.pending is None and pending.snapped.is_set() and pending.core is core
    done = pipe.collect(pending, finished_since=False)
    assert done is not None and done[0] is view and done[1].plan == core.plan and core.seen == [view.snap]
    assert stats.counts["pipelined"] == 1 and stats.counts["resyncs"] == 0
    pipe.close()


def test_pipeline_resyncs_a_stale_plan_and_forgets_arrivals_only_when_told() -> None:
    pipe, stats = new_pipeline()
    running, waiting = two_running_one_waiting()
    core = FakeCore(plan_of({"a": 1, "b": 60, "c": 100}))
    core.gate.set()
    pipe.arrived(Req("early"))  # nothing in flight: not an arrival since a snapshot
    assert pipe.arrivals == []
    pipe.start(core, view=view_of(running, waiting))  # type: ignore[arg-type]
    pipe.arrived(Req("d"))
    pending = pipe.take()
    assert pending is not None
    assert pipe.collect(pending, finished_since=False) is None  # the arrival fits: decide again
    assert stats.counts["resyncs"] == 1 and stats.counts["pipelined"] == 0
    assert [r.request_id for r in pipe.arrivals] == ["d"]
    pipe.close()


def test_pipeline_reads_the_queues_in_the_background_and_quiesce_waits_for_that() -> None:
    pipe, stats = new_pipeline()
    running, waiting = two_running_one_waiting()
    reading, release = threading.Event(), threading.Event()

    def take_view() -> View:
        reading.set()
        release.wait(10)
        return view_of(running, waiting)

    core = FakeCore(plan_of({"a": 1}))
    core.gate.set()
    pipe.start(core, take_view=take_view)  # type: ignore[arg-type]
    assert reading.wait(10)
    assert pipe.pending is not None and not pipe.pending.snapped.is_set()
    threading.Timer(0.05, release.set).start()
    pipe.quiesce()  # returns once the job has read the queues
    assert pipe.pending.snapped.is_set() and stats.counts["snap_wait_us"] >= 20_000
    pending = pipe.take()
    assert pending is not None
    done = pipe.collect(pending, finished_since=False)
    assert done is not None and [r.request_id for r in done[0].rows] == ["a", "b", "c"]
    pipe.close()


def test_pipeline_without_a_view_leaves_nothing_to_collect() -> None:
    pipe, stats = new_pipeline()
    core = FakeCore(plan_of({"a": 1}))
    core.gate.set()

    def broken() -> View:
        raise RuntimeError("a request state the snapshot cannot express")

    for take_view in (broken, lambda: view_of([], [])):
        pipe.start(core, take_view=take_view)  # type: ignore[arg-type]
        pending = pipe.take()
        assert pending is not None
        assert pipe.collect(pending, finished_since=False) is None and pending.snapped.is_set()
    assert core.seen == [] and stats.counts["pipelined"] == 0 and stats.counts["resyncs"] == 0
    pipe.close()


def test_pipeline_collect_raises_what_the_decision_raised() -> None:
    pipe, _ = new_pipeline()
    running, waiting = two_running_one_waiting()
    core = FakeCore(None, error=ValueError("bug"))
    core.gate.set()
    pipe.start(core, view=view_of(running, waiting))  # type: ignore[arg-type]
    pending = pipe.take()
    assert pending is not None
    with pytest.raises(ValueError, match="bug"):
        pipe.collect(pending, finished_since=False)
    pipe.close()
    pipe.close()  # twice is fine


@dataclass
class FakeLive:
    """A core source whose settings turn pipelining on or off."""

    core: FakeCore
    pipeline: bool = True
    gets: int = 0

    @property
    def settings(self) -> Any:
        return SimpleNamespace(pipeline=self.pipeline)

    def get(self) -> Any:
        self.gets += 1
        return self.core


def test_ahead_projects_now_with_async_scheduling_and_in_the_background_without() -> None:
    running, waiting = two_running_one_waiting()
    taken: list[tuple[str, float, str]] = []

    def take_view(project: str, ahead_s: float) -> View:
        taken.append((project, ahead_s, threading.current_thread().name))
        return view_of(running, waiting)

    core = FakeCore(plan_of({"a": 1}))
    core.gate.set()
    for project_now, project in ((True, "async"), (False, "sync")):
        pipe, _ = new_pipeline()
        pipe.ahead_s = 0.025  # the last plan's predicted step time
        pipe.ahead(FakeLive(core), take_view, project_now=project_now)
        pending = pipe.take()
        assert pending is not None and pipe.collect(pending, finished_since=False) is not None
        assert taken[-1][:2] == (project, 0.025)
        on_engine_thread = taken[-1][2] == threading.current_thread().name
        assert on_engine_thread == project_now
        assert core.graces[-1] == 0.025  # the deadline counts from when the step ends
        pipe.close()
    pipe, _ = new_pipeline()
    pipe.ahead_s = 30.0  # a wild prediction: the grace is capped
    pipe.ahead(FakeLive(core), take_view, project_now=True)
    pending = pipe.take()
    assert pending is not None and pipe.collect(pending, finished_since=False) is not None
    assert core.graces[-1] == MAX_GRACE_S
    pipe.close()


def test_ahead_starts_nothing_when_pipelining_is_off_or_there_is_no_view() -> None:
    running, waiting = two_running_one_waiting()
    core = FakeCore(plan_of({"a": 1}))
    core.gate.set()
    pipe, _ = new_pipeline()
    live = FakeLive(core, pipeline=False)
    pipe.ahead(live, lambda p, a: view_of(running, waiting), project_now=True)
    assert pipe.pending is None and live.gets == 1  # the core was still asked for: a reload applies

    def broken(project: str, ahead_s: float) -> View:
        raise RuntimeError("no view")

    for take_view in (broken, lambda p, a: view_of([], [])):
        pipe.ahead(FakeLive(core), take_view, project_now=True)
        assert pipe.pending is None
    pipe.close()


# ---------------------------------------------------------------------- stats
def test_fallbacks_are_counted_by_reason_and_logged_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    stats = AdapterStats()
    caplog.set_level(logging.WARNING, logger="engine_adapter")
    for i in range(10):
        stats.fallback("kv_pressure", f"step {i}", log_every=4)
    stats.fallback("deadline", "late", log_every=4)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 4  # kv_pressure: 1st, 4th, 8th; deadline: 1st
    assert "kv_pressure, 8 so far" in logged[2]
    d = stats.as_dict({})
    assert d["fallbacks"] == {"kv_pressure": 10, "deadline": 1} and d["fallback_total"] == 11
    assert d["last_reason"] == "deadline: late"


def test_stats_accumulate_and_sum_the_cores_retired_by_reloads() -> None:
    stats = AdapterStats()
    c = stats.counts
    for planned in (True, True, False, True):
        c["iterations"] += 1
        c["planned" if planned else "native"] += 1
        c["decide_us"] += 100
        c["own_us"] += 40
    c["pipelined"] += 2
    c["wait_us"] += 30
    stats.deviated(0)
    stats.deviated(3)
    stats.deviated(1)
    stats.rejects["ttft_expired"] += 2
    stats.report_failed(KeyError("x"))
    retired = [{"remote_decisions": 5, "reports_sent": 2}, {"remote_decisions": 1, "report_errors": 1}]
    d = stats.as_dict({"remote_decisions": 3, "reports_dropped": 4}, retired, policy="sarathi", profile="m|h|tp1")
    assert (d["iterations"], d["planned"], d["native"]) == (4, 3, 1)
    assert d["deviating_iterations"] == 2 and d["deviated_requests"] == 4
    assert d["rejected"] == {"ttft_expired": 2} and d["rejected_total"] == 2
    assert d["mean_decide_us"] == 100 and d["mean_own_us"] == 40 and d["own_us"] == 160
    assert d["mean_wait_us"] == 15 and d["report_errors"] == 1 and d["last_reason"] == "report: KeyError: 'x'"
    assert d["core_totals"] == {"remote_decisions": 9, "reports_sent": 2, "reports_dropped": 4, "report_errors": 1,
                                "decision_counts": [0] * 9, "decision_seconds": 0.0}
    assert d["core"] == {"remote_decisions": 3, "reports_dropped": 4}
    assert d["policy"] == "sarathi" and d["profile"] == "m|h|tp1"
    assert AdapterStats().as_dict({})["mean_decide_us"] == 0  # no iteration: no division by zero
    assert core_totals([]) == {**dict.fromkeys(("remote_decisions", "reports_sent", "reports_dropped",
                                                "report_errors"), 0), "decision_counts": [0] * 9,
                               "decision_seconds": 0.0}
    # decision-time histograms add up over the cores settings reloads retired
    hist = core_totals([{"decision_counts": [1, 2] + [0] * 7, "decision_seconds": 0.5},
                        {"decision_counts": [0, 1] + [0] * 6 + [3], "decision_seconds": 2.0}])
    assert hist["decision_counts"] == [1, 3] + [0] * 6 + [3] and hist["decision_seconds"] == 2.5


def test_deviations_count_what_vllm_changed_except_by_design() -> None:
    reqs = {"dec": Req("dec", St.RUNNING, 100, 101), "pre": Req("pre", St.RUNNING, 64, 64, is_prefill_chunk=True),
            "chunk": Req("chunk", St.RUNNING, 20, 100, is_prefill_chunk=True)}
    assert deviations({"dec": 1, "chunk": 30}, {"dec": 1, "chunk": 30}, reqs) == 0
    assert deviations({"dec": 1}, {"dec": 3}, reqs) == 0  # a decode with its spec tokens
    assert deviations({"pre": 40}, {"pre": 8}, reqs) == 0  # the prefix cache held the rest
    assert deviations({"chunk": 30}, {"chunk": 10}, reqs) == 1  # shortened without a cache hit
    assert deviations({"chunk": 1}, {"chunk": 3}, reqs) == 1  # more than planned for a prefill
    assert deviations({"dec": 1, "chunk": 30}, {}, reqs) == 2  # planned, not scheduled
    assert deviations({"gone": 5}, {"gone": 3}, reqs) == 1  # not among vLLM's requests


def test_iteration_sample_pairs_tokens_with_the_kv_before_the_step() -> None:
    so = SimpleNamespace(
        num_scheduled_tokens={"n1": 64, "c1": 1, "c2": 16},
        scheduled_cached_reqs=SimpleNamespace(req_ids=["c1", "c2"], num_computed_tokens=[300, 48]),
        scheduled_new_reqs=[SimpleNamespace(req_id="n1", num_computed_tokens=32)])
    s = iteration_sample(so, 12.5)
    assert sorted(zip(s.c.tolist(), s.u.tolist(), strict=True)) == [(1, 300), (16, 48), (64, 32)]
    assert s.latency_ms == 12.5 and s.c.dtype == np.int64
    # the lists disagree with the scheduled tokens (not expected): unknown u counts as 0
    so.scheduled_new_reqs = []
    s = iteration_sample(so, 1.0)
    assert sorted(zip(s.c.tolist(), s.u.tolist(), strict=True)) == [(1, 300), (16, 48), (64, 0)]


# -------------------------------------------------------------------- effects
def test_rejections_apply_to_live_requests_only() -> None:
    requests = {"a": Req("a"), "b": Req("b", St.FINISHED_STOPPED), "c": Req("c", St.RUNNING)}
    rej = (Rejection("a", "ttft_expired"), Rejection("b", "e2e_expired"), Rejection("x", "ttft_unreachable"),
           Rejection("c", "e2e_unreachable"))
    assert live_rejections(rej, requests) == {"a": "ttft_expired", "c": "e2e_unreachable"}
    assert live_rejections((), requests) == {}


def test_preemptions_apply_to_requests_still_running_once_each() -> None:
    a, b, c = Req("a", St.RUNNING), Req("b", St.PREEMPTED), Req("c", St.RUNNING)
    stray = Req("s", St.RUNNING)  # running status, but not in the running queue
    requests = {r.request_id: r for r in (a, b, c, stray)}
    assert preemptible(["c", "b", "x", "s", "a", "c"], requests, [a, c], St.RUNNING) == [c, a]


# ------------------------------------------------------------------------ fit
def test_restored_order_keeps_vllms_order_around_the_planned_call() -> None:
    r1, r2, r3, w1, w2, w3, hold = (Req(n) for n in ("r1", "r2", "r3", "w1", "w2", "w3", "hold"))
    # the plan ran r3 first and admitted w2; vLLM preempted r1 (front of waiting) and
    # promoted hold from the KV-holding queue into running
    running, waiting = restored_order([r1, r2, r3], [w1, w2, w3], running=[r3, r2, w2, hold], waiting=[r1],
                                      holding=[], shown=[w2])
    assert running == [r2, r3, w2, hold] and waiting == [r1, w1, w3]
    # nothing changed: the old order exactly
    running, waiting = restored_order([r1, r2], [w1, w2], running=[r2, r1], waiting=[w1, w2], holding=[])
    assert running == [r1, r2] and waiting == [w1, w2]
    # a request still in vLLM's KV-holding queue leaves waiting
    running, waiting = restored_order([r1], [w1, hold], running=[r1], waiting=[], holding=[hold], shown=[])
    assert running == [r1] and waiting == [w1]


def test_kv_room_and_decodes_at_block_boundaries() -> None:
    running = [Req("a", num_computed_tokens=32, num_tokens=33), Req("b", num_computed_tokens=30, num_tokens=31),
               Req("c", num_computed_tokens=16, num_tokens=40),
               Req("d", num_computed_tokens=48, num_tokens=48, num_output_placeholders=1)]
    assert kv_headroom(running, 16, 3) == 3 * 16 + 2  # b's last block has 2 free slots
    assert decodes_at_block_boundary(running, 16) == 2  # a, and d with a token in flight
    assert kv_short(2, 1) == "2 decodes need a new KV block, 1 free"
    assert kv_short(2, 2) == "" and kv_short(0, 0) == ""


def test_split_blocked_leaves_out_what_a_plan_cannot_know() -> None:
    schedulable = frozenset((St.WAITING, St.PREEMPTED, St.RUNNING))
    a, b = Req("a"), Req("b", St.PREEMPTED)
    waiting = [a, b]
    assert split_blocked(waiting, schedulable) == ([a, b], set())
    remote = Req("r", St.WAITING_FOR_REMOTE_KVS)
    assert split_blocked([a, remote, b], schedulable) == ([a, b], {"r"})


# ----------------------------------------------------------------------- live
def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    t = time.time() + 1
    os.utime(path, (t, t))  # a new mtime even on coarse file systems


def test_live_core_swaps_on_a_changed_file_and_keeps_what_it_learned(tmp_path: Path) -> None:
    from engine_adapter.vllm.live import LiveCore

    p = tmp_path / "live.yaml"
    p.write_text("policy: vllm-fcfs\n")
    watcher = SettingsWatcher(VllmAdapterSettings.from_env({"SLIDINGSERVE_CONFIG": str(p)}, apply_file=False))
    watcher.period_s = 0
    builder = SnapshotBuilder(SloDefaults(), "m|h|tp1")
    live = LiveCore(watcher, "m|h|tp1", builder)
    assert live.core is None and live.stats()[0] == {}
    first = live.get()
    assert live.get() is first and live.settings.policy == "vllm-fcfs"
    reg = live.predictors
    _touch(p, "policy: sarathi\ndefault_tbt_ms: 80\n")
    second = live.get()
    assert second is not first and live.settings.policy == "sarathi" and live.predictors is reg
    assert builder.defaults.tbt_s == pytest.approx(0.08) and len(live.retired) == 1
    core, fields = live.stats()
    assert fields["settings_reloads"] == 1 and fields["policy"] == "sarathi" and "remote_decisions" in core
    assert live.labels() == {"address": "inproc", "policy": "sarathi", "profile": "m|h|tp1"}
    _touch(p, "policy: [broken\n")
    assert live.get() is second and live.stats()[1]["settings_errors"] == 1
    live.close()
    assert live.core is None and live.predictors is None and reg is not None and reg._closed


def test_live_core_keeps_the_old_core_when_the_new_one_cannot_be_built(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_adapter.vllm import live as live_mod

    p = tmp_path / "live.yaml"
    p.write_text("policy: vllm-fcfs\n")
    watcher = SettingsWatcher(VllmAdapterSettings.from_env({"SLIDINGSERVE_CONFIG": str(p)}, apply_file=False))
    watcher.period_s = 0
    live = live_mod.LiveCore(watcher, "m|h|tp1", SnapshotBuilder(SloDefaults(), "m|h|tp1"))
    first = live.get()

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("no backend")

    monkeypatch.setattr(live_mod, "build_core", broken)
    _touch(p, "policy: sarathi\n")
    assert live.get() is first and live.settings.policy == "vllm-fcfs" and live.retired == []
    live.close()


# -------------------------------------------------------------------- observe
def test_metrics_endpoint_on_a_taken_port_is_a_settings_error() -> None:
    from engine_adapter.vllm.observe import serve_metrics

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        s = VllmAdapterSettings(metrics_port=port - 1, metrics_host="127.0.0.1")
        with pytest.raises(SettingsError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve_metrics(s, 1, dict, dict)  # rank 1: one port up
