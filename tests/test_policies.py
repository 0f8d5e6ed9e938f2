"""Hand-built cases per policy; registry and parameter overrides."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler_service.core import Plan, Policy, ValidationError, registry, slidingserve
from scheduler_service.core.registry import PolicySpec
from tests.factories import decoding, make_snapshot, prefilling, token_predictor, waiting

PRED = token_predictor(intercept_ms=1.0, per_token_ms=0.01, per_decode_ms=0.05)
ALL = ["vllm-fcfs", "vllm-priority", "sarathi", "sarathi-edf", "qoserve", "sarathi-edf+sc", "sarathi-edf+sc+mlps",
       "slidingserve"]


def alloc(plan: Plan) -> dict[str, int]:
    return plan.tokens_by_id()


def check_plan(plan: Plan, name: str) -> None:
    assert plan.policy == name
    assert plan.token_budget == sum(a.tokens for a in plan.allocations)
    assert plan.predictor_version == PRED.version


# ------------------------------------------------------------ vllm-fcfs
def test_vllm_fcfs_running_first_then_waiting_fcfs_chunked() -> None:
    reqs = [
        waiting("w1", 100, arrival=1.0),
        decoding("d1", 10, 3, arrival=3.0),
        prefilling("p", 80, 30, arrival=2.0),
        waiting("w2", 10, arrival=4.0),
    ]
    pol = registry.create("vllm-fcfs")
    plan = pol.plan(make_snapshot(reqs, now=5.0, max_batch_tokens=60), PRED)
    check_plan(plan, "vllm-fcfs")
    assert plan.path == "vllm-fcfs"
    # running by arrival: p (50 left), d1 (1); then waiting w1 (arrival 1) gets the last 9
    assert alloc(plan) == {"p": 50, "d1": 1, "w1": 9}
    assert plan.token_budget == 60
    plan = pol.plan(make_snapshot(reqs, now=5.0, max_batch_tokens=60, max_num_seqs=2), PRED)
    assert alloc(plan) == {"p": 50, "d1": 1}
    plan = pol.plan(make_snapshot(reqs, now=5.0, max_batch_tokens=500), PRED)
    assert alloc(plan) == {"p": 50, "d1": 1, "w1": 100, "w2": 10}
    plan = pol.plan(make_snapshot(reqs, now=5.0, max_batch_tokens=500, free_kv_tokens=70), PRED)
    assert alloc(plan) == {"p": 50, "d1": 1, "w1": 19}


# -------------------------------------------------------------- sarathi
def sarathi_snapshot() -> list:
    return [
        decoding("d2", 10, 1, arrival=6.0),
        decoding("d1", 10, 1, arrival=5.0),
        waiting("w-late", 40, arrival=1.0, ttft=20.0),    # deadline 21
        waiting("w-early", 40, arrival=2.0, ttft=10.0),   # deadline 12
        prefilling("p", 60, 30, arrival=3.0, ttft=30.0),  # deadline 33, started
    ]


def test_sarathi_fixed_budget_decodes_first_then_started_then_fcfs() -> None:
    snap = make_snapshot(sarathi_snapshot(), now=7.0, max_batch_tokens=2048)
    plan = registry.create("sarathi", {"chunk_size": 40}).plan(snap, PRED)
    check_plan(plan, "sarathi")
    assert plan.path == "sarathi"
    assert alloc(plan) == {"d1": 1, "d2": 1, "p": 30, "w-late": 8}
    assert plan.token_budget == 40
    # the default 512 is capped by max_batch_tokens
    plan = registry.create("sarathi").plan(make_snapshot(sarathi_snapshot(), now=7.0, max_batch_tokens=50), PRED)
    assert plan.token_budget == 50 and alloc(plan) == {"d1": 1, "d2": 1, "p": 30, "w-late": 18}


def test_sarathi_edf_orders_prefills_by_deadline() -> None:
    snap = make_snapshot(sarathi_snapshot(), now=7.0)
    plan = registry.create("sarathi-edf", {"chunk_size": 60}).plan(snap, PRED)
    check_plan(plan, "sarathi-edf")
    assert plan.path == "sarathi-edf"
    assert alloc(plan) == {"d1": 1, "d2": 1, "w-early": 40, "w-late": 18}


def test_sarathi_chunk_smaller_than_decodes_keeps_earliest() -> None:
    snap = make_snapshot(sarathi_snapshot(), now=7.0)
    plan = registry.create("sarathi", {"chunk_size": 1}).plan(snap, PRED)
    assert alloc(plan) == {"d1": 1}


# -------------------------------------------------------------- qoserve
def test_qoserve_search_space() -> None:
    pol = registry.create("qoserve")
    assert pol.search_space(2048).tolist() == [128, *range(256, 2049, 256)]
    assert pol.search_space(300).tolist() == [128, 256, 300]
    assert pol.search_space(100).tolist() == [100]


def qoserve_snapshot(decode_slack_ms: float) -> list:
    # decode slack = 9 + ttft + 1·0.1 − 10
    return [decoding("d", 10, 1, arrival=9.0, ttft=0.9 + decode_slack_ms / 1e3, tbt=0.1),
            waiting("w", 3000, arrival=9.9, ttft=5.0)]


@pytest.mark.parametrize(
    ("slack_ms", "safety", "total"),
    [
        # t(B) = 1.05 + 0.01·(B − 1) ms;  largest B in {128, 256, 512, ...} with t·sf ≤ slack
        (7.0, 1.2, 256),    # 7/1.2 = 5.83 → B ≤ 479
        (7.0, 1.0, 512),    # 7 → B ≤ 596
        (20.0, 1.2, 1536),  # 16.67 → B ≤ 1563
        (1.0, 1.2, 128),    # nothing fits → the first entry
    ],
)
def test_qoserve_dynamic_chunk_and_safety_factor(slack_ms: float, safety: float, total: int) -> None:
    snap = make_snapshot(qoserve_snapshot(slack_ms), now=10.0, max_batch_tokens=2048)
    plan = registry.create("qoserve", {"safety_factor": safety}).plan(snap, PRED)
    check_plan(plan, "qoserve")
    assert plan.path == "qoserve"
    assert alloc(plan) == {"d": 1, "w": total - 1}


def test_qoserve_no_decodes_takes_the_largest_entry() -> None:
    snap = make_snapshot([waiting("w", 3000, arrival=9.9, ttft=5.0)], now=10.0, max_batch_tokens=1000)
    assert alloc(registry.create("qoserve").plan(snap, PRED)) == {"w": 1000}


def relegation_snapshot(rho: float | None) -> object:
    reqs = [
        waiting("R1", 100, arrival=9.0, ttft=1.01),        # deadline now + 0.01, not yet started
        waiting("R2", 100, arrival=9.0, ttft=1.5),         # deadline now + 0.5
        prefilling("P3", 200, 150, arrival=9.0, ttft=1.01),  # deadline now + 0.01, started: never relegated
    ]
    return make_snapshot(reqs, now=10.0, max_batch_tokens=150, prefill_throughput=rho)


def test_qoserve_relegation() -> None:
    pol = registry.create("qoserve")
    # ρ = 5000 tok/s: R1 needs 20 ms > its 10 ms → relegated behind R2
    # keys: P3 now+.01+.008·50 = .41, R2 .5+.8 = 1.3, R1 relegated
    assert list(alloc(pol.plan(relegation_snapshot(5000.0), PRED)).items()) == [("P3", 50), ("R2", 100)]
    # ρ = 1e6 tok/s: nobody relegated; R1 key .01+.8 = .81 < R2 1.3
    assert list(alloc(pol.plan(relegation_snapshot(1e6), PRED)).items()) == [("P3", 50), ("R1", 100)]
    # hybrid coefficient 0: pure EDF; R1 and P3 share the deadline → arrival tie → id: P3 < R1
    pol0 = registry.create("qoserve", {"hybrid_coef_s": 0.0})
    assert list(alloc(pol0.plan(relegation_snapshot(1e6), PRED)).items()) == [("P3", 50), ("R1", 100)]


# --------------------------------------------------------- slidingserve
def urgent_behind_long(short_ttft: float) -> object:
    reqs = [
        decoding("d", 10, 1, arrival=9.0, ttft=1.0, tbt=0.1),            # slack 100 ms
        waiting("L", 2000, arrival=9.0, ttft=2.0, protected=True),       # protected: first in MLPS
        waiting("S", 20, arrival=9.9, ttft=short_ttft),                  # short
    ]
    return make_snapshot(reqs, now=10.0, max_batch_tokens=2048, prefill_throughput=10000.0)


def test_slidingserve_batch_constructor_for_short_urgent_behind_long() -> None:
    # greedy fill gives L 2047 tokens: T̂_full ≈ 21.5 ms > S's slack 10 ms → S risky;
    # C_S = TimeToBudget(10 ms) − 1 ≈ 894 ≥ 20; L (2000) does not fit beside it.
    plan = registry.create("slidingserve").plan(urgent_behind_long(0.11), PRED)
    check_plan(plan, "slidingserve")
    assert plan.path == "batch_constructor"
    assert alloc(plan) == {"d": 1, "S": 20}


def test_slidingserve_sliding_chunker_when_nothing_is_risky() -> None:
    plan = registry.create("slidingserve").plan(urgent_behind_long(2.0), PRED)
    assert plan.path == "sliding_chunker"
    a = alloc(plan)
    assert a["d"] == 1 and a["L"] > 0
    assert plan.token_budget <= 2048


def test_slidingserve_ablations_never_construct() -> None:
    for name in ("sarathi-edf+sc", "sarathi-edf+sc+mlps"):
        plan = registry.create(name).plan(urgent_behind_long(0.11), PRED)
        assert plan.path == "sliding_chunker" and plan.policy == name
    plan = registry.create("slidingserve", {"batch_constructor": "false"}).plan(urgent_behind_long(0.11), PRED)
    assert plan.path == "sliding_chunker"


def test_slidingserve_expired_is_never_an_anchor_but_still_served() -> None:
    reqs = [
        decoding("d", 10, 1, arrival=9.0, ttft=1.0, tbt=0.1),
        waiting("X", 20, arrival=9.4, ttft=0.5),            # expired, not starving
        waiting("L", 100, arrival=9.0, ttft=2.0),
    ]
    plan = registry.create("slidingserve").plan(make_snapshot(reqs, now=10.0, prefill_throughput=1e4), PRED)
    assert plan.path == "sliding_chunker"
    assert alloc(plan) == {"d": 1, "L": 100, "X": 20}
    assert [a.id for a in plan.allocations] == ["d", "L", "X"]


def test_slidingserve_decode_only_and_idle() -> None:
    pol = registry.create("slidingserve")
    snap = make_snapshot([decoding("a", 10, 2), decoding("b", 5, 1)], now=0.0)
    plan = pol.plan(snap, PRED)
    assert plan.path == "decode_only" and alloc(plan) == {"a": 1, "b": 1}
    assert plan.predicted_latency_ms == pytest.approx(1.0 + 2 * 0.05)
    plan = pol.plan(make_snapshot([], now=0.0), PRED)
    assert plan.path == "idle" and plan.allocations == () and plan.token_budget == 0
    assert plan.predicted_latency_ms == 0.0
    # no decodes: budget B_max, greedy fill
    plan = pol.plan(make_snapshot(create_waiting(), now=10.0, max_batch_tokens=64), PRED)
    assert plan.path == "sliding_chunker" and plan.token_budget == 64


def create_waiting() -> list:
    return [waiting("a", 50, arrival=9.0, ttft=5.0), waiting("b", 50, arrival=9.1, ttft=5.0)]


def test_slidingserve_window_1_is_time_to_budget() -> None:
    # t = 1.05 + 0.01·P ms
    reqs = [decoding("d", 10, 1, arrival=9.0, ttft=0.95, tbt=0.1), waiting("L", 5000, arrival=9.0, ttft=9.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=4096)
    plan = registry.create("slidingserve", {"window": "1", "margin": 1}).plan(snap, PRED)
    # T_cur = 50 ms → P ≤ (50 − 1.05)/0.01 = 4895 → capped at 4095
    assert alloc(plan) == {"d": 1, "L": 4095}
    reqs[0] = decoding("d", 10, 1, arrival=9.0, ttft=0.9105, tbt=0.1)   # T_cur = 10.5 ms → P ≤ 945
    plan = registry.create("slidingserve", {"window": 1, "margin": 1}).plan(
        make_snapshot(reqs, now=10.0, max_batch_tokens=4096), PRED)
    assert alloc(plan) == {"d": 1, "L": 945}
    # margin 1.05: predicted times count 5% over → T_cur / 1.05 = 10 ms → P ≤ 895
    plan = registry.create("slidingserve", {"window": 1, "margin": 1.05}).plan(
        make_snapshot(reqs, now=10.0, max_batch_tokens=4096), PRED)
    assert alloc(plan) == {"d": 1, "L": 895}


def test_slidingserve_window_3_survives_a_window_no_split_fits() -> None:
    """Decode-only iterations cost 0.4 ms; W = (0.5, 0.75, 1.0) ms: one iteration fits, two
    never do.  The plan must still come back (decode-only, like an infeasible W1)."""
    from tests.factories import linear_model, make_predictor
    pred = make_predictor(linear_model(1.0, x4=0.25, x6=0.125), decode=linear_model(0.15, x4=0.25),
                          mixed=linear_model(0.75, x4=0.25, x6=0.125))
    reqs = [decoding("d", 5, 1, arrival=9.0, ttft=1.00025, tbt=0.00025), waiting("w", 100, arrival=9.5, ttft=5.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=64)
    for name in ("slidingserve", "sarathi-edf+sc"):
        plan = registry.create(name, {"window": 3}).plan(snap, pred)
        assert alloc(plan)["d"] == 1


# ------------------------------------------------------------- registry
def test_registry_names() -> None:
    assert sorted(registry.names()) == sorted(ALL)
    for n in ALL:
        pol = registry.create(n)
        assert isinstance(pol, Policy) and pol.name == n and pol.version == registry.describe(n)["version"]


def test_builtin_policies_are_one_explicit_list() -> None:
    assert [s.name for s in registry.BUILTIN] == registry.names()[: len(registry.BUILTIN)]
    assert [s.name for s in registry.BUILTIN] == [
        "vllm-fcfs", "vllm-priority", "sarathi", "sarathi-edf", "qoserve", "slidingserve", "sarathi-edf+sc",
        "sarathi-edf+sc+mlps"]
    assert {s.name: s.default_params for s in registry.BUILTIN}["sarathi-edf+sc"].order == "edf"


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ValidationError) as ei:
        registry.create("sliding-serve")
    (v,) = ei.value.violations
    assert v.field == "policy" and "'sliding-serve'" in v.description
    for n in ALL:
        assert n in v.description
    with pytest.raises(ValidationError):
        registry.describe("nope")


def test_duplicate_registration_raises() -> None:
    registry.names()
    spec = PolicySpec("slidingserve", "9", "dup", None, lambda n, v, p: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(spec)
    assert registry.create("slidingserve").version == slidingserve.VERSION


def test_params_override_parse_and_validate() -> None:
    pol = registry.create("slidingserve", {"window": "1", "alpha": "2.5", "batch_constructor": "no"})
    assert pol.params.window == 1 and isinstance(pol.params.window, int)
    assert pol.params.alpha == 2.5 and pol.params.batch_constructor is False
    assert registry.create("slidingserve", {"window": 3.0}).params.window == 3
    with pytest.raises(ValidationError) as ei:
        registry.create("slidingserve", {"window": 5, "alpha": -1, "granularity": "x", "order": "lifo",
                                         "window_size": 2, "batch_constructor": "maybe", "epsilon_s": "nan"})
    v = {x.field: x.description for x in ei.value.violations}
    assert set(v) == {"params.window", "params.alpha", "params.granularity", "params.order",
                      "params.window_size", "params.batch_constructor", "params.epsilon_s"}
    assert "<= 4" in v["params.window"] and ">= 0" in v["params.alpha"]
    assert "unknown parameter" in v["params.window_size"]
    for key in ("window", "alpha", "granularity", "max_candidates", "order"):
        assert key in v["params.window_size"]
    with pytest.raises(ValidationError) as ei:
        registry.create("slidingserve", {"window": 2.5})
    assert ei.value.violations[0].field == "params.window"
    with pytest.raises(ValidationError) as ei:
        registry.create("sarathi", {"chunk_size": True})
    assert ei.value.violations[0].field == "params.chunk_size"


def test_versions_differ_with_overrides() -> None:
    base = registry.create("slidingserve")
    w1 = registry.create("slidingserve", {"window": "1"})
    w1b = registry.create("slidingserve", {"window": 1})
    w3 = registry.create("slidingserve", {"window": 3})
    assert base.version == slidingserve.VERSION
    assert w1.version.startswith(slidingserve.VERSION + "+") and w1.version == w1b.version
    assert len({base.version, w1.version, w3.version}) == 3
    assert registry.create("slidingserve", {"window": 2}).version == base.version  # the default
    # the ablations share a base version but differ in parameters, not in name/version pairs
    assert registry.create("sarathi-edf+sc").version == slidingserve.VERSION
    snap = make_snapshot(create_waiting(), now=10.0)
    assert base.plan(snap, PRED).policy_version == slidingserve.VERSION
    assert w1.plan(snap, PRED).policy_version == w1.version


def test_describe_lists_params() -> None:
    d = registry.describe("slidingserve")
    names = {p["name"]: p for p in d["params"]}
    assert names["window"]["default"] == 2 and names["window"]["min"] == 1 and names["window"]["max"] == 4
    assert names["order"]["choices"] == ["mlps", "edf"]
    assert all(p["doc"] for p in d["params"])
    for n in ALL:
        params = registry.create(n).params
        assert dataclasses.is_dataclass(params)


def test_plan_json_round_trip() -> None:
    snap = make_snapshot(sarathi_snapshot(), now=7.0)
    for n in ALL:
        plan = registry.create(n).plan(snap, PRED)
        back = Plan.from_dict(plan.to_dict())
        assert back.allocations == plan.allocations and back.path == plan.path
        assert back.decision_key()[:5] == plan.decision_key()[:5]
        assert np.isclose(back.predicted_latency_ms, plan.predicted_latency_ms)


# ------------------------------------------- KV growth and hopeless prefills
def test_new_admissions_leave_the_kv_growth_watermark() -> None:
    """Running requests (2 decodes, 1 partial prefill) hold KV; a new request is admitted
    only while kv_growth_iters tokens per running request stay free; the partial prefill
    is not held back by the watermark."""
    reqs = [decoding("d1", 50, 3, arrival=1.0, ttft=5.0), decoding("d2", 50, 3, arrival=1.0, ttft=5.0),
            prefilling("p", 300, 100, arrival=2.0, ttft=5.0), waiting("w", 900, arrival=3.0, ttft=5.0)]
    snap = make_snapshot(reqs, now=4.0, max_batch_tokens=4096, free_kv_tokens=1000)
    # free 1000 − 2 decodes − 1 token reserved per decode = 996 for prefills;
    # watermark 3 running × 64 = 192 → new admissions up to 804 tokens in all
    got = alloc(registry.create("slidingserve", {"window": 1, "decode_skip_tbts": 0}).plan(snap, PRED))
    assert got == {"d1": 1, "d2": 1, "p": 200, "w": 604}
    got = alloc(registry.create("slidingserve", {"window": 1, "kv_growth_iters": 0, "decode_skip_tbts": 0}
                                ).plan(snap, PRED))
    assert got == {"d1": 1, "d2": 1, "p": 200, "w": 796}
    tight = make_snapshot(reqs, now=4.0, max_batch_tokens=4096, free_kv_tokens=250)
    # 246 for prefills; the watermark (192) leaves 54 < the partial prefill's 200: it still
    # gets what the headroom allows, the new request nothing
    got = alloc(registry.create("slidingserve", {"window": 1, "decode_skip_tbts": 0}).plan(tight, PRED))
    assert got == {"d1": 1, "d2": 1, "p": 200}


def test_hopeless_prefills_are_served_after_the_live_ones() -> None:
    """w1 needs 3000 tokens in 10 ms (PRED prefills ~100k tokens/s at full budget: hopeless);
    w2 can still make it.  MLPS alone puts the urgent w1 first; with hopeless_factor it goes last."""
    reqs = [waiting("w1", 3000, arrival=9.0, ttft=1.01), waiting("w2", 800, arrival=9.5, ttft=1.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=1000)
    first = registry.create("slidingserve", {"hopeless_factor": 0, "lost_rule": "alone"}).plan(snap, PRED)
    first = first.allocations[0].id
    assert first == "w1"
    plan = registry.create("slidingserve").plan(snap, PRED)
    assert plan.allocations[0].id == "w2" and alloc(plan) == {"w2": 800, "w1": 200}


def test_decodes_far_ahead_sit_out_while_prefills_wait() -> None:
    """TBT deadlines are cumulative (formula (1)): a decode 6+ TBTs ahead of its next
    token's deadline can skip an iteration.  It does so only while a live prefill waits
    (``sit_out_when="waiting"``), and by default only when that prefill needs the room."""
    # now 10; next-token deadline = arrival + ttft + output·tbt
    ahead = decoding("ahead", 50, 2, arrival=9.0, ttft=1.5, tbt=0.05)    # slack 0.6 s = 12 TBT
    close = decoding("close", 50, 2, arrival=9.0, ttft=1.05, tbt=0.05)   # slack 0.15 s = 3 TBT
    w = waiting("w", 100, arrival=9.9, ttft=1.0)
    # w (100 tokens, 0.9 s of slack) makes its TTFT beside both decodes: nobody sits out
    needed = registry.create("slidingserve")
    assert alloc(needed.plan(make_snapshot([ahead, close, w], now=10.0), PRED)) == {"ahead": 1, "close": 1, "w": 100}
    pol = registry.create("slidingserve", {"sit_out_when": "waiting"})
    assert alloc(pol.plan(make_snapshot([ahead, close, w], now=10.0), PRED)) == {"close": 1, "w": 100}
    # no prefill waiting: everyone decodes
    assert alloc(pol.plan(make_snapshot([ahead, close], now=10.0), PRED)) == {"ahead": 1, "close": 1}
    # the only prefill is expired: nothing to gain, everyone decodes
    late = waiting("late", 100, arrival=8.0, ttft=1.0)
    assert alloc(pol.plan(make_snapshot([ahead, close, late], now=10.0), PRED))["ahead"] == 1
    off = registry.create("slidingserve", {"decode_skip_tbts": 0})
    assert alloc(off.plan(make_snapshot([ahead, close, w], now=10.0), PRED)) == {"ahead": 1, "close": 1, "w": 100}


def test_moore_gives_up_the_prefill_that_would_sink_another() -> None:
    """At the observed 1,000 tokens/s, L (600 tokens, 0.9 s of slack) and a, b (250 each,
    0.95 s and 1.0 s) cannot all make it: Moore-Hodgson gives up the longest of them, L,
    which then goes after M (700 tokens, 5 s), which can still make it."""
    reqs = [waiting("L", 600, arrival=9.0, ttft=1.9), waiting("a", 250, arrival=9.5, ttft=1.45),
            waiting("b", 250, arrival=9.5, ttft=1.5), waiting("M", 700, arrival=9.0, ttft=6.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=1200, prefill_throughput=1000.0)
    alone = registry.create("slidingserve", {"lost_rule": "alone"}).plan(snap, PRED)
    assert alloc(alone) == {"a": 250, "b": 250, "L": 600, "M": 100}
    moore = registry.create("slidingserve").plan(snap, PRED)
    assert alloc(moore) == {"a": 250, "b": 250, "M": 700}


def test_late_decodes_sit_out_while_prefills_that_can_make_it_wait() -> None:
    """A decode past its next token's deadline has missed its SLO: its token waits while a
    live prefill runs, and runs as soon as none waits; once it is starve_after TBTs late
    (starving) it runs anyway."""
    late = decoding("late", 50, 2, arrival=9.0, ttft=0.8, tbt=0.05)      # slack -0.1 s: 2 TBTs late
    close = decoding("close", 50, 2, arrival=9.0, ttft=1.05, tbt=0.05)   # slack 0.15 s
    w = waiting("w", 100, arrival=9.9, ttft=1.0)
    # by default only when w needs the room, which it does not here: the late decode runs
    assert alloc(registry.create("slidingserve").plan(make_snapshot([late, close, w], now=10.0), PRED)) == {
        "late": 1, "close": 1, "w": 100}
    pol = registry.create("slidingserve", {"sit_out_when": "waiting"})
    assert alloc(pol.plan(make_snapshot([late, close, w], now=10.0), PRED)) == {"close": 1, "w": 100}
    assert alloc(pol.plan(make_snapshot([late, close], now=10.0), PRED)) == {"late": 1, "close": 1}
    off = registry.create("slidingserve", {"skip_late_decodes": False})
    assert alloc(off.plan(make_snapshot([late, close, w], now=10.0), PRED)) == {"late": 1, "close": 1, "w": 100}
    starving = decoding("starving", 50, 2, arrival=9.0, ttft=0.5, tbt=0.05)  # slack -0.4 s: 8 TBTs late
    got = alloc(pol.plan(make_snapshot([starving, close, w], now=10.0), PRED))
    assert got == {"starving": 1, "close": 1, "w": 100}
    no_bound = registry.create("slidingserve", {"starve_after": 0, "sit_out_when": "waiting"})
    assert alloc(no_bound.plan(make_snapshot([starving, close, w], now=10.0), PRED)) == {"close": 1, "w": 100}


def test_decodes_do_not_sit_out_when_no_prefill_can_run() -> None:
    """Skipping is only worth it when the prefills can use the time: with the KV cache too
    tight to admit the waiting request, the ahead decode runs (no empty plan)."""
    ahead = decoding("ahead", 50, 2, arrival=9.0, ttft=1.5, tbt=0.05)
    w = waiting("w", 100, arrival=9.9, ttft=1.0)
    snap = make_snapshot([ahead, w], now=10.0, free_kv_tokens=2)
    assert alloc(registry.create("slidingserve").plan(snap, PRED)) == {"ahead": 1}
