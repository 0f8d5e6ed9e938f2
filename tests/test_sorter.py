"""MLPS (10)–(16), EDF and FCFS orders, hand-computed from the formulas; the Moore–Hodgson
late set against an exhaustive oracle."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import Snapshot
from scheduler_service.core.sorter import (
    edf_order,
    fcfs_order,
    late_set,
    mlps_keys,
    mlps_order,
    prefill_indices,
)
from tests.factories import decoding, make_snapshot, prefilling, waiting
from tests.strategies import snapshots

RHO = 1000.0  # tokens / s


def ids(snap: Snapshot, order: np.ndarray) -> list[str]:
    return [snap.ids[i] for i in order]


def queue_snapshot() -> Snapshot:
    # now = 10; slack s = arrival + ttft - 10 (exact binary fractions)
    reqs = [
        waiting("A", 500, arrival=9.0, ttft=2.0),            # s=1,    u=0.5    e=0  key (1,1,500)
        waiting("B", 200, arrival=9.5, ttft=0.625),          # s=.125, u=1.6    e=1  key (1,0,200)
        waiting("C", 800, arrival=9.0, ttft=1.5),            # s=.5,   u=1.6    e=1  key (1,0,800)
        waiting("D", 50, arrival=8.0, ttft=4.0),             # s=2,    u=.025   e=0  key (1,1,50)
        waiting("E", 1000, arrival=9.0, ttft=4.0, protected=True),  # s=3, u=1/3 e=0 key (0,1,1000)
        waiting("F", 10, arrival=9.0, ttft=0.5),             # s=-.5 expired
        prefilling("G", 400, 100, arrival=9.0, ttft=1.25),   # r=300 s=.25 u=1.2  e=1  key (1,0,300)
        decoding("Z", 100, 3, arrival=9.0, ttft=0.1),        # decode: not in the prefill queue
    ]
    return make_snapshot(reqs, now=10.0)


def test_prefill_indices_exclude_decodes() -> None:
    s = queue_snapshot()
    assert ids(s, prefill_indices(s)) == list("ABCDEFG")


def test_mlps_keys_hand_computed() -> None:
    s = queue_snapshot()
    idx = prefill_indices(s)
    g, e, r = mlps_keys(s, idx, RHO, alpha=1.0, eps=1e-3)
    assert r.tolist() == [500, 200, 800, 50, 1000, 10, 300]
    assert g.tolist() == [1, 1, 1, 1, 0, 1, 1]
    # F: u = 10 / (1000 * max(-0.5, 1e-3)) = 10 > 1 → urgent
    assert e.tolist() == [1, 0, 0, 1, 1, 0, 0]


def test_mlps_order_alpha_1() -> None:
    s = queue_snapshot()
    order = mlps_order(s, prefill_indices(s), RHO, alpha=1.0, eps=1e-3)
    # protected E; urgent B(200) G(300) C(800); relaxed D(50) A(500); expired F last
    assert ids(s, order) == ["E", "B", "G", "C", "D", "A", "F"]


def test_mlps_order_alpha_above_every_urgency() -> None:
    s = queue_snapshot()
    order = mlps_order(s, prefill_indices(s), RHO, alpha=2.0, eps=1e-3)
    assert ids(s, order) == ["E", "D", "B", "G", "A", "C", "F"]


def test_mlps_alpha_and_throughput_thresholds() -> None:
    # u_B = 200 / (1000 * 0.125) = 1.6 exactly-ish; α = 1.5 → urgent, α = 1.7 → not
    s = queue_snapshot()
    _, e, _ = mlps_keys(s, np.array([1]), RHO, alpha=1.5, eps=1e-3)
    assert e.tolist() == [0]
    _, e, _ = mlps_keys(s, np.array([1]), RHO, alpha=1.7, eps=1e-3)
    assert e.tolist() == [1]
    # a faster prefill halves u: 0.8 < 1
    _, e, _ = mlps_keys(s, np.array([1]), 2 * RHO, alpha=1.0, eps=1e-3)
    assert e.tolist() == [1]


def test_mlps_urgency_is_strictly_greater_than_alpha() -> None:
    # s = 0.25 exactly, r = 500, ρ = 1000 → u = 2.0 exactly
    s = make_snapshot([waiting("x", 500, arrival=7.5, ttft=0.75)], now=8.0)
    assert float(s.slack[0]) == 0.25
    assert mlps_keys(s, np.array([0]), RHO, alpha=2.0, eps=1e-3)[1].tolist() == [1]
    assert mlps_keys(s, np.array([0]), RHO, alpha=1.999, eps=1e-3)[1].tolist() == [0]


def test_mlps_epsilon_floor_changes_urgency() -> None:
    # X: r=5, slack ≈ 1e-6 s (floored to ε); Y: r=3, slack 2 s (never urgent)
    reqs = [waiting("X", 5, arrival=7.0, ttft=1.0 + 2**-20), waiting("Y", 3, arrival=6.0, ttft=4.0)]
    s = make_snapshot(reqs, now=8.0)
    idx = prefill_indices(s)
    # ε = 0.01: u_X = 5 / (1000·0.01) = 0.5 → relaxed, shorter Y first
    assert ids(s, mlps_order(s, idx, RHO, alpha=1.0, eps=0.01)) == ["Y", "X"]
    # ε = 0.001: u_X = 5 → urgent, X first
    assert ids(s, mlps_order(s, idx, RHO, alpha=1.0, eps=0.001)) == ["X", "Y"]


def test_expired_last_even_when_protected() -> None:
    reqs = [
        waiting("old-protected", 5, arrival=0.0, ttft=0.5, protected=True),  # expired
        waiting("old", 1, arrival=0.0, ttft=0.5),                            # expired, shortest
        waiting("live", 900, arrival=9.0, ttft=5.0),
        waiting("live-protected", 950, arrival=9.0, ttft=5.0, protected=True),
    ]
    s = make_snapshot(reqs, now=10.0)
    order = mlps_order(s, prefill_indices(s), RHO, alpha=1.0, eps=1e-3)
    # the expired ones oldest first (equal arrivals: by id), neither protection nor size counts
    assert ids(s, order) == ["live-protected", "live", "old", "old-protected"]
    # without expired_last the MLPS key alone decides (old is urgent, live is not)
    order = mlps_order(s, prefill_indices(s), RHO, alpha=1.0, eps=1e-3, expired_last=False)
    assert ids(s, order) == ["old-protected", "live-protected", "old", "live"]


def test_ties_break_by_arrival_then_id() -> None:
    reqs = [
        waiting("b", 100, arrival=9.0, ttft=5.0),
        waiting("c", 100, arrival=8.5, ttft=5.5),   # same deadline, earlier arrival
        waiting("a", 100, arrival=9.0, ttft=5.0),
        waiting("a10", 100, arrival=9.0, ttft=5.0),
        waiting("a9", 100, arrival=9.0, ttft=5.0),
    ]
    s = make_snapshot(reqs, now=10.0)
    idx = prefill_indices(s)
    expect = ["c", "a", "a10", "a9", "b"]  # string order of ids: "a10" < "a9"
    assert ids(s, mlps_order(s, idx, RHO, alpha=1.0, eps=1e-3)) == expect
    assert ids(s, edf_order(s, idx)) == expect
    assert ids(s, fcfs_order(s, idx)) == expect


def test_edf_order() -> None:
    reqs = [
        waiting("late", 10, arrival=1.0, ttft=5.0),      # deadline 6
        waiting("early", 5000, arrival=3.0, ttft=1.0),   # deadline 4
        prefilling("mid", 100, 50, arrival=2.0, ttft=3.0),  # deadline 5
        waiting("gone", 10, arrival=0.0, ttft=1.0),      # deadline 1 (expired at now=3.5)
    ]
    s = make_snapshot(reqs, now=3.5)
    idx = prefill_indices(s)
    assert ids(s, edf_order(s, idx)) == ["gone", "early", "mid", "late"]
    assert ids(s, edf_order(s, idx, expired_last=True)) == ["early", "mid", "late", "gone"]


def test_fcfs_order_ignores_size_and_deadline() -> None:
    reqs = [
        waiting("third", 1, arrival=3.0, ttft=0.1),
        waiting("first", 9000, arrival=1.0, ttft=50.0),
        prefilling("second", 100, 50, arrival=2.0),
    ]
    s = make_snapshot(reqs, now=3.5)
    assert ids(s, fcfs_order(s, prefill_indices(s))) == ["first", "second", "third"]


def test_empty_inputs() -> None:
    s = make_snapshot([decoding("d")], now=0.0)
    empty = prefill_indices(s)
    assert len(empty) == 0
    assert len(mlps_order(s, empty, RHO, 1.0, 1e-3)) == 0
    assert len(edf_order(s, empty)) == 0 and len(fcfs_order(s, empty)) == 0


def py_mlps(s: Snapshot, rho: float, alpha: float, eps: float) -> list[str]:
    rows = []
    for i in prefill_indices(s).tolist():
        r = int(s.prompt_tokens[i] - s.computed_tokens[i])
        slack = float(s.arrival[i] + s.ttft_slo[i] - s.now)
        u = r / (rho * max(slack, eps))
        key = (True, 0, 0, 0) if slack <= 0 else (False, 1 - bool(s.protected[i]), 1 - (u > alpha), r)
        rows.append(((*key, float(s.arrival[i]), s.ids[i]), s.ids[i]))
    return [rid for _, rid in sorted(rows)]


@settings(max_examples=60, deadline=None)
@given(snapshots(max_n=12), st.floats(0.0, 5.0), st.sampled_from([1e-3, 0.05]))
def test_mlps_order_matches_python_sort(s: Snapshot, alpha: float, eps: float) -> None:
    order = mlps_order(s, prefill_indices(s), RHO, alpha, eps)
    assert ids(s, order) == py_mlps(s, RHO, alpha, eps)


@settings(max_examples=40, deadline=None)
@given(snapshots(max_n=12))
def test_edf_fcfs_match_python_sort(s: Snapshot) -> None:
    idx = prefill_indices(s)
    edf = sorted(idx.tolist(), key=lambda i: (float(s.arrival[i] + s.ttft_slo[i]), float(s.arrival[i]), s.ids[i]))
    fcfs = sorted(idx.tolist(), key=lambda i: (float(s.arrival[i]), s.ids[i]))
    assert edf_order(s, idx).tolist() == edf
    assert fcfs_order(s, idx).tolist() == fcfs


# ------------------------------------------------------------ late set (Moore–Hodgson)
def _feasible(r: np.ndarray, s: np.ndarray, keep: np.ndarray) -> bool:
    """Served one after another in deadline order, every kept request finishes by its slack."""
    order = np.argsort(s[keep], kind="stable")
    finish = np.cumsum(r[keep][order])
    return bool(np.all(finish <= s[keep][order] + 1e-12))


def test_late_set_gives_up_the_long_request_that_would_sink_two() -> None:
    # at 1000 tokens/s: L needs 0.8 s, a and b 0.2 s each; deadline order L, a, b.
    # Serving L first makes a and b late; giving L up, a and b make it.
    reqs = [waiting("L", 800, arrival=9.0, ttft=1.9), waiting("a", 200, arrival=9.5, ttft=1.45),
            waiting("b", 200, arrival=9.5, ttft=1.5)]
    snap = make_snapshot(reqs, now=10.0)
    pre = prefill_indices(snap)
    assert ids(snap, pre[late_set(snap, pre, RHO)]) == ["L"]
    # with room for all three nothing is given up
    assert not late_set(snap, pre, 2 * RHO).any()


def test_late_set_keeps_protected_requests_while_others_can_go() -> None:
    reqs = [waiting("P", 800, arrival=9.0, ttft=1.9, protected=True), waiting("a", 200, arrival=9.5, ttft=1.45),
            waiting("b", 200, arrival=9.5, ttft=1.5)]
    snap = make_snapshot(reqs, now=10.0)
    pre = prefill_indices(snap)
    assert ids(snap, pre[late_set(snap, pre, RHO)]) == ["a"]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(r=st.lists(st.integers(1, 50), min_size=0, max_size=7), data=st.data())
def test_late_set_keeps_a_largest_feasible_set(r: list[int], data: st.DataObject) -> None:
    """Moore–Hodgson minimises the number of late requests on one server at a fixed rate:
    the kept set is feasible in deadline order and no feasible set is larger
    (exhaustive search over all subsets)."""
    n = len(r)
    slack = data.draw(st.lists(st.integers(1, 120), min_size=n, max_size=n))
    # now 100, slack = arrival + ttft - now; rate 1 token/s keeps every time an integer
    reqs = [waiting(f"q{j}", r[j], arrival=50.0, ttft=50.0 + slack[j]) for j in range(n)]
    snap = make_snapshot(reqs, now=100.0)
    pre = prefill_indices(snap)
    lost = late_set(snap, pre, 1.0)
    rr, ss = np.array(r, dtype=float), np.array(slack, dtype=float)
    assert _feasible(rr, ss, ~lost)
    best = max((k for k in range(n + 1) for keep in itertools.combinations(range(n), k)
                if _feasible(rr, ss, np.isin(np.arange(n), keep))), default=0)
    assert int((~lost).sum()) == best


def test_late_requests_go_oldest_first_whatever_their_size() -> None:
    """Expired and given-up requests follow every live one, first come first served among
    themselves: a long old prompt does not wait behind shorter later ones."""
    reqs = [
        waiting("old-long", 900, arrival=0.0, ttft=0.5),
        waiting("mid-short", 10, arrival=1.0, ttft=0.5, protected=True),
        waiting("new-short", 5, arrival=2.0, ttft=0.5),
        waiting("live", 900, arrival=9.5, ttft=5.0),
    ]
    s = make_snapshot(reqs, now=10.0)
    idx = prefill_indices(s)
    assert ids(s, mlps_order(s, idx, RHO, alpha=1.0, eps=1e-3)) == ["live", "old-long", "mid-short", "new-short"]
    lost = np.array([False, False, False, True])  # given up on: late too, by arrival among them
    assert ids(s, mlps_order(s, idx, RHO, alpha=1.0, eps=1e-3, lost=lost)) == [
        "old-long", "mid-short", "new-short", "live"]
