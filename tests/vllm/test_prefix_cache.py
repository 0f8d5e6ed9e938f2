"""Prefix-cache-aware snapshots on vLLM's real schedulers (docs/vllm.md, Prefix caching): a
waiting request shows, as computed tokens, the prompt tokens vLLM's prefix cache holds for
it, exactly the hit vLLM finds when it admits it; the plan allocates the tokens beyond the
hit, which is what vLLM schedules; shared-prefix workloads finish with no request lost or
stalled; prefix caching off, a request that skips the cache, or the setting off: 0."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
from engine_adapter.vllm.compat import prefix_lookup_off

from .support import (
    BLOCK,
    Driver,
    FakeClock,
    build_scheduler,
    check_prepared_fits,
    fake_output,
    make_request,
    scheduler_class,
)

CASES = [(RemoteSyncScheduler, False), (RemoteScheduler, True)]
_ids = itertools.count()


def _hasher() -> Any:
    make_request(1, 1)  # sets vLLM's hash seed once, as every request of the testbed has it
    return get_request_block_hasher(BLOCK, sha256)


def shared(prefix: list[int], own: int, max_tokens: int, *, skip_cache: bool = False, **slo: Any) -> Request:
    """A request whose prompt is ``prefix`` and ``own`` tokens of its own."""
    i = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=slo or None,
                        skip_reading_prefix_cache=skip_cache or None)
    toks = prefix + [3 + (i * 131 + k * 7919) % 990 for k in range(own)]
    return Request(request_id=f"p{i}", prompt_token_ids=toks, sampling_params=sp, pooling_params=None,
                   arrival_time=time.time(), block_hasher=_hasher())


def system_prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 990, n)]


def _warm(s: Any, prefix: list[int]) -> None:
    """One request with ``prefix`` run to completion: its blocks stay in the prefix cache."""
    first = shared(prefix, 5, 2)
    s.add_request(first)
    for _ in range(20):
        so = s.schedule()
        s.update_from_output(so, fake_output(s, so))
        if not s.has_requests():
            break
    assert not s.has_requests()


def _record_executions(s: Any) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(fitted plan, tokens vLLM scheduled) of every planned ``schedule()``."""
    seen: list[tuple[dict[str, int], dict[str, int]]] = []
    orig = s._execute

    def execute(fit: Any, args: Any, kwargs: Any) -> Any:
        plan = dict(fit.plan)
        out = orig(fit, args, kwargs)
        seen.append((plan, dict(out.num_scheduled_tokens)))
        return out

    s._execute = execute
    return seen


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_a_waiting_request_shows_vllms_own_hit_and_the_plan_computes_the_rest(base: type, async_: bool,
                                                                               mdir: str) -> None:
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve", "SLIDINGSERVE_PIPELINE": "off"})
    s = build_scheduler(cls, mdir, async_scheduling=async_)
    assert prefix_lookup_off(s) == ""
    prefix = system_prompt(200)
    _warm(s, prefix)
    second = shared(prefix, 70, 3)
    s.add_request(second)
    snap, _, _ = s._snapshot()
    row = snap.index_of[second.request_id]
    # vLLM's own lookup (what schedule() asks for when it admits the request)
    native = s.kv_cache_manager.get_computed_blocks(second)[1]
    assert native == 192  # 12 whole blocks of the 200 shared tokens
    assert snap.computed_tokens[row] == native and snap.prompt_tokens[row] == 270
    # ... and as cached: context, but the request has not started (it holds no KV of its own)
    assert snap.cached_tokens[row] == native and not snap.started[row]
    execs = _record_executions(s)
    so = s.schedule()
    # the plan allocates the tokens beyond the hit, which is exactly what vLLM scheduled
    assert execs and execs[-1][0][second.request_id] == 270 - native
    assert so.num_scheduled_tokens[second.request_id] == 270 - native
    assert second.num_computed_tokens == 270  # vLLM admitted it with the hit: 192 + 78
    s.slidingserve_close()


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["slidingserve", "vllm-fcfs"])
@pytest.mark.parametrize("num_blocks", [600, 120], ids=["roomy", "kv-pressure"])
def test_shared_prefixes_many_iterations_nothing_lost_or_stalled(base: type, async_: bool, policy: str,
                                                                  num_blocks: int, mdir: str) -> None:
    """Requests sharing three system prompts (and some multi-turn ones: an earlier request's
    whole prompt plus more) arrive over time; every one finishes with its tokens, KV is not
    leaked, plans are executed as planned, and the snapshots did show hits."""
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_DEPLOYMENT": policy}, clock)
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=num_blocks)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    rng = np.random.default_rng(7)
    prompts = [system_prompt(n, seed) for seed, n in enumerate((160, 300, 64))]
    spec: list[Request] = []
    for k in range(60):
        if k % 5 == 4 and spec:  # a later turn: an earlier prompt, its answer, a question
            prev = spec[int(rng.integers(len(spec)))]
            r = shared(list(prev.prompt_token_ids or []) + [7] * 10, int(rng.integers(8, 60)),
                       int(rng.integers(1, 16)), slo_ttft_ms=500, slo_tbt_ms=60)
        else:
            r = shared(prompts[int(rng.integers(3))], int(rng.integers(8, 200)), int(rng.integers(1, 16)),
                       slo_ttft_ms=500, slo_tbt_ms=60)
        spec.append(r)
    want = {r.request_id: r.max_tokens for r in spec}
    late = iter(spec[6:])
    for r in spec[:6]:
        s.add_request(r)
    shown = {"hits": 0}
    orig_view = s._view

    def view(**kw: Any) -> Any:
        v = orig_view(**kw)
        if v.hits is not None:
            shown["hits"] += int(np.count_nonzero(v.hits))
            wait = np.arange(len(v.snap)) >= v.running_rows
            # a hit shows as computed tokens of a waiting row, below its prompt
            assert (v.snap.computed_tokens[wait] >= v.hits[wait]).all()
            assert (v.hits < v.snap.prompt_tokens).all()
            # the same hits as cached tokens, on waiting rows only: no running request has any
            assert np.array_equal(v.snap.cached_tokens[wait], v.hits[wait])
            assert not v.snap.cached_tokens[~wait].any()
        return v

    s._view = view
    execs = _record_executions(s)
    prepared: dict[str, int] = {}
    check_prepared_fits(s, prepared)

    def arrive(k: int, so: Any) -> None:
        for _ in range(2):
            nxt = next(late, None)
            if nxt is not None:
                s.add_request(nxt)

    res = Driver(s, clock, async_scheduling=async_).run(on_step=arrive)
    st = s.slidingserve_stats()
    assert res.finished == want  # every request, with exactly its tokens
    assert not s.requests and not s.running and not s.waiting
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    assert shown["hits"] > 20 and s._ss_hits.lookups > 0
    assert st["planned"] > 0.6 * st["iterations"], st
    # what vLLM scheduled for each planned request is what the plan allocated (after the hit)
    assert st["deviating_iterations"] == 0, st
    admitted = [(p, out) for p, out in execs if p]
    assert admitted
    assert prepared.get("reused", 0) > 0.2 * st["pipelined"], (prepared, st)
    s.slidingserve_close()


def _hit_shown(env: dict[str, str], mdir: str, *, caching: bool = True, skip_cache: bool = False) -> int:
    cls = scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_PIPELINE": "off", **env})
    s = build_scheduler(cls, mdir, async_scheduling=False, enable_prefix_caching=caching)
    prefix = system_prompt(100, 3)
    _warm(s, prefix)
    r = shared(prefix, 40, 2, skip_cache=skip_cache)
    s.add_request(r)
    snap, _, _ = s._snapshot()
    out = int(snap.computed_tokens[snap.index_of[r.request_id]])
    res = Driver(s, async_scheduling=False).run()
    assert res.finished == {r.request_id: 2}
    s.slidingserve_close()
    return out


def test_no_hit_without_prefix_caching_a_cache_skipping_request_or_the_setting_off(mdir: str) -> None:
    assert _hit_shown({}, mdir) == 96
    assert _hit_shown({}, mdir, caching=False) == 0
    assert _hit_shown({}, mdir, skip_cache=True) == 0
    assert _hit_shown({"SLIDINGSERVE_PREFIX_LOOKUP": "false"}, mdir) == 0


def test_lookup_off_where_vllm_computes_hits_otherwise(mdir: str) -> None:
    s = build_scheduler(scheduler_class(RemoteSyncScheduler, {}), mdir, async_scheduling=False,
                        enable_prefix_caching=False)
    assert prefix_lookup_off(s) == "prefix caching is off" and s._view().hits is None
    s.slidingserve_close()
    s = build_scheduler(scheduler_class(RemoteSyncScheduler, {}), mdir, async_scheduling=False)
    assert prefix_lookup_off(s) == "" and s._view().hits is not None
    # asked at every snapshot: vLLM's own tests attach an auxiliary-output connector after start
    s.aux_output_connector = object()
    assert prefix_lookup_off(s) == "an auxiliary-output connector caps the hits" and s._view().hits is None
    s.aux_output_connector = None
    s.prefix_replay_tokens = 64  # a sliding-window model's bounded replay
    assert prefix_lookup_off(s) == "prefix replay recomputes part of every hit" and s._view().hits is None
    s.slidingserve_close()


def test_a_stale_hit_neither_loses_nor_stalls_a_request(mdir: str) -> None:
    """The snapshot's hit is gone by the time the plan is executed (the blocks were evicted):
    vLLM computes the request from its smaller hit, capped at the plan's allocation, and the
    request finishes."""
    cls = scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_DEPLOYMENT": "slidingserve"})
    s = build_scheduler(cls, mdir, async_scheduling=False)
    prefix = system_prompt(128, 5)
    _warm(s, prefix)
    r = shared(prefix, 40, 4)
    s.add_request(r)
    v = s._view()
    assert v.snap.computed_tokens[v.snap.index_of[r.request_id]] == 128
    s.kv_cache_manager.reset_prefix_cache()  # every cached block evicted
    decision = s._core().decide(v.snap)
    assert decision.plan is not None
    fit = s._apply(s._take(v, decision, "", s._ss_free_blocks(), stale=False))
    assert fit is not None and fit.plan[r.request_id] == 168 - 128
    out = s._execute(fit, (), {})
    # vLLM found no hit now: it computes the planned 40 tokens from the start
    assert out.num_scheduled_tokens[r.request_id] == 40 and r.num_computed_tokens == 40
    s.update_from_output(out, fake_output(s, out))
    res = Driver(s, async_scheduling=False).run()
    assert list(res.finished) == [r.request_id] and not s.requests
    s.slidingserve_close()
