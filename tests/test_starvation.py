"""SlidingServe's starvation bound (``starve_after``, docs/policies.md, "Starvation bound").

A prefill that has waited ``starve_after`` × its TTFT SLO since arrival is starving: it is no
longer given up on, starving prefills head the queue oldest first, and the oldest gets
min(its remaining prompt, the iteration's prefill room at the full token budget) whatever the
decode windows say.  A decode ``starve_after`` TBTs late no longer sits out.  All of this
while the starving prefills' work fits the live prefills' spare slack; where it does not, the
bound waits and the plan is exactly the one without it (``waits``; tests/test_load_curve.py
has the hand-built cases).

Properties on random snapshots (partly prefilled requests, tight SLOs, tiny KV and sequence
limits, aged by up to a few seconds so that starving requests are common) and random
predictors, each with a count of the cases where the rule decided something (the plan without
the bound differs), so that none passes vacuously; the bound switched off plans exactly as
version 1.1.0 did (digests of seeded plans taken on that code).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Request,
    Snapshot,
    default_predictor,
    plan_violations,
    registry,
)
from scheduler_service.core.reasons import explain, plan_explained
from tests.factories import (
    decoding,
    make_snapshot,
    prefilling,
    random_predictor,
    random_snapshot,
    token_predictor,
    waiting,
)
from tests.strategies import NOW, predictors, snapshots

STARVE = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
any_predictor = st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True))
PRED = token_predictor(intercept_ms=1.0, per_token_ms=0.01, per_decode_ms=0.05)
#: Cases where the bound changed what a property checks, per property (checked after them).
ACTED: dict[str, int] = {}


@st.composite
def aged_snapshots(draw: st.DrawFn, fresh: bool = False) -> Snapshot:
    """``tests.strategies.snapshots`` looked at up to a few seconds later: prefills that have
    waited several TTFTs and decodes several TBTs late are common.  With ``fresh``, one to
    three prompts that just arrived are added (live prefills, for which decodes sit out)."""
    snap = draw(snapshots(max_n=12, max_prompt=120, max_bmax=128))
    d = snap.to_dict()
    d["now"] = NOW + draw(st.one_of(st.sampled_from([0.0, 0.5, 2.0]), st.floats(0.0, 4.0)))
    for k in range(draw(st.integers(1, 3)) if fresh else 0):
        d["requests"].append({"id": f"fresh{k}", "arrival": d["now"], "prompt_tokens": draw(st.integers(1, 64)),
                              "computed_tokens": 0, "output_tokens": 0, "ttft_slo": draw(st.floats(0.5, 3.0)),
                              "tbt_slo": 0.05, "protected": False})
    return Snapshot.from_json(d)


def alloc(plan: Plan) -> dict[str, int]:
    return plan.tokens_by_id()


def starving_prefills(snap: Snapshot, after: float) -> list[int]:
    """Rows of the starving prefills (one class), oldest first (arrival, then id)."""
    rows = np.flatnonzero(~snap.is_decoding & (snap.now - snap.arrival >= after * snap.ttft_slo))
    return sorted(rows.tolist(), key=lambda i: (snap.arrival[i], snap.ids[i]))


def starving_decodes(snap: Snapshot, after: float) -> np.ndarray:
    return np.flatnonzero(snap.is_decoding & (snap.slack <= -after * snap.tbt_slo))


def prefill_room(snap: Snapshot, plan: Plan, row: int, params: Any) -> int:
    """min(remaining prompt, the prefill room at the full budget) of request ``row`` beside
    the plan's decodes: the token budget and sequence slots they leave, the KV headroom
    less one token per decode and ``kv_decode_reserve`` per running decode, and for a new
    request the KV-growth watermark too (docs/policies.md)."""
    n_dec = sum(int(snap.is_decoding[snap.index_of[a.id]]) for a in plan.allocations)
    if snap.max_num_seqs - n_dec < 1:
        return 0
    room = min(int(snap.remaining_prefill[row]), snap.max_batch_tokens - n_dec)
    if snap.free_kv_tokens is not None:
        kv = snap.free_kv_tokens - n_dec - params.kv_decode_reserve * int(snap.is_decoding.sum())
        if not snap.started[row]:
            kv -= params.kv_growth_iters * int(np.count_nonzero(snap.started))
        room = min(room, kv)
    return max(room, 0)


def off_plan(snap: Snapshot, pred: BatchLatencyPredictor, overrides: dict[str, Any]) -> Plan:
    return registry.create("slidingserve", {**overrides, "starve_after": 0}).plan(snap, pred)


def waits(pol: Any, snap: Snapshot, pred: BatchLatencyPredictor, plan: Plan, overrides: dict[str, Any]) -> bool:
    """Whether the bound waits on ``snap`` (its starving prefills' work does not fit the live
    prefills' spare slack): then the plan is exactly the one without the bound."""
    if pol._bound_fits(snap, pred):
        return False
    assert plan.decision_key()[3:] == off_plan(snap, pred, overrides).decision_key()[3:]
    ACTED["waited"] = ACTED.get("waited", 0) + 1
    return True


# ------------------------------------------------------------------------- prefills
PREFILL_CASES = [{}, {"starve_after": 0.5}, {"window": 1}, {"order": "edf", "batch_constructor": False}]


@pytest.mark.parametrize("overrides", PREFILL_CASES, ids=["default", "half", "k1", "edf"])
@STARVE
@given(snap=aged_snapshots(), pred=any_predictor)
def test_the_oldest_starving_prefill_gets_its_room_and_starving_ones_go_first(
        overrides: dict[str, Any], snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    """Whenever a starving prefill exists and the limits leave room for a prefill token, the
    oldest gets at least min(remaining, room at the full budget); starving prefills come first
    in the plan, oldest first, and another prefill gets tokens only once every starving one is
    served in full."""
    pol = registry.create("slidingserve", overrides)
    plan = pol.plan(snap, pred)
    assert plan_violations(snap, plan) == []
    rows = starving_prefills(snap, pol.params.starve_after)
    if not rows:
        return
    if waits(pol, snap, pred, plan, overrides):
        return
    got = alloc(plan)
    need = prefill_room(snap, plan, rows[0], pol.params)
    assert got.get(snap.ids[rows[0]], 0) >= need, (need, got)
    if need > 0 and alloc(off_plan(snap, pred, overrides)).get(snap.ids[rows[0]], 0) < need:
        ACTED["prefill"] = ACTED.get("prefill", 0) + 1
    starving = {snap.ids[i] for i in rows}
    prefills = [a for a in plan.allocations if not snap.is_decoding[snap.index_of[a.id]]]
    head = [a.id for a in prefills if a.id in starving]
    assert [a.id for a in prefills[:len(head)]] == head, "starving prefills go first"
    assert head == [snap.ids[i] for i in rows if snap.ids[i] in head], "oldest first"
    if len(prefills) > len(head):
        assert all(got.get(snap.ids[i], 0) == int(snap.remaining_prefill[i]) for i in rows)
    if got.get(snap.ids[rows[0]], 0):
        assert plan.path == "sliding_chunker"


# -------------------------------------------------------------------------- decodes
@settings(STARVE, max_examples=600)  # the bound acts in fewer draws here than for prefills
@given(snap=st.one_of(aged_snapshots(), aged_snapshots(fresh=True)), pred=any_predictor,
       skip=st.sampled_from([6.0, 1.0, 0.0]))
def test_a_starving_decode_runs_whenever_a_decode_can(snap: Snapshot, pred: BatchLatencyPredictor,
                                                     skip: float) -> None:
    """A decode ``starve_after`` TBTs late or more is scheduled whenever a decode can be: all of
    them when the limits (token budget, sequence slots, KV) hold them, else only they run."""
    overrides = {"decode_skip_tbts": skip}
    pol = registry.create("slidingserve", overrides)
    plan = pol.plan(snap, pred)
    assert plan_violations(snap, plan) == []
    if waits(pol, snap, pred, plan, overrides):
        return
    late = starving_decodes(snap, pol.params.starve_after)
    cap = min(int(snap.is_decoding.sum()), snap.max_batch_tokens, snap.max_num_seqs,
              snap.free_kv_tokens if snap.free_kv_tokens is not None else 1 << 30)
    got = alloc(plan)
    ran = sum(snap.ids[i] in got for i in late.tolist())
    assert ran == min(len(late), cap), (ran, len(late), cap)
    if len(late) and cap:
        off = alloc(off_plan(snap, pred, overrides))
        if sum(snap.ids[i] in off for i in late.tolist()) < ran:
            ACTED["decode"] = ACTED.get("decode", 0) + 1


# ------------------------------------------------------------- nothing else changes
@STARVE
@given(snap=aged_snapshots(), pred=any_predictor)
def test_without_starving_requests_the_plan_is_the_one_without_the_bound(
        snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    pol = registry.create("slidingserve")
    a = pol.params.starve_after
    if starving_prefills(snap, a) or len(starving_decodes(snap, a)):
        return
    ACTED["unchanged"] = ACTED.get("unchanged", 0) + 1
    # (the version differs: overrides add a parameter hash to it)
    assert pol.plan(snap, pred).decision_key()[3:] == off_plan(snap, pred, {}).decision_key()[3:]


def test_the_properties_above_were_decided_by_the_bound() -> None:
    """Not vacuous: the bound changed the plan in enough of their examples (runs after them in
    file order; run alone it draws the examples again)."""
    if not ACTED:
        for o in PREFILL_CASES:
            test_the_oldest_starving_prefill_gets_its_room_and_starving_ones_go_first(o)  # type: ignore[call-arg]
        test_a_starving_decode_runs_whenever_a_decode_can()  # type: ignore[call-arg]
        test_without_starving_requests_the_plan_is_the_one_without_the_bound()  # type: ignore[call-arg]
    # 24-27 at 1.4.0 (the bound waits in most draws: its backlog rarely fits the live slack)
    assert ACTED.get("prefill", 0) >= 15, ACTED
    assert ACTED.get("decode", 0) >= 20, ACTED
    assert ACTED.get("unchanged", 0) >= 20, ACTED
    assert ACTED.get("waited", 0) >= 20, ACTED


@pytest.mark.parametrize("late_tbts", [3, 4, 6])
def test_a_plan_made_while_the_bound_waits_is_explained_by_the_rules_it_was_made_by(late_tbts: int) -> None:
    """While the bound waits (here: a starving 38-token prompt whose backlog the fresh
    prompts' slack cannot carry), plan() plans without it, so a decode ``late_tbts`` TBTs
    late, starving under the bound, sits out for the fresh prompts as ``late``.  Explaining
    the plan afterwards (``reasons.explain``) replays those rules too: the same reasons as
    the decision's own (it used to replay the bound's and call the decode ``behind``)."""
    tbt = 1 / 256
    reqs = [waiting("old", 38, arrival=NOW - 1 / 32, ttft=1 / 128, tbt=1 / 64),
            waiting("mid", 1, arrival=NOW - 1 / 64, ttft=3 / 128, tbt=1 / 64),
            *(waiting(f"new{i}", 1, arrival=NOW, ttft=1 / 32, tbt=1 / 64) for i in range(4)),
            decoding("dec", 1, 1, arrival=NOW - 1 / 32, ttft=1 / 32 - (1 + late_tbts) * tbt, tbt=tbt)]
    snap = make_snapshot(reqs, now=NOW, max_batch_tokens=64, max_num_seqs=300)
    pol = registry.create("slidingserve")
    pred = default_predictor()
    assert not pol._bound_fits(snap, pred)
    assert snap.slack[snap.index_of["dec"]] == pytest.approx(-late_tbts * tbt)
    plan = pol.plan(snap, pred)
    told = explain(pol, snap, pred, plan)
    assert [(r.id, r.code) for r in told.reasons] == [("dec", "late")]
    assert list(told.reasons) == list(plan_explained(pol, snap, pred).reasons)


def _seeded(seed: int) -> Snapshot:
    """Small, loaded, KV- and sequence-limited and classed snapshots; every other pair a second
    later, so that many requests are expired or starving."""
    shape = seed % 6
    if shape == 0:
        s = random_snapshot(seed, n=12, max_prompt=300)
    elif shape == 1:
        s = random_snapshot(seed, n=24, max_prompt=60, max_batch_tokens=64, free_kv_tokens=400,
                            prefill_throughput=None)
    elif shape == 2:
        s = random_snapshot(seed, n=8, max_num_seqs=3, decode_frac=0.7)
    elif shape == 3:
        s = random_snapshot(seed, n=30, max_prompt=200, max_batch_tokens=512, prefill_throughput=None)
    elif shape == 4:
        s = random_snapshot(seed, n=60, max_prompt=1000, max_batch_tokens=1024, decode_frac=0.5,
                            free_kv_tokens=6000)
    else:
        s = random_snapshot(seed, n=16, max_prompt=300)
        rng = np.random.default_rng(seed + 991)
        d = s.to_dict()
        for r in d["requests"]:
            r["priority"] = int(rng.integers(-2, 3))
            r["sheddable"] = bool(rng.random() < 0.4)
        s = Snapshot.from_json(d)
    if seed % 4 >= 2:
        d = s.to_dict()
        d["now"] += 1.0
        s = Snapshot.from_json(d)
    return s


#: sha256 (first 16 hex digits) of the decision keys, less policy, version and predictor
#: version, of 60 seeded snapshots × 3 predictors, per variant, planned with the bound and the
#: nothing-to-trade rule off: SlidingServe 1.1.0's rules (commit 56142a4, before the bound
#: existed) but for one change of 1.4.0, late requests served oldest first.  With that change
#: undone these variants gave 1.1.0's own digests (cf5a406f25195cb5, 8198486dd6966113,
#: 84667b4fa7452eda, 9b050546494c20f6; the EDF variant orders no late request by MLPS).
DIGESTS_1_1_0: list[tuple[dict[str, Any], str]] = [
    ({}, "a843c0f9c79b201b"),
    ({"window": 1, "decode_skip_tbts": 1.0}, "fb33a465d7264d79"),
    ({"order": "edf", "batch_constructor": False}, "84667b4fa7452eda"),
    ({"lost_rule": "alone", "margin": 1.0}, "2ef3063cc9b5c2b5"),
]


@pytest.mark.parametrize(("overrides", "digest"), DIGESTS_1_1_0, ids=[str(o) for o, _ in DIGESTS_1_1_0])
def test_starve_after_0_plans_as_version_1_1_0(overrides: dict[str, Any], digest: str) -> None:
    off = {"starve_after": 0, "sit_out_when": "waiting", "fcfs_when_safe": False}
    pol = registry.create("slidingserve", {**overrides, **off})
    h = hashlib.sha256()
    for seed in range(60):
        s = _seeded(seed)
        for pred in (default_predictor(), random_predictor(seed), random_predictor(seed, allow_negative=True)):
            h.update(repr(pol.plan(s, pred).decision_key()[3:]).encode())
    assert h.hexdigest()[:16] == digest
    with_bound = registry.create("slidingserve", {**overrides, "sit_out_when": "waiting", "fcfs_when_safe": False})
    assert any(with_bound.plan(_seeded(seed), default_predictor()).decision_key()[3:]
               != pol.plan(_seeded(seed), default_predictor()).decision_key()[3:] for seed in range(60))


# ------------------------------------------------------------------- hand-built cases
def _crowded(old: list[Request], **kw: Any) -> Snapshot:
    """20 decodes with 6 ms of slack (the TBT windows leave ~300 prefill tokens), 4 fresh
    200-token prompts that can make it, and ``old`` requests."""
    dec = [decoding(f"d{i}", 100, 4, arrival=9.5, ttft=0.306, tbt=0.05) for i in range(20)]
    fresh = [waiting(f"f{i}", 200, arrival=9.9 + 0.01 * i, ttft=1.0) for i in range(4)]
    return make_snapshot(dec + fresh + old, now=10.0, **kw)


def test_a_given_up_prompt_that_waited_starve_after_ttfts_goes_first_with_the_full_budget() -> None:
    """The case measured on vLLM: a 1,024-token prompt given up on (expired) waits behind every
    live request.  Once it has waited 3 TTFTs it goes first, and the oldest starving prompt
    gets the budget's full room, beyond the decode windows; without the bound it gets nothing
    while live prompts wait."""
    old = [waiting("old", 1024, arrival=5.0, ttft=0.45), waiting("older", 600, arrival=4.0, ttft=0.45),
           waiting("recent", 300, arrival=9.0, ttft=0.45)]  # recent: expired, 1 s < 3 TTFTs
    snap = _crowded(old, max_batch_tokens=2048)
    off = alloc(registry.create("slidingserve", {"starve_after": 0}).plan(snap, PRED))
    assert not {"old", "older", "recent"} & off.keys() and sum(off.values()) < 400
    plan = registry.create("slidingserve").plan(snap, PRED)
    prefills = [a for a in plan.allocations if not a.id.startswith("d")]
    # older (arrival 4.0) is the oldest: all of it (the windows alone held ~345 tokens)
    assert [(a.id, a.tokens) for a in prefills] == [("older", 600)]
    assert plan.path == "sliding_chunker" and len(plan.allocations) == 21
    # once it is done, old is the oldest: the budget's room (2,048 less 20 decodes)
    plan = registry.create("slidingserve").plan(_crowded(old[:1] + old[2:], max_batch_tokens=2048), PRED)
    assert [(a.id, a.tokens) for a in plan.allocations[20:]] == [("old", 1024)]
    plan = registry.create("slidingserve").plan(_crowded(old[:1], max_batch_tokens=512), PRED)
    assert [(a.id, a.tokens) for a in plan.allocations[20:]] == [("old", 512 - 20)]
    # KV holds the oldest back to the headroom: 20 decodes' next tokens and the watermark
    tight = registry.create("slidingserve").plan(_crowded(old, free_kv_tokens=20 + 20 + 20 * 64 + 100), PRED)
    assert alloc(tight)["older"] == 100


def test_starving_with_request_classes_is_the_top_class_only() -> None:
    """A lower class keeps waiting behind the higher ones (the class rules hold); a starving
    prompt of the highest class present goes first."""
    low = Request("low", 5.0, 1024, ttft_slo=0.45, priority=1, tbt_slo=0.1)
    snap = _crowded([low])
    plan = registry.create("slidingserve").plan(snap, PRED)
    assert "low" not in alloc(plan)
    assert plan.decision_key()[3:] == registry.create("slidingserve", {"starve_after": 0}).plan(
        snap, PRED).decision_key()[3:]
    top = Request("top", 5.0, 1024, ttft_slo=0.45, priority=-1, tbt_slo=0.1)
    plan = registry.create("slidingserve").plan(_crowded([low, top]), PRED)
    assert [a.id for a in plan.allocations if a.id in ("top", "low")] == ["top"]
    assert alloc(plan)["top"] == 1024


def test_a_partly_prefilled_starving_prompt_counts_its_age_from_arrival() -> None:
    """Age is now − arrival whatever part of the prompt is computed (or was a cached prefix)."""
    part = prefilling("part", 1024, 900, arrival=8.5, ttft=0.45)  # 1.5 s ≥ 3 × 0.45 s
    plan = registry.create("slidingserve").plan(_crowded([part]), PRED)
    assert alloc(plan)["part"] == 124 and plan.allocations[20].id == "part"
    young = prefilling("part", 1024, 900, arrival=8.7, ttft=0.45)  # 1.3 s: not yet
    assert alloc(registry.create("slidingserve").plan(_crowded([young]), PRED)).get("part", 0) == 0
