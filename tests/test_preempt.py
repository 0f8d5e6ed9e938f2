"""Plan preemptions (request classes): a plan may free the KV of lower-class requests given
up part-way through their prefill, so that KV admits a live request of a higher class."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.client import SchedulerClient
from scheduler_service.core import Plan, Snapshot, default_predictor, plan_violations, registry
from scheduler_service.core.snapshot import Request
from scheduler_service.server import SchedulerServer
from scheduler_service.wire.convert import plan_from_pb, plan_to_pb
from tests.factories import random_predictor, random_snapshot
from tests.grpc_support import make_server


def kv_bound(now: float = 10.0, free_kv: int = 192) -> Snapshot:
    """A standard request given up 1,400 tokens into its 1,500-token prefill holds the KV a
    critical one needs."""
    return Snapshot.from_requests([
        Request("low", now - 5.0, 1500, computed_tokens=1400, ttft_slo=0.1, priority=1, tbt_slo=0.1),
        Request("crit", now, 800, ttft_slo=3.0, priority=0, tbt_slo=0.1),
    ], now=now, max_batch_tokens=200, free_kv_tokens=free_kv)


def test_a_lower_class_request_given_up_is_preempted_for_a_higher_class_one() -> None:
    s = kv_bound()
    plan = registry.create("slidingserve").plan(s, default_predictor())
    assert plan.preemptions == ("low",)
    assert plan.tokens_by_id() == {"crit": 200}
    assert plan_violations(s, plan) == []
    # switched off, or with room enough, or with one class: no preemption
    assert registry.create("slidingserve", {"preempt": False}).plan(s, default_predictor()).preemptions == ()
    assert registry.create("slidingserve").plan(kv_bound(free_kv=5000), default_predictor()).preemptions == ()
    same = _classes(s, np.zeros(len(s), np.int64))
    assert registry.create("slidingserve").plan(same, default_predictor()).preemptions == ()


def test_preemptions_round_trip_and_leave_old_plans_alone() -> None:
    plan = registry.create("slidingserve").plan(kv_bound(), default_predictor())
    assert Plan.from_dict(plan.to_dict()).preemptions == plan.preemptions == ("low",)
    assert plan.to_dict()["preemptions"] == ["low"]
    assert plan_from_pb(plan_to_pb(plan)) == plan
    plain = replace(plan, preemptions=())
    assert "preemptions" not in plain.to_dict()
    assert len(plan_to_pb(plain).preempt_ids) == 0
    assert plain.decision_key() != plan.decision_key()
    assert len(plain.decision_key()) == 7  # as before preemptions existed


@pytest.mark.parametrize(("preempt", "alloc", "expect"), [
    (("ghost",), {"crit": 200}, "preempts unknown request 'ghost'"),
    (("crit",), {}, "preempts request 'crit', which holds no KV"),
    (("low",), {"low": 100}, "preempts request 'low' and also allocates it tokens"),
    (("low", "low"), {"crit": 200}, "preempts request 'low' twice"),
    ((), {"crit": 200}, "200 tokens exceed free_kv_tokens 192"),
])
def test_the_plan_check_refuses_bad_preemptions(preempt: tuple[str, ...], alloc: dict[str, int],
                                                expect: str) -> None:
    s = kv_bound()
    good = registry.create("slidingserve").plan(s, default_predictor())
    allocs = tuple(type(good.allocations[0])(k, v) for k, v in alloc.items())
    bad = replace(good, preemptions=preempt, allocations=allocs, token_budget=sum(alloc.values()))
    assert expect in plan_violations(s, bad)


def _classes(s: Snapshot, priority: np.ndarray, sheddable: np.ndarray | None = None) -> Snapshot:
    cols = {k: getattr(s, k) for k in ("arrival", "prompt_tokens", "computed_tokens", "output_tokens",
                                        "ttft_slo", "tbt_slo", "protected")}
    cols["sheddable"] = s.sheddable if sheddable is None else sheddable
    return Snapshot.from_columns(now=s.now, max_batch_tokens=s.max_batch_tokens, max_num_seqs=s.max_num_seqs,
                                 ids=list(s.ids), free_kv_tokens=s.free_kv_tokens,
                                 prefill_throughput=s.prefill_throughput, priority=priority, **cols)


def _tight(seed: int) -> Snapshot:
    """Three classes (a fifth sheddable), partly prefilled requests, little free KV."""
    rng = np.random.default_rng(seed + 31)
    s = random_snapshot(seed, n=16, max_prompt=300, max_batch_tokens=int(rng.integers(16, 256)),
                        free_kv_tokens=int(rng.integers(0, 1200)), decode_frac=0.25)
    return _classes(s, rng.integers(0, 3, len(s)).astype(np.int64), rng.random(len(s)) < 0.2)


def _check(s: Snapshot, plan: Plan, pred: object) -> None:
    assert plan_violations(s, plan) == []
    if not plan.preemptions:
        return
    pol = registry.create("slidingserve")
    pre = np.flatnonzero(~s.is_decoding)
    rho = s.prefill_throughput or pred.prefill_throughput(s.max_batch_tokens)  # type: ignore[attr-defined]
    lost = pol._lost(s, pred, pre, rho)  # type: ignore[attr-defined]
    live_new = pre[(s.slack[pre] > 0) & ~lost & ~s.started[pre]]
    assert len(live_new)
    top = s.priority[live_new].min()
    given_up = set(pre[lost | (s.slack[pre] <= 0)].tolist())
    for rid in plan.preemptions:
        i = s.index_of[rid]
        # a partly prefilled request of a lower class than a live new one, given up or late
        assert not s.is_decoding[i] and s.started[i]
        assert s.priority[i] > top and i in given_up
        assert not s.sheddable[i]  # a sheddable one is rejected, not preempted
    # lowest class first, then the most KV first, and only as many as needed
    p = pol.params  # type: ignore[attr-defined]
    chosen = [s.index_of[r] for r in plan.preemptions]
    cand = [i for i in given_up if s.started[i] and s.priority[i] > top and not s.sheddable[i]]
    key = {i: (-int(s.priority[i]), -int(s.kv_tokens[i])) for i in cand}
    assert all(key[u] >= key[v] for u in set(cand) - set(chosen) for v in chosen)
    chosen.sort(key=key.__getitem__)
    need = min(int(s.remaining_prefill[live_new[s.priority[live_new] == top]].sum()), s.max_batch_tokens)
    holders = int(np.count_nonzero(s.computed_tokens > 0))
    n_dec = int(np.count_nonzero(s.is_decoding))
    avail = s.free_kv_tokens - p.kv_growth_iters * holders - p.kv_decode_reserve * n_dec
    gain = [int(s.kv_tokens[i]) + p.kv_growth_iters for i in chosen]
    assert avail < need
    assert avail + sum(gain) - gain[-1] < need  # the last one taken was still needed


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 100_000), st.booleans())
def test_preemptions_only_free_what_a_higher_class_needs(seed: int, default_pred: bool) -> None:
    s = _tight(seed)
    pred = default_predictor() if default_pred else random_predictor(seed)
    _check(s, registry.create("slidingserve").plan(s, pred), pred)


def test_preemption_happens_on_random_snapshots_and_never_with_one_class() -> None:
    pred = default_predictor()
    hits = 0
    for seed in range(300):
        s = _tight(seed)
        plan = registry.create("slidingserve").plan(s, pred)
        _check(s, plan, pred)
        hits += bool(plan.preemptions)
        one = _classes(s, np.ones(len(s), np.int64))
        assert registry.create("slidingserve").plan(one, pred).preemptions == ()
    assert hits >= 10, hits


def test_the_simulated_engine_executes_preemptions_and_loses_nothing() -> None:
    from clients.bench.runner import profile_predictor
    from clients.workloads import make_workload
    from engine_adapter.core import AdapterCore, AdapterSettings
    from engine_adapter.inprocess import InProcessBackend
    from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
    from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth

    truth, pred = load_ground_truth(DEFAULT_PROFILE), profile_predictor(DEFAULT_PROFILE)
    w = make_workload("mixed-v1", 300, 3.9, seed=1, classes="interactive-batch")
    # a third of the GPU's KV cache (the rest of the memory left unused), so that it
    # fills within a short run
    prof = replace(PROFILES[DEFAULT_PROFILE], gpu_memory_utilization=0.35)
    cfg = AdapterSettings(policy="slidingserve", profile=prof.key, report_inline=True)
    ad = AdapterCore(InProcessBackend(cfg, pred), cfg, pred)
    eng = SimulatedEngine(w, truth, prof, ad, EngineConfig(noise_seed=1))
    seen: list[str] = []
    eng.on_iteration = lambda e, snap, dec: seen.extend(dec.plan.preemptions if dec.plan else ())
    r = eng.run()
    assert len(seen) >= 3, seen
    assert r.completed + int(r.rejected.sum()) == len(w)  # every request ends, preempted ones too
    assert sum(ad.stats()["fallbacks"].values()) == 0


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with make_server() as s:
        yield s


def test_preemptions_travel_over_grpc(server: SchedulerServer) -> None:
    with SchedulerClient(server.target, timeout_s=10.0) as c:
        plan = c.schedule(kv_bound(), policy="slidingserve")
    assert plan.preemptions == ("low",) and plan.tokens_by_id() == {"crit": 200}
