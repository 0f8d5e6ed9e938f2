"""The vLLM adapter's decisions as pure functions (engine_adapter/vllm/fit.py), without vLLM:
what a plan may ask of vLLM's KV blocks and admission control, and the queues it executes on.

tests/vllm/ runs the same code inside vLLM's real scheduler classes."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.vllm.fit import (
    Fit,
    KvRules,
    View,
    admission_blocks,
    decodes_needing_block,
    execution_order,
    fit_plan,
)
from engine_adapter.vllm.snapshot import PrefixHits, SloDefaults, SnapshotBuilder
from scheduler_service.core import Request, Snapshot
from tests.adapter_views import Req, views
from tests.reach import Reached


def need(comp: int, n: int, kv: KvRules) -> int:
    """New KV blocks a request holding ``comp`` tokens needs to compute ``n`` more (vLLM's rule)."""
    b = kv.block_size
    return max(0, -(-(comp + n + kv.lookahead) // b) - -(-comp // b))


@st.composite
def cases(draw: st.DrawFn) -> tuple[View, dict[str, int], KvRules]:
    """Running decodes and prefills, waiting requests (some with a computed prefix), a plan
    over a random subset and random KV state."""
    view = draw(views(max_waiting=5))
    snap = view.snap
    plan = {}
    for i, rid in enumerate(snap.ids):
        if draw(st.booleans()):
            left = int(snap.prompt_tokens[i] - snap.computed_tokens[i])
            plan[rid] = 1 if left == 0 else draw(st.integers(1, left))
    b = draw(st.sampled_from([1, 4, 16]))
    if draw(st.integers(0, 5)) == 0:  # room for everything
        return view, plan, KvRules(b, 0, 10_000, 100)
    kv = KvRules(block_size=b, lookahead=draw(st.sampled_from([0, 2])), free_blocks=draw(st.integers(0, 30)),
                 slots=draw(st.integers(-1, 4)), watermark=draw(st.integers(0, 3)), full_isl=draw(st.booleans()))
    return view, plan, kv


FIT = Reached()


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(case=cases(), finished_share=st.sampled_from([0.0, 0.3]))
def _fits_vllm(case: tuple[View, dict[str, int], KvRules], finished_share: float) -> None:
    view, plan, kv = case
    finished = {k for j, k in enumerate(plan) if j < finished_share * len(plan)}
    fit = fit_plan(view, plan, kv, finished)
    alive = {k: v for k, v in plan.items() if k not in finished}
    assert plan == {k: v for k, v in plan.items()}  # the argument is left alone
    row = {r.request_id: i for i, r in enumerate(view.rows)}
    running = {k for k in row if row[k] < view.running_rows}
    decode_need = sum(need(int(view.computed[row[k]]), n, kv) for k, n in alive.items() if k in running and n <= 1)
    # it cannot run exactly when the planned running decodes alone need more than is free
    assert bool(fit.why) == (decode_need > kv.free_blocks), (fit.why, decode_need, kv)
    if fit.why:
        FIT("why")
        return
    # never more tokens than planned; a request the plan left out only as a decode run
    # instead of refused admissions
    instead = [k for k in fit.plan if k not in alive]
    for k, n in fit.plan.items():
        assert 1 <= n <= alive.get(k, 1)
    if instead:
        FIT("decodes_instead")
        assert all(k in running and fit.plan[k] == 1 for k in instead)
        assert not any(k in running for k in alive) and fit.trimmed
    # the queues in plan order: running first, then admissions
    assert [r.request_id for r in fit.run_order] == [k for k in fit.plan if k in running]
    assert [r.request_id for r in fit.admit] == [k for k in fit.plan if k not in running]
    assert len(fit.admit) <= max(kv.slots, 0)
    # the blocks: running requests first, then each admission leaves the watermark free
    free = kv.free_blocks - sum(need(int(view.computed[row[k]]), n, kv) for k, n in fit.plan.items() if k in running)
    assert free >= 0
    for r in fit.admit:
        held = -(-r.num_computed_tokens // kv.block_size)
        full = max(0, -(-r.num_tokens // kv.block_size) - held) if kv.full_isl else 0
        n_new = need(r.num_computed_tokens, fit.plan[r.request_id], kv)
        assert max(n_new, full) + kv.watermark <= free
        free -= n_new
    if fit.trimmed:
        FIT("trimmed")
    if kv.free_blocks >= 10_000:
        FIT("untouched")
        assert fit.plan == alive and not fit.trimmed


def test_fitted_plans_keep_to_vllm_kv_and_admission_rules() -> None:
    # measured: why 16, decodes instead 15, trimmed 103, untouched 204 of 400
    FIT.floor(_fits_vllm, why=8, decodes_instead=7, trimmed=50, untouched=100)


def test_a_running_prefill_chunk_shrinks_to_the_free_blocks() -> None:
    snap = Snapshot.from_requests([Request("a", 0.0, 64, computed_tokens=0, ttft_slo=1.0, tbt_slo=0.1), Request("d", 0.0, 8, computed_tokens=8, output_tokens=3, ttft_slo=1.0, tbt_slo=0.1)], now=0.0,
                                  max_batch_tokens=512, max_num_seqs=8)
    rows = [Req("a", 0, 64), Req("d", 10, 11)]
    view = View(snap, rows, np.array([0, 10]), 2, set())
    kv = KvRules(block_size=16, lookahead=0, free_blocks=2, slots=0)
    fit = fit_plan(view, {"d": 1, "a": 64}, kv)
    # "d" needs no new block (10 of 16 used); "a" may take the 2 free blocks: 32 tokens
    assert fit.plan == {"d": 1, "a": 32} and fit.trimmed == 1 and not fit.why
    assert [r.request_id for r in fit.run_order] == ["d", "a"] and fit.admit == []
    none = fit_plan(view, {"d": 1, "a": 64}, KvRules(block_size=16, lookahead=0, free_blocks=0, slots=0))
    assert none.plan == {"d": 1} and not none.why


def test_running_decodes_that_need_more_blocks_than_free_cannot_run() -> None:
    snap = Snapshot.from_requests([Request("d", 0.0, 16, computed_tokens=16, output_tokens=1, ttft_slo=1.0, tbt_slo=0.1)], now=0.0, max_batch_tokens=512, max_num_seqs=8)
    view = View(snap, [Req("d", 16, 17)], np.array([16]), 1, set())
    fit = fit_plan(view, {"d": 1}, KvRules(block_size=16, lookahead=0, free_blocks=0, slots=4))
    assert fit.why == "running requests need 1 KV blocks, 0 free"


def test_refused_admissions_give_way_to_the_decodes_they_displaced() -> None:
    snap = Snapshot.from_requests([Request("d", 0.0, 8, computed_tokens=8, output_tokens=2, ttft_slo=1.0, tbt_slo=0.1), Request("w", 0.0, 100, ttft_slo=1.0, tbt_slo=0.1)], now=0.0,
                                  max_batch_tokens=512, max_num_seqs=8)
    rows = [Req("d", 9, 10), Req("w", 0, 100)]
    view = View(snap, rows, np.array([9, 0]), 1, set())
    fit = fit_plan(view, {"w": 100}, KvRules(block_size=16, lookahead=0, free_blocks=3, slots=1, watermark=1))
    assert fit.plan == {"d": 1} and fit.trimmed == 1 and [r.request_id for r in fit.run_order] == ["d"]


def test_decodes_needing_a_block_are_those_at_a_block_boundary() -> None:
    snap = Snapshot.from_requests([Request("d16", 0.0, 8, computed_tokens=8, output_tokens=9, ttft_slo=1.0, tbt_slo=0.1), Request("d5", 0.0, 4, computed_tokens=4, output_tokens=2, ttft_slo=1.0, tbt_slo=0.1),
                                   Request("p", 0.0, 33, computed_tokens=32, ttft_slo=1.0, tbt_slo=0.1), Request("w", 0.0, 16, ttft_slo=1.0, tbt_slo=0.1)], now=0.0,
                                  max_batch_tokens=512, max_num_seqs=8)
    computed = np.array([16, 5, 32, 0])
    assert decodes_needing_block(snap, computed, 3, 16) == 2  # d16 and the last prompt token of p
    assert decodes_needing_block(snap, computed, 3, 4) == 2
    assert decodes_needing_block(snap, computed, 3, 3) == 0


def test_execution_order_puts_the_plan_first_and_keeps_vllms_own_queues() -> None:
    run = [Req(f"r{i}", 5, 6) for i in range(4)]
    wait = [Req(f"w{i}", 0, 9) for i in range(4)]
    fit = Fit({"r2": 1, "r0": 1, "w3": 9, "w1": 9}, run_order=[run[2], run[0]], admit=[wait[3], wait[1]])
    order, waiting = execution_order(run, fit, holding=[wait[1]], blocked=[wait[2]])
    assert order == [run[2], run[0], run[1], run[3]]
    assert waiting == [wait[3], wait[2]]
    # equal-looking requests are told apart by identity, as vLLM's are
    twin = Req("r0", 5, 6)
    order, _ = execution_order([run[0], twin], Fit({"r0": 1}, run_order=[twin]))
    assert order[0] is twin and order[1] is run[0]


def test_fit_imports_no_vllm() -> None:
    import subprocess

    code = "import sys, engine_adapter.vllm.fit; print(any(m.split('.')[0] == 'vllm' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("free", [0, 1, 5])
def test_finished_requests_are_dropped_first(free: int) -> None:
    snap = Snapshot.from_requests([Request("a", 0.0, 8, computed_tokens=8, output_tokens=1, ttft_slo=1.0, tbt_slo=0.1), Request("b", 0.0, 8, computed_tokens=8, output_tokens=1, ttft_slo=1.0, tbt_slo=0.1)], now=0.0,
                                  max_batch_tokens=512, max_num_seqs=8)
    view = View(snap, [Req("a", 8, 9), Req("b", 8, 9)], np.array([8, 8]), 2, set())
    fit = fit_plan(view, {"a": 1, "b": 1}, KvRules(block_size=8, lookahead=0, free_blocks=free, slots=0), {"a"})
    assert "a" not in fit.plan and bool(fit.why) == (free == 0)


# ------------------------------------------------------------- prefix-cache hits
def test_admission_blocks_count_a_hit_as_vllms_allocate_slots_does() -> None:
    # 64 cached tokens (4 blocks of 16) and 40 new: blocks up to 104 tokens = 7, 4 of them the hit's
    assert admission_blocks(64, 40, 104, 16, 0, 0) == (3, 3)
    # evictable hit blocks (cached, held by no request) come out of the free queue too
    assert admission_blocks(64, 40, 104, 16, 0, 4) == (7, 7)
    # a lookahead reserves its slots; the whole prompt (full_isl) counts from the hit
    assert admission_blocks(64, 40, 300, 16, 2, 1) == (4, 16)
    # a hit ending inside a block: that block is copied (one more), as vLLM's partial-hit rule
    assert admission_blocks(70, 10, 80, 16, 0, 0) == (1, 1)
    # no hit: vLLM's rule for a request holding nothing
    for n in (1, 15, 16, 17, 100):
        assert admission_blocks(0, n, n, 16, 0, 0) == (-(-n // 16), -(-n // 16))


def _waiting_view(hit: int, evictable: int, prompt: int = 104) -> View:
    snap = Snapshot.from_requests([Request("d", 0.0, 8, computed_tokens=8, output_tokens=3, ttft_slo=1.0, tbt_slo=0.1), Request("w", 0.0, prompt, computed_tokens=hit, ttft_slo=1.0, tbt_slo=0.1)], now=0.0,
                                  max_batch_tokens=512, max_num_seqs=8)
    return View(snap, [Req("d", 10, 11), Req("w", 0, prompt)], np.array([10, 0]), 1, set(),
                hits=np.array([0, hit]), evictable=np.array([0, evictable]))


def test_an_admission_with_a_hit_needs_the_blocks_beyond_it() -> None:
    plan = {"d": 1, "w": 40}  # the tokens beyond the 64-token hit
    kv = KvRules(block_size=16, lookahead=0, free_blocks=3, slots=4)
    fit = fit_plan(_waiting_view(64, 0), plan, kv)
    assert fit.plan == plan and [r.request_id for r in fit.admit] == ["w"] and not fit.trimmed
    # evictable hit blocks need free blocks: 3 + 4 > 3
    refused = fit_plan(_waiting_view(64, 4), plan, kv)
    assert refused.plan == {"d": 1} and refused.trimmed == 1
    assert fit_plan(_waiting_view(64, 4), plan, KvRules(16, 0, 7, 4)).plan == plan
    # the whole prompt must fit (scheduler_reserve_full_isl): 300 tokens = 19 blocks, 4 cached
    full = KvRules(block_size=16, lookahead=0, free_blocks=14, slots=4, full_isl=True)
    assert fit_plan(_waiting_view(64, 0, 300), plan, full).plan == {"d": 1}
    assert fit_plan(_waiting_view(64, 0, 300), plan, KvRules(16, 0, 15, 4, full_isl=True)).plan == plan
    # without the hit the whole prompt would have asked for 19 blocks
    assert fit_plan(_waiting_view(0, 0, 300), {"d": 1, "w": 40}, KvRules(16, 0, 15, 4, full_isl=True)).plan == {"d": 1}


@dataclass(eq=False)
class Waiting:
    """What :class:`PrefixHits` and the snapshot builder read of a vLLM request."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    max_tokens: int = 16
    arrival_time: float = 0.0
    sampling_params: None = None
    priority: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or self.num_tokens


def test_prefix_hits_look_each_request_up_once_and_refresh_a_few_in_turn() -> None:
    cache = {f"w{i}": 32 * (i % 3) for i in range(10)}
    calls: list[str] = []

    def lookup(r: Waiting) -> tuple[int, int]:
        calls.append(r.request_id)
        return cache[r.request_id], 1 if cache[r.request_id] else 0

    hits = PrefixHits(lookup, new_per_build=4, refresh_per_build=2)
    reqs = [Waiting(f"w{i}", 100) for i in range(10)]
    tokens = np.full(10, 100)
    h, e = hits(reqs, tokens)
    # at most 4 new lookups a snapshot (the others show no hit yet)
    assert calls == ["w0", "w1", "w2", "w3"] and list(h) == [0, 32, 64, 0] + [0] * 6 and list(e[:4]) == [0, 1, 1, 0]
    calls.clear()
    h, _ = hits(reqs, tokens)
    assert calls == ["w4", "w5", "w6", "w7", "w0", "w1"] and list(h[:8]) == [0, 32, 64, 0, 32, 64, 0, 32]
    calls.clear()
    hits(reqs, tokens)
    assert calls[:2] == ["w8", "w9"] and len(calls) == 4  # then 2 refreshes in turn
    # a changed cache shows once the request's turn comes; forget() makes it come now
    cache["w3"] = 96
    hits.forget(["w3"])
    calls.clear()
    h, _ = hits(reqs, tokens)
    assert calls[0] == "w3" and h[3] == 96
    # a request whose tokens changed (preempted with outputs) is looked up again; hits stay below num_tokens
    cache["w5"] = 500
    reqs[5] = Waiting("w5", 120)
    calls.clear()
    h, _ = hits(reqs, np.array([100] * 5 + [120] + [100] * 4))
    assert calls[0] == "w5" and h[5] == 119
    assert hits.lookups == 4 + 6 + 4 + 3 + 3
    hits.prune({})  # few requests: nothing to prune yet
    assert len(hits._memo) == 10


def test_the_snapshot_shows_a_waiting_requests_hit_as_computed_tokens() -> None:
    running = [Waiting("r", 41, num_computed_tokens=40, num_prompt_tokens=30, num_output_tokens=11)]
    waiting = [Waiting("a", 100), Waiting("b", 50)]
    hits = PrefixHits(lambda r: {"a": (64, 2), "b": (0, 0)}[r.request_id])
    builder = SnapshotBuilder(SloDefaults(), "m|h|tp1")
    snap, rows = builder.build(running, waiting, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=1000,
                               now=1.0, hits=hits)
    assert list(snap.ids) == ["r", "a", "b"] and rows == [*running, *waiting]
    assert list(snap.prompt_tokens) == [30, 100, 50] and list(snap.computed_tokens) == [30, 64, 0]
    assert list(builder.last_hits) == [0, 64, 0] and list(builder.last_evictable) == [0, 2, 0]
    assert list(builder.last_computed) == [40, 0, 0]  # vLLM's own counters are left alone
    # a waiting request vLLM has computed tokens of (a KV transfer) is not looked up
    moved = [Waiting("a", 100), Waiting("c", 80, num_computed_tokens=48)]
    snap, _ = builder.build([], moved, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=1000, now=1.0,
                            hits=hits)
    assert list(snap.computed_tokens) == [64, 48] and list(builder.last_hits) == [64, 0]
    # without hits: nothing computed, as before
    snap, _ = builder.build([], waiting, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=1000, now=1.0)
    assert list(snap.computed_tokens) == [0, 0] and not builder.last_hits.any()
