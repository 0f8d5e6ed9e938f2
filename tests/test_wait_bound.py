"""The engine's wait bound (``AdapterSettings.shed_after``, docs/operations.md, "Bounded
waits"): a request still without its first token ``shed_after`` × its TTFT SLO after it
arrived becomes sheddable, so SlidingServe rejects it (reason ``wait_bound``) instead of
letting it wait behind every live request for as long as an overload lasts.

On hand-built snapshots through the real adapter core and in-process policy, as a property
over random snapshots (partly prefilled requests, client-sheddable ones, random bounds), and
on the simulated engine in overload on the real trace and profile, where the bound caps every
served request's first token and leaves requests within it alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings, Decision, mark_overdue
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import SimulatedEngine
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from scheduler_service.core import Snapshot, default_predictor, plan_violations
from tests.factories import decoding, make_snapshot, prefilling, random_snapshot, waiting


def _decide(snap: Snapshot, shed_after: float) -> Decision:
    """One decision of the real adapter core over the in-process SlidingServe."""
    s = AdapterSettings(policy="slidingserve", report_inline=True, shed_after=shed_after)
    core = AdapterCore(InProcessBackend(s, default_predictor()), s)
    try:
        return core.decide(snap)
    finally:
        core.close()


def _queue() -> Snapshot:
    """At t = 10 s: a prompt 8 TTFTs old (non-sheddable), one 8 TTFTs old the client marked
    sheddable, one partly prefilled 4 TTFTs old, a fresh one, a decode whose request arrived
    long ago."""
    reqs = [waiting("old", 300, arrival=2.0), waiting("old-shed", 300, arrival=2.0),
            prefilling("half", 300, 100, arrival=6.0), waiting("fresh", 64, arrival=9.9, ttft=5.0),
            decoding("dec", 100, 3, arrival=0.0, ttft=1.0, tbt=5.0)]
    snap = make_snapshot(reqs, now=10.0)
    shed = np.array([r == "old-shed" for r in snap.ids])
    return dataclasses.replace(snap, sheddable=shed)


def test_marks_only_requests_without_a_first_token_past_the_bound() -> None:
    snap = _queue()
    marked, ids = mark_overdue(snap, 3.0)
    assert ids == {"old", "half"}  # not the decode, not the fresh one, not the client's own
    assert marked.sheddable.tolist() == [True, True, True, False, False]
    assert snap.sheddable.tolist() == [False, True, False, False, False]  # the engine's view is kept
    same, none = mark_overdue(snap, 9.0)
    assert same is snap and not none


def test_the_overdue_requests_are_rejected_with_the_wait_bound_reason() -> None:
    d = _decide(_queue(), 3.0)
    assert d.source == "remote" and d.plan is not None
    why = dict(d.plan.rejections)
    assert why == {"old": "wait_bound", "half": "wait_bound", "old-shed": "ttft_expired"}
    assert {a.id for a in d.plan.allocations} >= {"fresh", "dec"}


def test_without_the_bound_only_the_clients_sheddable_requests_are_rejected() -> None:
    d = _decide(_queue(), 0.0)
    assert d.plan is not None and dict(d.plan.rejections) == {"old-shed": "ttft_expired"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), factor=st.floats(0.5, 12.0), n=st.integers(1, 24))
def test_rejections_stay_within_what_the_client_and_the_bound_allow(seed: int, factor: float, n: int) -> None:
    """Random snapshots, aged so that some requests are past the bound: the plan is valid on
    the engine's own view plus the bound; it rejects only requests without a first token that
    the client marked sheddable (their own reasons) or that are past the bound (``wait_bound``)."""
    rng = np.random.default_rng(seed)
    base = random_snapshot(seed, n=n, now=10.0)
    arrival = base.now - rng.uniform(0.0, 8.0, len(base))
    shed = rng.random(len(base)) < 0.3
    snap = dataclasses.replace(base, arrival=arrival, sheddable=shed)
    d = _decide(snap, factor)
    assert d.plan is not None and d.source == "remote"
    marked, overdue = mark_overdue(snap, factor)
    assert not plan_violations(marked, d.plan)
    age = snap.now - snap.arrival
    for r in d.plan.rejections:
        i = snap.ids.index(r.id)
        assert not snap.is_decoding[i]
        if r.reason == "wait_bound":
            assert not snap.sheddable[i] and age[i] >= factor * snap.ttft_slo[i] and r.id in overdue
        else:
            assert snap.sheddable[i]


def _overload(shed_after: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The simulated engine at about twice its goodput (mixed-v1, the default profile):
    per request its TTFT SLO, TTFT (NaN: no first token) and whether it was rejected; and
    how many it completed."""
    quiet_logs()
    pred = profile_predictor(DEFAULT_PROFILE)
    w = make_workload("mixed-v1", 300, 4.5, seed=3)
    s = AdapterSettings(policy="slidingserve", profile=DEFAULT_PROFILE, report_inline=True, shed_after=shed_after)
    core = AdapterCore(InProcessBackend(s, pred), s, pred)
    try:
        eng = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILES[DEFAULT_PROFILE], core)
        res = eng.run()
    finally:
        core.close()
    return w.ttft_slo, eng.first_token - w.arrival, res.rejected, res.completed


@pytest.mark.parametrize("bound", [2.0, 4.0])
def test_in_overload_the_bound_caps_every_first_token_and_frees_the_engine(bound: float) -> None:
    """At twice the goodput without the bound, given-up prompts wait far beyond any bound;
    with it, every first token comes within the bound plus the iteration that produced it
    (well under a second here), the rejected ones are only requests past it, and no request
    is lost: each completed or was rejected."""
    slo, ttft, _, _ = _overload(0.0)
    assert np.nanmax(ttft / slo) > 2 * bound  # the case the bound is for
    slo, ttft, rejected, done = _overload(bound)
    served = ~np.isnan(ttft)
    assert rejected.any() and not (served & rejected).any()
    assert np.all(ttft[served] <= bound * slo[served] + 0.5)
    assert done + int(rejected.sum()) == len(slo)
