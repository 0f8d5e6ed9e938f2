"""``sit_out_when="needed"`` (the default): the decode sit-out rules act only when a first
token depends on them.

The rule, checked over random snapshots (partly prefilled requests, cached tokens, random
and non-monotone predictors): when Moore-Hodgson on the live prefills at the pace left beside
every decode gives up nothing, the plan is exactly the plan with the sit-out rules off; when
it gives up a first token, exactly the plan with ``sit_out_when="waiting"`` (the rules as
before).  Either way the plan validates.  Both branches must be reached often, so the test
cannot pass by never reaching one.  Why the rule exists: on an engine whose iterations are
far shorter than the TBT (the live CPU engine of docs/results.md) a decode that sits out
whenever any prompt waits turns its slack into longer gaps and misses the TTFT+TPOT
definition for no first token gained.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import (
    BatchLatencyPredictor,
    Snapshot,
    default_predictor,
    plan_violations,
    registry,
)
from scheduler_service.core.slidingserve import _room_needed
from scheduler_service.core.sorter import prefill_indices
from tests.factories import decoding, make_snapshot, token_predictor, waiting
from tests.strategies import NOW, predictors, snapshots

# Without the nothing-to-trade rule, which plans first come first served in most of the
# snapshots where no first token depends on a sit-out, before the sit-out rules are asked;
# tests/test_load_curve.py checks that, where it does not act, the plan is this one.
ALONE = {"fcfs_when_safe": False}
NEEDED = registry.create("slidingserve", ALONE)
WAITING = registry.create("slidingserve", {**ALONE, "sit_out_when": "waiting"})
OFF = registry.create("slidingserve", {**ALONE, "decode_skip_tbts": 0, "skip_late_decodes": "false"})
SEEN = {"needed": 0, "not_needed": 0}


@st.composite
def crowded(draw: st.DrawFn) -> Snapshot:
    """Random snapshots, looked at a little later, with a few fresh prompts: decodes ahead
    of and behind their deadlines beside live prefills, so the sit-out rules have work."""
    snap = draw(snapshots(max_n=12, max_prompt=160, max_bmax=256))
    d = snap.to_dict()
    d["now"] = NOW + draw(st.sampled_from([0.0, 0.3, 1.0]))
    for i in range(draw(st.integers(1, 3))):
        d["requests"].append({"id": f"fresh{i}", "arrival": d["now"] - 0.01 * i,
                              "prompt_tokens": draw(st.integers(16, 400)), "computed_tokens": 0,
                              "output_tokens": 0, "ttft_slo": draw(st.sampled_from([0.05, 0.3, 2.0])),
                              "tbt_slo": 0.05})
    return Snapshot.from_json(d)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(crowded(), st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)))
def test_needed_plans_as_waiting_or_as_off(snap: Snapshot, pred: BatchLatencyPredictor) -> None:
    plan = NEEDED.plan(snap, pred)
    assert not plan_violations(snap, plan)
    if not snap.one_class:
        return  # the class rules (rescue) add their own sit-outs; compared on single-class snapshots
    dec_all = np.flatnonzero(snap.is_decoding)
    pre = prefill_indices(snap)
    lost = NEEDED._lost(snap, pred, pre, snap.prefill_throughput or pred.prefill_throughput(snap.max_batch_tokens))
    lost &= ~NEEDED._starving(snap, pre)
    live = pre[(snap.slack[pre] > 0) & ~lost]
    needed = _room_needed(snap, pred, dec_all, live, NEEDED.params.margin)
    other = WAITING if needed else OFF
    assert plan.decision_key()[3:] == other.plan(snap, pred).decision_key()[3:]
    # count only snapshots where the rules would have made a decode sit out
    if WAITING.plan(snap, pred).decision_key()[3:] != OFF.plan(snap, pred).decision_key()[3:]:
        SEEN["needed" if needed else "not_needed"] += 1


def test_both_branches_were_reached() -> None:
    assert SEEN["needed"] >= 10 and SEEN["not_needed"] >= 10, SEEN


def test_fast_engine_keeps_every_decode_when_the_prompt_fits() -> None:
    """20 decodes 8 TBTs ahead and one fresh 200-token prompt with a 1 s TTFT on an engine
    whose iterations take a few ms: the prompt makes its TTFT beside every decode, so none
    sits out (with "waiting" every one of them does)."""
    pred = token_predictor(intercept_ms=2.0, per_token_ms=0.01, per_decode_ms=0.05)
    dec = [decoding(f"d{i}", 100, 10, arrival=9.0, ttft=1.0, tbt=0.05) for i in range(20)]  # due 10.45: 9 TBT ahead
    snap = make_snapshot([*dec, waiting("p", 200, arrival=10.0, ttft=1.0, tbt=0.05)], now=10.0,
                         max_batch_tokens=256)
    runs = {a.id for a in NEEDED.plan(snap, pred).allocations}
    assert {f"d{i}" for i in range(20)} <= runs
    assert not {f"d{i}" for i in range(20)} & {a.id for a in WAITING.plan(snap, pred).allocations}
