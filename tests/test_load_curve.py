"""SlidingServe's rules for the two ends of the load curve (docs/policies.md).

* Nothing to trade (``fcfs_when_safe``): when vLLM's own choice, first come first served
  with the full token budget, is predicted to keep every live first token (served one after
  another at the prefill rate) and every decode's tokens over the window, the plan is that
  choice.
* The starvation bound waits while its backlog does not fit the live prefills' spare
  slack: under sustained overload the given-up requests do not take the engine.

Properties on random snapshots and predictors count the cases where each rule acted, so
that none passes vacuously.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Snapshot,
    default_predictor,
    plan_violations,
    registry,
)
from tests.factories import decoding, make_snapshot, token_predictor, waiting
from tests.strategies import predictors, snapshots

PRED = token_predictor(intercept_ms=1.0, per_token_ms=0.01, per_decode_ms=0.05)
PROPS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
ACTED: dict[str, int] = {}


def alloc(plan: Plan) -> dict[str, int]:
    return plan.tokens_by_id()


def key(plan: Plan) -> Any:
    return plan.decision_key()[3:]


def rho_of(snap: Snapshot, pred: BatchLatencyPredictor) -> float:
    return snap.prefill_throughput or pred.prefill_throughput(snap.max_batch_tokens)


def fcfs_keeps_first_tokens(snap: Snapshot, rho: float, margin: float = 1.1) -> bool:
    """The oracle: prefills in arrival order (then id), served one after another at
    ``rho``, each live one (slack left) done within its slack, every time counted
    ``margin`` times over (the policy's default margin)."""
    rows = sorted(np.flatnonzero(~snap.is_decoding).tolist(), key=lambda i: (snap.arrival[i], snap.ids[i]))
    t = 0.0
    for i in rows:
        t += margin * float(snap.remaining_prefill[i]) / rho
        if snap.slack[i] > 0 and t > snap.slack[i]:
            return False
    return True


def quiet(decodes: int = 4) -> list[Any]:
    """Decodes with a second of slack (their first tokens came early)."""
    return [decoding(f"d{i}", 200, 3, arrival=9.0, ttft=2.0, tbt=0.05) for i in range(decodes)]


# ------------------------------------------------------------------ nothing to trade
def test_below_capacity_the_plan_is_first_come_first_served_with_the_full_budget() -> None:
    """An old long prompt and a newer short one, both easily on time: MLPS would serve the
    shorter first (formula (16)'s r); with nothing to trade the older goes first with the
    budget's whole room, as vLLM's own scheduler does."""
    reqs = [*quiet(), waiting("old", 900, arrival=9.6, ttft=2.0), waiting("new", 50, arrival=9.9, ttft=2.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=512)
    plan = registry.create("slidingserve").plan(snap, PRED)
    assert alloc(plan) == {**{f"d{i}": 1 for i in range(4)}, "old": 508}
    assert plan.path == "sliding_chunker"
    traded = alloc(registry.create("slidingserve", {"fcfs_when_safe": False}).plan(snap, PRED))
    assert traded["new"] == 50 and traded["old"] < 508


def test_a_decode_the_full_budget_would_make_late_brings_the_trade_offs_back() -> None:
    """A decode whose next token is due in 5 ms: the full budget's chunk (about 6 ms) would
    miss it, so the plan is the one without the rule (smaller chunks for the decode)."""
    tight = decoding("tight", 200, 3, arrival=9.0, ttft=0.855, tbt=0.05)
    reqs = [*quiet(), tight, waiting("old", 900, arrival=9.6, ttft=2.0), waiting("new", 50, arrival=9.9, ttft=2.0)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=512)
    assert 0 < snap.slack[snap.index_of["tight"]] < 0.006
    on = registry.create("slidingserve").plan(snap, PRED)
    assert key(on) == key(registry.create("slidingserve", {"fcfs_when_safe": False}).plan(snap, PRED))


def test_a_first_token_fcfs_would_lose_brings_the_trade_offs_back() -> None:
    """At 1,000 prompt tokens a second, the old 900-token prompt first would make the short
    one (0.5 s of slack) late: the plan is the one without the rule."""
    reqs = [*quiet(), waiting("old", 900, arrival=9.0, ttft=4.0), waiting("new", 50, arrival=9.9, ttft=0.6)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=512, prefill_throughput=1000.0)
    assert not fcfs_keeps_first_tokens(snap, 1000.0)
    on = registry.create("slidingserve").plan(snap, PRED)
    assert key(on) == key(registry.create("slidingserve", {"fcfs_when_safe": False}).plan(snap, PRED))
    assert alloc(on)["new"] == 50


def test_a_first_token_fcfs_would_keep_only_within_the_margin_brings_the_trade_offs_back() -> None:
    """FCFS would finish the short prompt 0.95 s from now against its 1 s of slack: on
    time as predicted, not with the margin (1.1) every other promise of a plan counts, so
    the plan is the one without the rule; with margin 1.0 it is FCFS."""
    reqs = [*quiet(), waiting("old", 900, arrival=9.0, ttft=4.0), waiting("new", 50, arrival=9.9, ttft=1.1)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=512, prefill_throughput=1000.0)
    assert fcfs_keeps_first_tokens(snap, 1000.0, margin=1.0) and not fcfs_keeps_first_tokens(snap, 1000.0)
    for margin, rule_acts in ((1.1, False), (1.0, True)):
        on = registry.create("slidingserve", {"margin": margin}).plan(snap, PRED)
        off = registry.create("slidingserve", {"margin": margin, "fcfs_when_safe": False}).plan(snap, PRED)
        assert (key(on) != key(off)) == rule_acts
        assert (alloc(on).get("new", 0) == 0) == rule_acts  # FCFS: the old prompt takes the whole room


@PROPS
@given(snap=snapshots(max_n=12, max_prompt=300, max_bmax=512),
       pred=st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)))
def test_when_the_rule_acts_the_plan_is_fcfs_and_fcfs_keeps_every_first_token(
        snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    """Wherever the plan differs from the one without the rule, the first-come-first-served
    schedule keeps every live first token at the prefill rate (the oracle above), and the
    plan's prefills are served first come first served: a prefill gets tokens only when every
    older one gets all of its remaining prompt.  Plans keep every limit either way."""
    plan = registry.create("slidingserve").plan(snap, pred)
    assert plan_violations(snap, plan) == []
    off = registry.create("slidingserve", {"fcfs_when_safe": False}).plan(snap, pred)
    if key(plan) == key(off):
        ACTED["same"] = ACTED.get("same", 0) + 1
        return
    ACTED["fcfs"] = ACTED.get("fcfs", 0) + 1
    assert fcfs_keeps_first_tokens(snap, rho_of(snap, pred))
    got = alloc(plan)
    rows = sorted(np.flatnonzero(~snap.is_decoding).tolist(), key=lambda i: (snap.arrival[i], snap.ids[i]))
    served = [got.get(snap.ids[i], 0) for i in rows]
    full = [int(snap.remaining_prefill[i]) for i in rows]
    for j in range(len(rows)):
        if served[j]:
            assert served[:j] == full[:j], (served, full)


def test_the_rule_acted_in_enough_examples() -> None:
    """Not vacuous: the property's own draws (run again here, so that the count does not
    depend on which tests ran before)."""
    ACTED.clear()
    test_when_the_rule_acts_the_plan_is_fcfs_and_fcfs_keeps_every_first_token()  # type: ignore[call-arg]
    assert ACTED.get("fcfs", 0) >= 10, ACTED
    assert ACTED.get("same", 0) >= 20, ACTED


# --------------------------------------------------------- the starvation bound waits
def _starved(fresh_ttft: float) -> Snapshot:
    """A 1,024-token prompt given up 5 s ago (starving: 3 TTFTs) beside 4 fresh 400-token
    prompts with ``fresh_ttft`` of slack, at 2,000 prompt tokens a second."""
    reqs = [*quiet(), waiting("old", 1024, arrival=5.0, ttft=0.45)]
    reqs += [waiting(f"f{i}", 400, arrival=10.0, ttft=fresh_ttft) for i in range(4)]
    return make_snapshot(reqs, now=10.0, max_batch_tokens=512, prefill_throughput=2000.0)


def test_the_starving_prompt_goes_first_while_the_live_ones_can_spare_its_time() -> None:
    """Live prompts with 3 s of slack need 0.8 s at 2,000 tokens a second: the old prompt's
    0.5 s fits their spare time, so it goes first (the bound)."""
    pol = registry.create("slidingserve")
    snap = _starved(3.0)
    assert pol._bound_fits(snap, PRED)
    plan = pol.plan(snap, PRED)
    assert next(a.id for a in plan.allocations if not a.id.startswith("d")) == "old"


def test_the_bound_waits_when_the_starving_work_would_cost_a_live_first_token() -> None:
    """With 1.2 s of slack the live prompts spare at most 0.4 s, less than the old prompt's
    0.5 s: the bound waits, and the plan is the one without it (the old prompt gets nothing)."""
    pol = registry.create("slidingserve")
    snap = _starved(1.2)
    assert not pol._bound_fits(snap, PRED)
    plan = pol.plan(snap, PRED)
    assert "old" not in alloc(plan)
    assert key(plan) == key(registry.create("slidingserve", {"starve_after": 0}).plan(snap, PRED))


def test_with_no_live_prefill_the_given_up_ones_are_served_oldest_first() -> None:
    """Nothing live waits: the starving and expired prompts are served first come first
    served (late requests go oldest first), the bound not needed."""
    reqs = [*quiet(), waiting("young", 100, arrival=8.5, ttft=0.45), waiting("old", 300, arrival=5.0, ttft=0.45)]
    snap = make_snapshot(reqs, now=10.0, max_batch_tokens=512)
    plan = registry.create("slidingserve").plan(snap, PRED)
    prefills = [(a.id, a.tokens) for a in plan.allocations if not a.id.startswith("d")]
    assert prefills == [("old", 300), ("young", 100)]
