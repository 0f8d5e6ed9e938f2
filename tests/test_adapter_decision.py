"""The vLLM adapter's decision as a pure function (engine_adapter/vllm/decision.py), without
vLLM: the snapshot builder's view and the core's answer (or its failure) → the plan vLLM
executes, or the reason it schedules natively.  tests/vllm/ runs the same functions inside
vLLM's real scheduler classes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.core import REASONS, AdapterCore, AdapterSettings, Decision
from engine_adapter.vllm.decision import (
    Answer,
    Outcome,
    cap,
    fallback,
    fit_answer,
    prepare,
    read_answer,
    reuse,
    settle,
)
from engine_adapter.vllm.fit import KvRules, View, execution_order, restored_order
from engine_adapter.vllm.stats import LOCAL_REASONS
from scheduler_service.core import Plan, Rejection, Request, Snapshot
from scheduler_service.core.plan import Allocation
from tests.adapter_views import Req, views
from tests.reach import Reached


def make_plan(tokens: dict[str, int], *, latency_ms: float = 25.0, rejections: tuple[Rejection, ...] = (),
              preemptions: tuple[str, ...] = ()) -> Plan:
    return Plan("test", "1", "1", "p", sum(tokens.values()), latency_ms,
                tuple(Allocation(k, v) for k, v in tokens.items()), rejections=rejections, preemptions=preemptions)


@st.composite
def answers(draw: st.DrawFn, view: View) -> tuple[Decision, dict[str, int]]:
    """The core's decision on ``view``: a plan over a random subset of its requests (in a
    random order), or no plan with one of the core's reasons."""
    if draw(st.integers(0, 5)) == 0:
        return Decision(None, "fallback", draw(st.sampled_from(REASONS))), {}
    snap = view.snap
    ids = draw(st.permutations(list(snap.ids)))
    tokens: dict[str, int] = {}
    for rid in ids:
        if draw(st.booleans()):
            i = snap.index_of[rid]
            left = int(snap.prompt_tokens[i] - snap.computed_tokens[i])
            tokens[rid] = 1 if left == 0 else draw(st.integers(1, left))
    return Decision(make_plan(tokens, latency_ms=draw(st.floats(0, 200))), "remote"), tokens


@st.composite
def kv_rules(draw: st.DrawFn) -> KvRules:
    if draw(st.integers(0, 4)) == 0:  # room for everything
        return KvRules(draw(st.sampled_from([1, 4, 16])), 0, 10_000, 100)
    return KvRules(block_size=draw(st.sampled_from([1, 4, 16])), lookahead=draw(st.sampled_from([0, 2])),
                   free_blocks=draw(st.integers(0, 30)), slots=draw(st.integers(-1, 4)),
                   watermark=draw(st.integers(0, 3)), full_isl=draw(st.booleans()))


SETTLED = Reached()


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def _settled(data: st.DataObject) -> None:
    view = data.draw(views())
    decision, tokens = data.draw(answers(view))
    kv = data.draw(kv_rules())
    finished = frozenset(data.draw(st.sets(st.sampled_from(list(tokens)))) if tokens else ())
    out = settle(view, decision, kv, finished, last_error="boom")
    assert out.native == (out.fit is None)
    if decision.plan is None:  # a failed, late or invalid answer: the core's reason, nothing trimmed
        SETTLED("no_plan")
        assert out == Outcome(None, decision.reason, "boom")
        return
    if not tokens:
        SETTLED("empty")
        assert out.native and out.reason == "empty_plan"
        return
    if out.fit is None:  # only vLLM's KV and admission rules refuse a checked plan
        SETTLED("unallocatable")
        assert out.reason == "unallocatable" and out.detail
        return
    fit = out.fit
    assert out.reason == "" and out.ahead_s == pytest.approx(decision.plan.predicted_latency_ms / 1e3)
    alive = {k: v for k, v in tokens.items() if k not in finished}
    running = set(view.snap.ids[: view.running_rows])
    # never lost: every planned request still alive is executed or counted as trimmed ...
    assert len(set(alive) - set(fit.plan)) <= out.trimmed
    # ... never more than planned; a request the plan left out only as a running decode
    # run instead of refused admissions
    for k, n in fit.plan.items():
        assert k not in finished and 1 <= n <= alive.get(k, 1)
        assert k in alive or (k in running and n == 1 and out.trimmed)
    # ... and every executed request is in the queues vLLM is shown, once, in plan order
    assert [r.request_id for r in [*fit.run_order, *fit.admit]] == [k for k in fit.plan if k in running] + [
        k for k in fit.plan if k not in running]
    SETTLED("trimmed" if out.trimmed else "executed")
    if finished:
        SETTLED("finished")


def test_every_planned_request_is_executed_trimmed_or_left_to_vllm() -> None:
    # measured: no plan 145, empty 47, unallocatable 37, executed 110, trimmed 61, finished 58 of 400
    SETTLED.floor(_settled, no_plan=70, empty=20, unallocatable=18, executed=55, trimmed=30, finished=29)


REUSED = Reached()


@st.composite
def kv_now(draw: st.DrawFn, then: KvRules) -> KvRules:
    """vLLM's KV state at the next ``schedule()``: mostly looser than ``then`` (requests
    finished and freed blocks and slots), sometimes tighter in one way, or anything."""
    way = draw(st.integers(0, 9))
    if way == 0:
        return draw(kv_rules())
    if way <= 3:
        return replace(then, **draw(st.sampled_from([
            {"free_blocks": draw(st.integers(0, max(0, min(then.free_blocks - 1, 30))))},
            {"slots": draw(st.integers(-1, then.slots - 1)) if then.slots > -1 else -1},
            {"watermark": then.watermark + 1}, {"lookahead": then.lookahead + 1}, {"full_isl": not then.full_isl}])))
    return replace(then, free_blocks=then.free_blocks + draw(st.integers(0, 6)), slots=then.slots + draw(st.integers(0, 2)),
                   watermark=max(0, then.watermark - draw(st.integers(0, 1))))


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def _reused(data: st.DataObject) -> None:
    view = data.draw(views(hits=True))
    decision, tokens = data.draw(answers(view))
    if data.draw(st.integers(0, 9)) == 0 and decision.plan is not None and tokens:
        decision = Decision(replace(decision.plan, preemptions=(next(iter(tokens)),)), "remote")
    view.kv = data.draw(kv_rules())
    prepared = prepare(view, decision)
    if decision.plan is None or decision.plan.preemptions:
        REUSED("not_prepared")
        assert prepared is None  # the engine thread reads and carries it out
        return
    assert prepared is not None and prepared.outcome == fit_answer(read_answer(decision), view, view.kv)
    now = data.draw(kv_now(view.kv))
    finished = frozenset(data.draw(st.sets(st.sampled_from(list(tokens)), min_size=data.draw(st.integers(0, 1)),
                                           max_size=max(1, len(tokens) // 2))) if tokens else ())
    out = reuse(prepared, now, finished)
    fresh = fit_answer(prepared.answer, view, now, finished)
    if out is None:
        tighter = (now.free_blocks < view.kv.free_blocks or now.slots < view.kv.slots
                   or now.watermark > view.kv.watermark or now.lookahead != view.kv.lookahead
                   or now.block_size != view.kv.block_size or now.full_isl != view.kv.full_isl)
        # refitted only when it has to be: the prepared fit trimmed or fell back, the state
        # is tighter, or every planned request finished
        assert prepared.outcome.fit is None or prepared.outcome.trimmed or tighter or set(tokens) <= finished
        REUSED("refitted")
        return
    # ... else exactly the fit the engine thread would have made now
    assert out == fresh and out.fit is not None
    REUSED("reused_finished" if finished else "reused")
    if out.fit.admit:
        REUSED("admits")


def test_a_fit_prepared_in_the_background_is_the_one_made_now_whenever_it_is_used() -> None:
    # measured: not prepared 342, refitted 209, reused 19, reused with finished requests 30, admitting 29 of 600
    REUSED.floor(_reused, not_prepared=170, refitted=100, reused=9, reused_finished=15, admits=14)


QUEUES = Reached()


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def _queues_round_trip(data: st.DataObject) -> None:
    view = data.draw(views())
    decision, _ = data.draw(answers(view))
    out = settle(view, decision, data.draw(kv_rules()))
    if out.fit is None:
        return
    running0 = view.rows[: view.running_rows]
    waiting0 = [*view.rows[view.running_rows:], Req("blocked", 0, 5)]  # one the snapshot left out
    holding = data.draw(st.sampled_from([[], waiting0[:1]]))
    order, shown = execution_order(running0, out.fit, holding=holding, blocked=waiting0[-1:])
    # vLLM is shown every running request (the plan's first) and the planned admissions
    assert sorted(map(id, order)) == sorted(map(id, running0))
    assert order[: len(out.fit.run_order)] == out.fit.run_order
    assert all(any(r is w for w in waiting0) for r in shown) and shown[-1] is waiting0[-1]
    # nothing lost when vLLM changes nothing: the queues come back as they were
    QUEUES("holding" if holding else "plain")
    running, waiting = restored_order(running0, waiting0, order, shown, holding, shown)
    assert running == list(running0)
    assert waiting == [r for r in waiting0 if not any(r is h for h in holding)]


def test_the_queues_a_plan_runs_on_give_every_request_back() -> None:
    # measured: plain 79, holding 50 of 300
    QUEUES.floor(_queues_round_trip, plain=40, holding=25)


# ------------------------------------------------------------- hand-made cases
def _view(rows: list[tuple[str, int, int, int]], running_rows: int) -> View:
    """(id, prompt, computed, output) per row; the first ``running_rows`` are running."""
    reqs, objs, comp = [], [], []
    for rid, prompt, computed, output in rows:
        decode = output > 0
        reqs.append(Request(rid, 0.0, prompt, computed_tokens=prompt if decode else computed, output_tokens=output, ttft_slo=1.0, tbt_slo=0.1))
        c = prompt + output - 1 if decode else computed
        objs.append(Req(rid, c, prompt + output))
        comp.append(c)
    snap = Snapshot.from_requests(reqs, now=0.0, max_batch_tokens=4096, max_num_seqs=64)
    return View(snap, objs, np.array(comp, np.int64), running_rows, set())


ROOM = KvRules(block_size=16, lookahead=0, free_blocks=100, slots=8)


def test_a_plan_that_fits_is_executed_as_planned() -> None:
    view = _view([("d", 20, 0, 3), ("w", 40, 0, 0)], 1)
    out = settle(view, Decision(make_plan({"w": 40, "d": 1}, latency_ms=30), "remote"), ROOM)
    assert out.fit is not None and out.fit.plan == {"w": 40, "d": 1}
    assert [r.request_id for r in out.fit.run_order] == ["d"] and [r.request_id for r in out.fit.admit] == ["w"]
    assert out.trimmed == 0 and out.ahead_s == pytest.approx(0.03) and not out.native


@pytest.mark.parametrize("reason", REASONS)
def test_no_plan_falls_back_with_the_cores_reason(reason: str) -> None:
    view = _view([("w", 40, 0, 0)], 0)
    assert settle(view, Decision(None, "fallback", reason), ROOM, last_error="late") == Outcome(None, reason, "late")


def test_an_empty_plan_still_carries_its_rejections() -> None:
    """The scheduler carries out an answer's rejections and preemptions before fitting; an
    answer with no allocation then falls back."""
    plan = make_plan({}, rejections=(Rejection("w", "ttft_expired"),), preemptions=("d",))
    answer = read_answer(Decision(plan, "remote"))
    assert isinstance(answer, Answer) and answer.rejections == plan.rejections and answer.preemptions == ("d",)
    out = fit_answer(answer, _view([("d", 20, 0, 3), ("w", 40, 0, 0)], 1), ROOM)
    assert out.native and out.reason == "empty_plan" and "'p'" in out.detail


def test_running_requests_that_need_more_blocks_than_free_fall_back() -> None:
    view = _view([("a", 64, 16, 0), ("b", 64, 32, 0)], 2)  # prefills at a block boundary
    kv = KvRules(block_size=16, lookahead=0, free_blocks=0, slots=0)
    out = settle(view, Decision(make_plan({"a": 1, "b": 1}), "remote"), kv)
    assert out.native and out.reason == "unallocatable" and "KV blocks" in out.detail and out.trimmed == 0


def test_admissions_vllm_refuses_are_trimmed_and_counted() -> None:
    view = _view([("w1", 40, 0, 0), ("w2", 40, 0, 0)], 0)
    out = settle(view, Decision(make_plan({"w1": 40, "w2": 40}), "remote"), KvRules(16, 0, 100, slots=1))
    assert out.fit is not None and out.fit.plan == {"w1": 40} and out.trimmed == 1
    none = settle(view, Decision(make_plan({"w1": 40, "w2": 40}), "remote"), KvRules(16, 0, 100, slots=0))
    assert none.native and none.reason == "unallocatable" and none.trimmed == 2


def test_requests_finished_since_the_view_are_dropped() -> None:
    view = _view([("d", 20, 0, 3), ("e", 20, 0, 5)], 2)
    out = settle(view, Decision(make_plan({"d": 1, "e": 1}), "remote"), ROOM, finished={"d"})
    assert out.fit is not None and out.fit.plan == {"e": 1}
    gone = settle(view, Decision(make_plan({"d": 1}), "remote"), ROOM, finished={"d"})
    assert gone.native and gone.reason == "unallocatable"


def test_the_per_request_cap_is_the_plans_allocation() -> None:
    """What vLLM's per-request hooks let it schedule while it executes a plan."""
    plan = {"p": 30, "d": 1}
    prefill, decode, other = Req("p", 10, 100), Req("d", 19, 20), Req("x", 0, 50)
    assert cap(plan, (), prefill, 90, 10) == 30  # capped at the allocation
    assert cap(plan, (), prefill, 20, 10) == 20  # vLLM wants less (a prefix hit, the budget): vLLM's
    assert cap(plan, (), decode, 3, 19) == 3  # a decode with spec tokens: all or nothing
    assert cap(plan, (), other, 50, 0) == 0  # the plan leaves it out
    assert cap(plan, {"x"}, other, 50, 0) == 50  # promoted during the step: vLLM's
    assert cap(None, (), other, 50, 0) == 50  # no plan: native


CAPPED = Reached()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def _caps_keep_to_the_fit(data: st.DataObject) -> None:
    view = data.draw(views())
    decision, _ = data.draw(answers(view))
    out = settle(view, decision, data.draw(kv_rules()))
    if out.fit is None:
        return
    CAPPED()
    plan = out.fit.plan
    for row, r in enumerate(view.rows):
        n = int(view.snap.prompt_tokens[row] - view.snap.computed_tokens[row]) or 1  # what vLLM would
        n += data.draw(st.integers(0, 40))  # and more (a budget the plan does not bind)
        got = cap(plan, (), r, n, r.num_computed_tokens)
        if r.request_id not in plan:
            assert got == 0
        elif r.num_computed_tokens >= r.num_tokens - 1:
            assert got == n  # a decode (or the last prompt token): all of vLLM's
        else:
            assert got == min(n, plan[r.request_id])


def test_the_hooks_schedule_no_more_than_the_fitted_plan() -> None:
    CAPPED.floor(_caps_keep_to_the_fit, checked=50)


def test_fallback_reasons_are_the_ones_the_adapter_counts() -> None:
    assert fallback("kv_pressure", "x") == Outcome(None, "kv_pressure", "x")
    assert {"empty_plan", "unallocatable"} <= set(LOCAL_REASONS)


# ---------------------------------------------- the core's answer, then the decision
class _Backend:
    """A planner that answers with ``answer`` (a plan, or a function of the snapshot that
    returns or raises)."""

    def __init__(self, answer: Plan | Callable[[Snapshot, float], Plan]) -> None:
        self.answer = answer

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan:
        return self.answer if isinstance(self.answer, Plan) else self.answer(snapshot, timeout_s)

    def report(self, samples: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _late(snapshot: Snapshot, timeout_s: float) -> Plan:
    raise TimeoutError(f"no answer in {timeout_s:g} s")  # what a client does past its deadline


def _fails(snapshot: Snapshot, timeout_s: float) -> Plan:
    raise ConnectionError("service unreachable")


@pytest.mark.parametrize(("answer", "reason"), [
    (_late, "deadline"), (_fails, "error"), (make_plan({"nobody": 5}), "invalid_plan"),
    (make_plan({"w": 41}), "invalid_plan"),  # more tokens than the request has left
])
def test_a_failed_late_or_invalid_answer_gives_the_fallback_reason(answer: Any, reason: str) -> None:
    view = _view([("w", 40, 0, 0)], 0)
    core = AdapterCore(_Backend(answer), AdapterSettings(fallback_policy=""))
    try:
        out = settle(view, core.decide(view.snap), ROOM, last_error=core.last_error)
        assert out.native and out.reason == reason and out.detail == core.last_error != ""
        if reason != "invalid_plan":  # then the circuit opens for the next decision
            again = core.decide(view.snap)
            assert settle(view, again, ROOM).reason == "circuit_open"
        ok = AdapterCore(_Backend(make_plan({"w": 40})), AdapterSettings(fallback_policy=""))
        assert settle(view, ok.decide(view.snap), ROOM).fit is not None
        ok.close()
    finally:
        core.close()


def test_the_decision_imports_no_vllm() -> None:
    code = "import sys; sys.modules['vllm'] = None; import engine_adapter.vllm.decision; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
