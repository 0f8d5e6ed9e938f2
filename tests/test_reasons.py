"""Why a request waited (issue 24): every policy gives one reason for every request its plan
does not fully serve, the reason holds, and explaining never changes a decision."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Snapshot,
    default_predictor,
    kernels,
    plan_violations,
    registry,
)
from scheduler_service.core.plan import Reason, Reasons
from scheduler_service.core.predictor import batch_features
from scheduler_service.core.reasons import (
    CODES,
    REASON_CODES,
    explain,
    plan_explained,
    reason_counts,
)
from scheduler_service.core.rule_codes import (
    RC_AHEAD,
    RC_BEHIND,
    RC_CLASS_RESCUE,
    RC_CLASS_RESERVE,
    RC_CLASS_SIT_OUT,
    RC_EXPIRED,
    RC_GIVEN_UP,
    RC_KV,
    RC_KV_WATERMARK,
    RC_LATE,
    RC_MAX_NUM_SEQS,
    RC_NOT_CHOSEN,
    RC_TIME_BUDGET,
    RC_TOKEN_BUDGET,
    REASON_RULES,
    REASON_VALUE,
    RULE_SCALAR,
    RULE_SKIP,
    RULE_STARVE,
    RULES_LEN,
)
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import encode_plan, plan_from_pb, plan_to_pb

from .reach import Reached
from .strategies import NOW, predictors, requests_st

POLICIES = [spec.name for spec in registry.BUILTIN]  # not ones other tests register
REACHED = Reached()


@st.composite
def waiting_snapshots(draw: st.DrawFn) -> Snapshot:
    """tests/strategies.py's requests, with request classes (priority, sheddable, end-to-end
    objectives) on half of them and KV pressure on many."""
    reqs = draw(requests_st(max_n=12, max_prompt=draw(st.sampled_from([80, 2000])), tight=draw(st.booleans())))
    if draw(st.booleans()):
        reqs = [dataclasses.replace(
            r, priority=draw(st.integers(-1, 2)), sheddable=draw(st.booleans()),
            e2e_slo=draw(st.sampled_from([0.0, 0.0, 0.5, 5.0])),
        ) for r in reqs]
    if draw(st.booleans()):  # room to spare: the policies' own rules hold requests back
        return Snapshot.from_requests(reqs, now=NOW, max_batch_tokens=draw(st.integers(64, 4096)),
                                      max_num_seqs=300, free_kv_tokens=draw(st.sampled_from([None, 100_000])))
    return Snapshot.from_requests(
        reqs, now=NOW,
        max_batch_tokens=draw(st.integers(1, 96)),
        max_num_seqs=draw(st.one_of(st.integers(1, 4), st.integers(1, 300))),
        free_kv_tokens=draw(st.one_of(st.none(), st.integers(0, 16), st.integers(0, 400), st.integers(0, 5000))),
        prefill_throughput=draw(st.one_of(st.none(), st.floats(100.0, 1e5))),
    )


def kv_left(policy: Any, snap: Snapshot, plan: Plan) -> int | None:
    """KV tokens the plan leaves free after its tokens, the preempted requests' KV counted
    as free, and the policy's per-decode reserve for every decode (None: KV unlimited)."""
    if snap.free_kv_tokens is None:
        return None
    reserve = int(getattr(policy.params, "kv_decode_reserve", 0))
    freed = int(sum(int(snap.kv_tokens[snap.index_of[r]]) for r in plan.preemptions))
    return snap.free_kv_tokens + freed - plan.token_budget - reserve * int(np.count_nonzero(snap.is_decoding))


def _need(snap: Snapshot, i: int) -> int:
    return 1 if snap.is_decoding[i] else int(snap.remaining_prefill[i])


def _predict_plus_one(snap: Snapshot, pred: BatchLatencyPredictor, plan: Plan, i: int) -> float:
    """Predicted time of the plan's batch with one more token of request ``i``."""
    got = plan.tokens_by_id()
    rid = snap.ids[i]
    got[rid] = got.get(rid, 0) + 1
    rows = [snap.index_of[k] for k in got]
    c = np.array(list(got.values()), dtype=np.float64)
    x, s = batch_features(c, snap.kv_tokens[rows].astype(np.float64))
    return float(pred.predict_ms(x[None, :], np.array([s]))[0])


def _holds(policy: Any, snap: Snapshot, pred: BatchLatencyPredictor, plan: Plan, r: Reason,
           reached: Reached) -> None:
    """The rule's own predicate for ``r``."""
    i = snap.index_of[r.id]
    got = plan.tokens_by_id().get(r.id, 0)
    dec = bool(snap.is_decoding[i])
    slack_ms = float(snap.slack[i]) * 1e3
    code, v = r.code, r.value
    if code == "max_num_seqs":
        assert got == 0 and len(plan.allocations) >= snap.max_num_seqs == v
    elif code == "token_budget":
        assert plan.token_budget >= v and v <= snap.max_batch_tokens
    elif code == "kv":
        assert v == kv_left(policy, snap, plan) and v < 1
    elif code == "kv_watermark":
        left = kv_left(policy, snap, plan)
        assert left is not None and left >= 1 and left - v < 1 and not dec
    elif code in ("given_up", "expired"):
        assert not dec and v == pytest.approx(slack_ms)
        assert code == "given_up" or slack_ms <= 0
    elif code == "ahead":
        assert dec and v == pytest.approx(slack_ms)
        assert slack_ms > policy.params.decode_skip_tbts * float(snap.step[i]) * 1e3
    elif code == "late":
        assert dec and v == pytest.approx(slack_ms) and v <= 0
    elif code in ("class_sit_out", "class_rescue"):
        assert dec and not snap.one_class and snap.priority[i] > snap.priority.min()
    elif code == "class_reserve":
        assert not dec and not snap.started[i] and snap.priority[i] > snap.priority.min()
    elif code == "not_chosen":
        assert not dec and plan.path == "batch_constructor"
    elif code == "time_budget":
        assert not dec and plan.path != "batch_constructor" and v > 0
        if _predict_plus_one(snap, pred, plan, i) > v:
            reached("time_budget_binds")
    elif code == "behind":
        assert v == len(plan.allocations)
    elif code == "preempted":
        assert r.id in plan.preemptions and v == snap.kv_tokens[i]
    else:
        assert (r.id, code) in {(x.id, x.reason) for x in plan.rejections}


def _same_decision(a: Plan, b: Plan) -> None:
    assert a.decision_key() == b.decision_key()
    assert (a.allocations, a.path, a.rejections, a.preemptions) == (b.allocations, b.path, b.rejections,
                                                                    b.preemptions)


def _check(name: str, snap: Snapshot, pred: BatchLatencyPredictor, reached: Reached) -> None:
    """Explaining changes no decision; one reason for each request not fully served, none
    for a served one, and each reason's own predicate holds."""
    policy = registry.create(name)
    plain = policy.plan(snap, pred)
    told = explain(policy, snap, pred, plain)
    _same_decision(plain, told)
    _same_decision(plain, policy.plan(snap, pred))  # and the policy is not changed by it
    assert not plain.reasons
    assert plan_violations(snap, told, limit=1000) == []
    traced = plan_explained(policy, snap, pred)  # SlidingServe: from its own decision's trace
    _same_decision(plain, traced)
    assert list(traced.reasons) == list(told.reasons)
    got = told.tokens_by_id()
    waiting = {rid for i, rid in enumerate(snap.ids) if got.get(rid, 0) < _need(snap, i)}
    ids = [r.id for r in told.reasons]
    assert len(ids) == len(set(ids)) and set(ids) == waiting
    if not waiting:
        return
    reached()
    for r in told.reasons:
        _holds(policy, snap, pred, told, r, reached)
        reached(r.code)


@settings(max_examples=700, deadline=None, derandomize=True, database=None)
@given(st.sampled_from([*POLICIES, "slidingserve", "slidingserve", "slidingserve"]), waiting_snapshots(),
       st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)))
def _every_wait_has_one_reason_that_holds(name: str, snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    _check(name, snap, pred, REACHED)


def test_every_wait_has_one_reason_that_holds() -> None:
    REACHED.floor(
        _every_wait_has_one_reason_that_holds,
        # Floors that hold however the suite is run: the derandomized examples differ with
        # what other test modules imported first (given_up, class_rescue, e2e_expired,
        # ttft_unreachable went from 26-47 alone to 0-3 in some orders), so only the codes
        # every order reaches by the hundred are floored here; the rules' own codes are
        # floored on the seeded loaded engines below.
        checked=200, max_num_seqs=200, token_budget=300, kv=80, ttft_expired=30,
    )


def _loaded(seed: int, seqs_past_decodes: int | None = None) -> Snapshot:
    """A loaded engine with room in its limits (the policies' own rules decide): decodes a
    little ahead of their deadlines, a queue of new and partial prefills, some with classes;
    ``max_num_seqs`` 256, or that many past the decodes."""
    rng = np.random.default_rng(seed)
    n_dec, n_pre = int(rng.integers(0, 40)), int(rng.integers(1, 60))
    n = n_dec + n_pre
    prompt = rng.integers(16, 3000, n)
    computed = np.where(np.arange(n) < n_dec, prompt,
                        np.where(rng.random(n) < 0.3, (rng.random(n) * prompt).astype(np.int64), 0))
    is_dec = np.arange(n) < n_dec
    arrival = 100.0 - np.where(is_dec, rng.uniform(2.0, 10.0, n), rng.uniform(0.0, 3.0, n))
    ttft, tbt = rng.choice([1.0, 2.0, 8.0], n), rng.choice([0.05, 0.2], n)
    ahead = rng.uniform(-0.3, 3.0, n) * tbt  # decodes: a few late, most a little ahead
    output = np.where(is_dec, np.maximum(1, np.ceil((100.0 - arrival - ttft + ahead) / tbt)), 0).astype(np.int64)
    classes = rng.random() < 0.5
    return Snapshot.from_columns(
        now=100.0, max_batch_tokens=int(rng.choice([256, 2048, 8192])),
        max_num_seqs=256 if seqs_past_decodes is None else n_dec + seqs_past_decodes,
        free_kv_tokens=int(rng.choice([3_000, 20_000, 400_000])), ids=[f"q{i}" for i in range(n)], arrival=arrival,
        prompt_tokens=prompt, computed_tokens=computed, output_tokens=output, ttft_slo=ttft, tbt_slo=tbt,
        protected=rng.random(n) < 0.05,
        priority=rng.integers(0, 3, n) if classes else np.zeros(n, np.int64),
        sheddable=(rng.random(n) < 0.3) if classes else np.zeros(n, bool),
    )


LOADED = Reached()


def test_a_constructor_plan_at_max_num_seqs_is_explained_as_the_replay_explains_it() -> None:
    """BatchConstructor's plans that reach ``max_num_seqs`` (none of the drawn or loaded
    snapshots above does), classified as the decision assembles them: the replay's
    reasons, ``max_num_seqs`` among them."""
    policy, pred = registry.create("slidingserve"), default_predictor()
    seen = 0
    for seed in range(300):
        for room in (1, 2, 3):
            snap = _loaded(seed, seqs_past_decodes=room)
            plan = policy.plan(snap, pred)
            if plan.path != "batch_constructor" or len(plan.allocations) < snap.max_num_seqs:
                continue
            traced = plan_explained(policy, snap, pred)
            assert list(traced.reasons) == list(explain(policy, snap, pred, plan).reasons), (seed, room)
            seen += any(r.code == "max_num_seqs" for r in traced.reasons)
    assert seen >= 5


@pytest.mark.parametrize("name", POLICIES)
def test_reasons_on_loaded_engines(name: str) -> None:
    """Seeded loaded engines: the policies' own rules (sit-outs, the lost rule, the time
    budget, BatchConstructor) reach their codes, which the small random snapshots rarely do."""
    pred = default_predictor()
    LOADED.counts.clear()
    for seed in range(25):
        _check(name, _loaded(seed), pred, LOADED)
    assert LOADED.counts["checked"] >= 20
    if name == "slidingserve":
        floors = {"given_up": 7, "expired": 100, "ahead": 14, "time_budget": 200, "time_budget_binds": 100, "not_chosen": 8, "class_sit_out": 10,
                  "kv_watermark": 10}
        assert all(LOADED.counts[k] >= v for k, v in floors.items()), dict(LOADED.counts)


@pytest.mark.parametrize("name", POLICIES)
def test_explained_plans_leave_no_reference_cycle(name: str) -> None:
    """A plan explained from its decision keeps its reasons, which keep what they read of
    the decision: a cycle back to the plan would leave every explained plan to the
    garbage collector (the service explains every plan with ``reasons: every``)."""
    policy, pred = registry.create(name), default_predictor()
    for seed in range(6):
        snap = _loaded(seed)
        len(plan_explained(policy, snap, pred).reasons)  # first calls (numba's typing) leave garbage of their own
        for read in (False, True):
            gc.collect()
            was = gc.isenabled()
            gc.disable()
            try:
                plan = plan_explained(policy, snap, pred)
                if read:
                    len(plan.reasons)
                del plan
                assert gc.collect() == 0
            finally:
                if was:
                    gc.enable()


class _Wrapped:
    """A registered policy whose ``plan()`` knows nothing of explaining (as a policy of
    another code base): everything else, the rules the replay reads, is the policy's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, key: str) -> Any:
        if key == "explains":
            raise AttributeError(key)
        return getattr(self.inner, key)

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
        return self.inner.plan(snapshot, predictor)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["slidingserve", "qoserve"])
def test_a_policy_that_does_not_explain_itself_is_replayed(name: str) -> None:
    pred = default_predictor()
    for seed in range(6):
        snap = _loaded(seed)
        told = plan_explained(_Wrapped(registry.create(name)), snap, pred)
        assert list(told.reasons) == list(plan_explained(registry.create(name), snap, pred).reasons)


# ------------------------------------------------------------ the two backends
def _arrays_by_backend(name: str, snap: Snapshot, pred: BatchLatencyPredictor) -> list[tuple[np.ndarray, ...]]:
    """The reasons' arrays of ``name``'s plan for ``snap``, explained on each backend
    (the post-pass and, SlidingServe, from the decision's trace)."""
    policy = registry.create(name)
    out = []
    for backend in ("numpy", "numba"):
        with kernels.using(backend):
            plan = policy.plan(snap, pred)
            for told in (explain(policy, snap, pred, plan), plan_explained(policy, snap, pred)):
                out.append(told.reasons.arrays() if isinstance(told.reasons, Reasons) else ())
    return out


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
@settings(max_examples=250, deadline=None, derandomize=True, database=None)
@given(st.sampled_from([*POLICIES, "slidingserve", "slidingserve"]), waiting_snapshots(),
       st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)))
def test_the_reasons_kernel_is_the_reference(name: str, snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    """The compiled ``reason_codes`` and its Python source give the same rows, codes and
    values, bit for bit (values compared as bytes), on random snapshots."""
    ref, *others = _arrays_by_backend(name, snap, pred)
    for got in others:
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
@pytest.mark.parametrize("name", POLICIES)
def test_the_reasons_kernel_is_the_reference_on_loaded_engines(name: str) -> None:
    pred = default_predictor()
    for seed in range(12):
        ref, *others = _arrays_by_backend(name, _loaded(seed), pred)
        assert all(a.tobytes() == b.tobytes() for got in others for a, b in zip(got, ref, strict=True))



@st.composite
def kernel_inputs(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    """``reason_codes``'s arguments drawn directly: any mix of rules on (with their
    numbers, one of them passed apart, the starvation bound and the decode skip), rows in
    several sets at once (marked: held back, a prefill, or rescued, a decode), verdicts on
    waiting and on served rows, slacks on both sides of every threshold."""
    n = draw(st.integers(1, 40))
    rows = st.lists(st.integers(0, n - 1), max_size=n, unique=True).map(lambda v: np.array(v, dtype=np.int64))
    is_dec = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    remaining = np.where(is_dec, 0, np.array(draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))))
    slack = np.array(draw(st.lists(st.sampled_from([-1.0, -0.2, -0.05, 0.0, 0.01, 0.05, 0.3, np.inf]),
                                   min_size=n, max_size=n)))
    cols = [np.array(draw(st.lists(st.sampled_from(v), min_size=n, max_size=n)), dtype=dt)
            for v, dt in (([0.02, 0.1], np.float64), ([0.02, 0.05], np.float64), ([-1, 0, 3], np.int64))]
    dec_rows = draw(rows)
    pre_rows = np.setdiff1d(draw(rows), dec_rows)
    pre_toks = np.array([draw(st.integers(0, 10)) for _ in pre_rows], dtype=np.int64)
    lost_from = draw(rows)
    lost_mask = np.array([draw(st.booleans()) for _ in lost_from], dtype=bool)
    v_rows = draw(rows)
    verdicts = np.array([v_rows, [draw(st.sampled_from(range(len(CODES)))) for _ in v_rows],
                         [draw(st.sampled_from([0, 17, 4096])) for _ in v_rows]], dtype=np.int64).reshape(3, -1)
    rules = np.zeros(RULES_LEN)
    rules[:RULE_SCALAR] = draw(st.lists(st.sampled_from([0.0, 0.0, 1.0]), min_size=RULE_SCALAR,
                                        max_size=RULE_SCALAR))
    rules[RULE_SCALAR:RULE_STARVE] = draw(st.lists(st.sampled_from([-3.0, 0.0, 2.5, 512.0]),
                                                   min_size=RULE_SCALAR, max_size=RULE_SCALAR))
    rules[RULE_STARVE], rules[RULE_SKIP] = draw(st.sampled_from([0.0, 2.0])), draw(st.sampled_from([0.0, 1.0, 4.0]))
    own_rule, own_value = draw(st.sampled_from([-1, *range(len(CODES))])), draw(st.sampled_from([0.0, 0.25, 7.0]))
    return (dec_rows, pre_rows, pre_toks, lost_from, lost_mask, draw(rows), verdicts, rules, own_rule, own_value,
            remaining, slack, *cols)


def first_rule_oracle(dec_rows: np.ndarray, pre_rows: np.ndarray, pre_toks: np.ndarray, lost_from: np.ndarray,
                      lost_mask: np.ndarray, marked: np.ndarray, verdicts: np.ndarray, rules: np.ndarray,
                      own_rule: int, own_value: float, remaining: np.ndarray, slack: np.ndarray, tbt: np.ndarray,
                      step: np.ndarray, prio: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``reason_codes`` the slow, obvious way: row by row, the rules tried in order."""
    n = len(remaining)
    got = np.zeros(n, dtype=np.int64)
    got[dec_rows] = 1
    got[pre_rows] = pre_toks
    lost = set(lost_from[lost_mask].tolist())
    held = set(marked.tolist())
    starve, skip = rules[RULE_STARVE], rules[RULE_SKIP]
    verdict = {int(r): (int(c), int(kv)) for r, c, kv in verdicts.T}

    def number(c: int) -> float:
        if c == RC_BEHIND:
            return float(len(dec_rows) + len(pre_rows))
        return own_value if c == own_rule else float(rules[RULE_SCALAR + c])

    def holds(c: int, i: int, d: bool, s: float) -> bool:
        return {RC_MAX_NUM_SEQS: got[i] == 0, RC_TOKEN_BUDGET: True, RC_KV: True, RC_KV_WATERMARK: not d,
                RC_CLASS_RESERVE: i in held and not d, RC_GIVEN_UP: i in lost, RC_EXPIRED: not d and s <= 0,
                RC_CLASS_RESCUE: i in held and d, RC_LATE: d and s <= 0 and (starve <= 0 or s > -starve * tbt[i]),
                RC_AHEAD: d and s > skip * step[i], RC_CLASS_SIT_OUT: d, RC_NOT_CHOSEN: not d,
                RC_TIME_BUDGET: not d}[c]

    rows, codes, values = [], [], []
    for i in range(n):
        d = bool(remaining[i] == 0)
        if got[i] >= (1 if d else remaining[i]):
            continue
        code = next((c for c in REASON_RULES if rules[c] != 0 and holds(c, i, d, slack[i])), RC_BEHIND)
        code, kv = verdict.get(i, (code, 0))
        rows.append(i)
        codes.append(code)
        values.append((number(code), slack[i] * 1e3, float(prio[i]), float(kv))[REASON_VALUE[code]])
    return np.array(rows, dtype=np.int64), np.array(codes, dtype=np.int8), np.array(values, dtype=np.float64)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(kernel_inputs())
def test_the_reasons_kernel_is_the_first_rule_that_holds_under_every_rule_mix(args: tuple[np.ndarray, ...]) -> None:
    """The kernel, which finds a row's first rule by bit arithmetic, gives the rows, codes
    and values of the plain if-order (on both backends) on inputs no policy would build:
    every mix of rules on, a row in several sets, verdicts on served rows."""
    want = first_rule_oracle(*args)
    for backend in ("numpy", "numba"):
        with kernels.using(backend):
            got = kernels.ops().k.reason_codes(*args)
        assert [a.dtype for a in got] == [b.dtype for b in want]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True)), backend


# ------------------------------------------------------------------ the data model
def _plan_with_reasons() -> tuple[Snapshot, Plan]:
    from .test_classes import classed

    for seed in range(50):
        snap = classed(seed)
        plan = plan_explained(registry.create("slidingserve"), snap, default_predictor())
        if len(plan.reasons) >= 3:
            return snap, plan
    raise AssertionError("no plan with three reasons")


def test_reasons_round_trip_json_and_protobuf() -> None:
    _, plan = _plan_with_reasons()
    for back in (Plan.from_dict(json.loads(plan.to_json())), plan_from_pb(plan_to_pb(plan))):
        assert list(back.reasons) == list(plan.reasons)
        assert back.reasons == plan.reasons and back.allocations == plan.allocations
    d = plan.to_dict()
    assert d["reasons"][0].keys() == {"id", "code", "value"}
    assert "reasons" not in dataclasses.replace(plan, reasons=()).to_dict()
    assert not plan_to_pb(dataclasses.replace(plan, reasons=())).reasons
    assert hash(plan.reasons) == hash(tuple(plan.reasons))
    counts = reason_counts(plan.reasons)
    assert counts == reason_counts(tuple(plan.reasons)) == reason_counts(plan_from_pb(plan_to_pb(plan)).reasons)
    assert sum(counts.values()) == len(plan.reasons) and all(v > 0 for v in counts.values())


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(["slidingserve", "sarathi", "qoserve", "vllm-fcfs"]), waiting_snapshots(),
       st.lists(st.text(st.sampled_from("ab-_.é字"), min_size=0, max_size=3), min_size=12, max_size=12),
       st.sampled_from([1, 60, 100, 108, 112, 116, 126, 200]))
def test_the_reason_encoder_writes_protobufs_bytes(name: str, snap: Snapshot, tails: list[str], width: int) -> None:
    """encode_plan's reasons, written straight into wire bytes, are the message protobuf
    builds: ids of every length around the one-byte length boundary, multi-byte characters."""
    data = json.loads(snap.to_json())
    for k, r in enumerate(data["requests"]):
        r["id"] = f"{r['id']}{'x' * (width - len(r['id']) - 1)}{tails[k % len(tails)]}{k}"
    snap = Snapshot.from_json(data)
    plan = plan_explained(registry.create(name), snap, default_predictor())
    got = encode_plan(plan, snap.ids)
    assert got == plan_to_pb(plan)  # field 15 and the compact form (tests/test_reasons_wire.py)
    assert plan_from_pb(pb.Plan.FromString(got.SerializeToString())).reasons == plan.reasons


@pytest.mark.parametrize("change,expect", [
    (lambda rs, snap, plan: (*rs, Reason("nope", "kv", 0.0)), "reason for unknown request 'nope'"),
    (lambda rs, snap, plan: (*rs, rs[0]), "two reasons for request"),
    (lambda rs, snap, plan: (*rs, Reason(plan.allocations[0].id, "kv", 0.0)), "which the plan fully serves"),
    (lambda rs, snap, plan: (Reason(rs[0].id, "because", 1.0), *rs[1:]), "unknown reason code 'because'"),
    (lambda rs, snap, plan: rs[1:], "waits without a reason"),
])
def test_the_plan_check_catches_bad_reasons(change: Any, expect: str) -> None:
    snap, plan = _plan_with_reasons()
    assert plan_violations(snap, plan) == []
    bad = dataclasses.replace(plan, reasons=tuple(change(tuple(plan.reasons), snap, plan)))
    assert any(expect in v for v in plan_violations(snap, bad)), plan_violations(snap, bad)


def test_every_code_is_documented() -> None:
    assert len(set(CODES)) == len(CODES) == len(REASON_CODES)
    assert all(re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", c) and desc for c, desc in REASON_CODES)
    docs = Path(__file__).resolve().parents[1] / "docs"
    section = (docs / "reasons.md").read_text().split("## The codes", 1)[1].split("\n## ", 1)[0]
    assert [c for c in CODES if f"| `{c}` |" not in section] == []  # a row of the table per code
    assert "(reasons.md)" in (docs / "policies.md").read_text()  # the policies page points there


def test_a_shedding_decision_explains_itself_without_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """SlidingServe's rejections are verdicts of its own decision: the plan is classified as
    it is assembled (no replay of the rules), with the same reasons as the replay."""
    from scheduler_service.core import slidingserve
    from scheduler_service.core.snapshot import Request

    reqs = [Request("gone", 0.0, 400, ttft_slo=0.1, sheddable=True, tbt_slo=0.1),
            Request("kept", 0.0, 400, ttft_slo=0.1, tbt_slo=0.1),
            Request("fine", 1.9, 40, ttft_slo=5.0, sheddable=True, tbt_slo=0.1)]
    snap, pred = Snapshot.from_requests(reqs, now=2.0), default_predictor()
    policy = registry.create("slidingserve")
    told = explain(policy, snap, pred, policy.plan(snap, pred))

    def no_replay(*_: Any) -> Plan:
        raise AssertionError("a shedding decision was replayed")

    monkeypatch.setattr(slidingserve, "with_reasons", no_replay)
    traced = plan_explained(policy, snap, pred)
    assert traced.rejections == told.rejections and traced.rejections
    assert list(traced.reasons) == list(told.reasons)
    assert ("gone", "ttft_expired") in {(r.id, r.code) for r in traced.reasons}
