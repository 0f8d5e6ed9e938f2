"""Plan preemptions with vLLM's real scheduler: a plan frees the KV of a lower-class request
given up part-way through its prefill, so that a higher-class request can be admitted."""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
from engine_adapter.vllm.observe import collect_families

from .support import Driver, FakeClock, build_scheduler, make_request, scheduler_class

CASES = [(RemoteSyncScheduler, False), (RemoteScheduler, True)]


@pytest.mark.parametrize("base,async_", CASES, ids=["sync", "async"])
def test_a_plan_preempts_a_lower_class_request_to_admit_a_higher_one(base: type, async_: bool,
                                                                       mdir: str) -> None:
    clock = FakeClock()
    cls = scheduler_class(base, {"SLIDINGSERVE_ADDRESS": "inproc", "SLIDINGSERVE_DEPLOYMENT": "slidingserve",
                                 "SLIDINGSERVE_PIPELINE": "false"}, clock)
    # 100 blocks of 16 tokens; 200 tokens a step
    s = build_scheduler(cls, mdir, async_scheduling=async_, num_blocks=100, max_num_batched_tokens=200)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    now = time.time()
    # a standard request already past its TTFT: it runs (nothing else waits) but is given up
    low = make_request(1500, 2, arrival=now - 5, priority=1, extra_args={"slo_ttft_ms": 100, "slo_tbt_ms": 60})
    s.add_request(low)
    d = Driver(s, clock, async_scheduling=async_)
    d.sched_outputs = {}  # steps driven by hand before run()
    for _ in range(7):  # 1,400 of its 1,500 tokens: 88 of the 100 blocks
        d.step()
    assert low.status == RequestStatus.RUNNING and 0 < low.num_computed_tokens < 1500
    held = s.kv_cache_manager.block_pool.get_num_free_blocks()
    assert held < free0
    # a critical request that the KV left cannot admit
    crit = make_request(800, 2, priority=0, extra_args={"slo_ttft_ms": 3000, "slo_tbt_ms": 60})
    s.add_request(crit)
    so = d.step()
    assert low.request_id in so.preempted_req_ids
    assert low.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING) and low.num_computed_tokens == 0
    assert so.num_scheduled_tokens.get(crit.request_id, 0) > 0  # admitted in the same step
    assert low.request_id not in so.num_scheduled_tokens
    res = d.run()
    # both complete: the preempted one is recomputed, nothing is lost
    assert res.finished[crit.request_id] == 2 and res.finished[low.request_id] == 2
    assert not s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    st = s.slidingserve_stats()
    assert st["plan_preemptions"] == 1
    fam = next(f for f in collect_families(st, {}) if f.name == "slidingserve_adapter_plan_preemptions")
    assert [x.value for x in fam.samples if x.name.endswith("_total")] == [1.0]
    s.slidingserve_close()
