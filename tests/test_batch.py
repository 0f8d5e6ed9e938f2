"""CandidateQueue features against explicitly built batches; BudgetCurve
against a brute-force scan; decode selection and caps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import BatchLatencyPredictor, Snapshot
from scheduler_service.core.batch import BudgetCurve, CandidateQueue, select_decodes
from scheduler_service.core.sorter import prefill_indices
from tests.factories import (
    brute_batch_features,
    decoding,
    explicit_segment,
    linear_model,
    make_predictor,
    make_snapshot,
    predict_cu,
    prefilling,
    random_predictor,
    random_snapshot,
    token_predictor,
    waiting,
)
from tests.strategies import predictors, snapshots


def explicit_fill(snap: Snapshot, decodes: np.ndarray, queue: np.ndarray, P: int) -> list[tuple[int, int]]:
    return explicit_segment(snap, decodes, queue, 0, P, 0)


predict = predict_cu


def build(snap: Snapshot, pred: BatchLatencyPredictor, rng: np.random.Generator | None = None,
          **kw: int) -> CandidateQueue:
    dec = np.flatnonzero(snap.is_decoding)
    queue = prefill_indices(snap)
    if rng is not None:
        queue = rng.permutation(queue)
    return CandidateQueue.build(snap, pred, dec, queue, n_all_decodes=len(dec), **kw)


def check_segments(cq: CandidateQueue, X: np.ndarray, Y: np.ndarray, step: int) -> None:
    """The kernels' times of segments (and, from 0 at step 0, of prefixes) against the
    batch built request by request and priced from its brute-force features."""
    t = cq.segment_time_ms(X, Y, step)
    prefix = cq.prefix_time_ms(Y) if step == 0 and not X.any() else t
    for k, (x, y) in enumerate(zip(X.tolist(), Y.tolist(), strict=True)):
        cu = explicit_segment(cq.snap, cq.decodes, cq.queue, x, y, step)
        want = predict(cq.predictor, cu)
        assert t[k] == pytest.approx(want, rel=1e-9, abs=1e-9), f"[{x},{y}) m={step}"
        assert prefix[k] == pytest.approx(want, rel=1e-9, abs=1e-9), f"[0,{y})"


@pytest.mark.parametrize("seed", range(25))
def test_segment_times_equal_explicit_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    snap = random_snapshot(seed, n=int(rng.integers(1, 14)), max_prompt=int(rng.choice([3, 40])),
                           decode_frac=float(rng.choice([0.0, 0.4])))
    cq = build(snap, random_predictor(seed, allow_negative=True), rng)
    n = cq.supply
    X = rng.integers(0, n + 1, 60)
    Y = np.minimum(n, X + rng.integers(0, n + 2, 60))
    for step in range(4):
        check_segments(cq, X, Y, step)
    # all prefixes (the greedy fills) and the segments that start at request boundaries
    P = np.arange(n + 1)
    check_segments(cq, np.zeros_like(P), P, 0)
    Rb = cq.R[:-1]
    check_segments(cq, Rb, np.minimum(n, Rb + 1), 2)


@settings(max_examples=60, deadline=None)
@given(snapshots(max_n=8, max_prompt=20), predictors(negative=True), st.data())
def test_segment_times_hypothesis(snap: Snapshot, pred: BatchLatencyPredictor, data: st.DataObject) -> None:
    perm = data.draw(st.permutations(prefill_indices(snap).tolist()))
    dec = np.flatnonzero(snap.is_decoding)
    cq = CandidateQueue.build(snap, pred, dec, np.array(perm, dtype=np.int64), n_all_decodes=len(dec))
    n = cq.supply
    x = data.draw(st.integers(0, n))
    y = data.draw(st.integers(x, n))
    step = data.draw(st.integers(0, 3))
    check_segments(cq, np.array([x, 0, x]), np.array([y, y, x]), step)


def test_one_token_pieces_of_a_prefill_count_as_decodes() -> None:
    # a segment that takes one token of a prefill sees it as a decode (c == 1): the batch
    # is decode-only, priced by the decode model on x4 = 3 requests, x5 = their context
    snap = make_snapshot([waiting("a", 5), prefilling("b", 10, 3), decoding("d", 20, 4)])
    dec = np.array([2])
    pred = make_predictor(decode=linear_model(1.0, x4=0.5, x5=0.25), prefill=linear_model(100.0),
                          mixed=linear_model(200.0))
    cq = CandidateQueue.build(snap, pred, dec, np.array([0, 1]), n_all_decodes=1)
    # a: c=1 at u=4; b: c=1 at u=3; decode: u = 20 + 4 - 1 + 1 = 24
    cu = explicit_segment(snap, dec, np.array([0, 1]), 4, 6, 1)
    assert brute_batch_features(cu).tolist() == [0, 0, 4 + 3 + 24, 3, 4 + 3 + 24, 0, 0]
    assert cq.segment_time_ms(np.array([4]), np.array([6]), 1)[0] == 1.0 + 0.5 * 3 + 0.25 * 31


def test_caps_hand_computed() -> None:
    reqs = [decoding("d1", 10, 2), decoding("d2", 10, 5), waiting("a", 30), prefilling("b", 50, 10),
            waiting("c", 7)]
    snap = make_snapshot(reqs, max_batch_tokens=64, max_num_seqs=4, free_kv_tokens=100)
    dec = np.array([0, 1])
    q = np.array([2, 3, 4])
    cq = CandidateQueue.build(snap, make_predictor(), dec, q, n_all_decodes=2, kv_decode_reserve=1)
    assert cq.R.tolist() == [0, 30, 70, 77]
    assert cq.supply == 77
    assert cq.iter_cap == 62
    assert cq.kv_cap == 100 - 2 - 2
    # two sequence slots left: only a and b can run, 70 tokens, budget 62
    assert cq.first_cap == 62
    assert cq.fill(62) == [(2, 30), (3, 32)]
    assert cq.dec_u == (10 + 2 - 1) + (10 + 5 - 1)
    tight = make_snapshot(reqs, max_batch_tokens=64, max_num_seqs=3, free_kv_tokens=40)
    cq = CandidateQueue.build(tight, make_predictor(), dec, q, n_all_decodes=2, kv_decode_reserve=3)
    assert cq.kv_cap == 40 - 2 - 6
    assert cq.first_cap == 30  # one slot left: request a only
    fixed = CandidateQueue.build(snap, make_predictor(), dec, q, n_all_decodes=2, budget=16)
    assert fixed.iter_cap == 14 and fixed.first_cap == 14
    assert fixed.fill(14) == [(2, 14)]
    assert fixed.fill(0) == []


def test_select_decodes_keeps_the_most_urgent() -> None:
    reqs = [
        decoding("relaxed", arrival=9.0, ttft=1.0, tbt=0.5, output=2),   # s = 9+1+1-10 = 1.0
        decoding("urgent", arrival=9.0, ttft=0.5, tbt=0.25, output=2),   # s = 0.0 → expired
        decoding("tight", arrival=9.0, ttft=0.5, tbt=0.25, output=3),    # s = 0.25
        decoding("tight2", arrival=8.5, ttft=1.0, tbt=0.25, output=3),   # s = 0.25, earlier
        waiting("w"),
    ]
    for kw in ({"max_num_seqs": 2}, {"max_batch_tokens": 2}, {"free_kv_tokens": 2}):
        snap = make_snapshot(reqs, now=10.0, **kw)
        got = select_decodes(snap, np.flatnonzero(snap.is_decoding))
        assert [snap.ids[i] for i in got] == ["tight", "tight2"], kw
    snap = make_snapshot(reqs, now=10.0, max_num_seqs=3)
    got = select_decodes(snap, np.flatnonzero(snap.is_decoding))
    assert [snap.ids[i] for i in got] == ["relaxed", "tight", "tight2"]
    snap = make_snapshot(reqs, now=10.0)
    assert select_decodes(snap, np.flatnonzero(snap.is_decoding)).tolist() == [0, 1, 2, 3]
    snap = make_snapshot(reqs, now=10.0, max_num_seqs=4, free_kv_tokens=0)
    assert len(select_decodes(snap, np.flatnonzero(snap.is_decoding))) == 0


# ---------------------------------------------------------------- curve
def brute_time_to_budget(snap: Snapshot, pred: BatchLatencyPredictor, dec: np.ndarray, queue: np.ndarray,
                         limit: int, T: float) -> int:
    best = len(dec) - 1
    for P in range(limit + 1):
        if predict(pred, explicit_fill(snap, dec, queue, P)) <= T:
            best = len(dec) + P
    return best


def away_from_ties(Ts: np.ndarray, times: np.ndarray) -> list[float]:
    """Thresholds not within rounding of a curve value (the oracle sums in a
    different order, so an exact tie could go either way)."""
    return [T for T in Ts.tolist() if np.min(np.abs(times - T)) > 1e-9]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("negative", [False, True])
def test_time_to_budget_equals_brute_force(seed: int, negative: bool) -> None:
    rng = np.random.default_rng(100 + seed)
    snap = random_snapshot(seed, n=int(rng.integers(1, 10)), max_batch_tokens=int(rng.integers(1, 49)))
    pred = random_predictor(seed, allow_negative=negative)
    cq = build(snap, pred, rng)
    times = cq.fill_curve_ms()
    limit = min(cq.iter_cap, cq.supply)
    assert len(times) == limit + 1
    for P in range(limit + 1):
        assert times[P] == pytest.approx(predict(pred, explicit_fill(snap, cq.decodes, cq.queue, P)), abs=1e-9)
    curve = BudgetCurve(times, cq.n_dec)
    Ts = np.concatenate([times, times + 1e-7, times - 1e-7, [times.min() - 1.0, times.max() + 1.0],
                         rng.uniform(times.min() - 0.5, times.max() + 0.5, 20)])
    for T in away_from_ties(Ts, times):
        want = brute_time_to_budget(snap, pred, cq.decodes, cq.queue, limit, T)
        assert curve.time_to_budget(T) == want, T
        assert curve.prefill_tokens_within(T) == want - cq.n_dec


def test_time_to_budget_non_monotone_hand_made() -> None:
    curve = BudgetCurve(np.array([5.0, 9.0, 3.0, 8.0, 4.0, 10.0]), n_dec=2)
    assert curve.time_to_budget(2.0) == 1            # nothing fits: n_dec − 1
    assert curve.time_to_budget(3.0) == 2 + 2
    assert curve.time_to_budget(4.0) == 2 + 4
    assert curve.time_to_budget(9.99) == 2 + 4       # P=5 is 10 > 9.99
    assert curve.time_to_budget(10.0) == 2 + 5
    assert curve.prefill_tokens_within(4.5) == 4


def test_negative_weights_make_the_curve_non_monotone() -> None:
    # mixed time rises with Σc but falls with the largest chunk: non-monotone in P
    bumpy = make_predictor(linear_model(1.0, x4=0.05, x6=0.01), mixed=linear_model(1.0, x4=0.1, x6=0.5, x7=-0.6))
    snap = make_snapshot([decoding("d"), waiting("a", 5), waiting("b", 5), waiting("c", 5)], now=0.0)
    cq = build(snap, bumpy)
    times = cq.fill_curve_ms()
    assert np.any(np.diff(times) < 0) and np.any(np.diff(times) > 0)
    curve = BudgetCurve(times, 1)
    for T in away_from_ties(np.concatenate([times + 1e-7, times - 1e-7]), times):
        want = brute_time_to_budget(snap, bumpy, cq.decodes, cq.queue, 15, T)
        assert curve.time_to_budget(T) == want


def test_segment_time_zero_for_empty_batch() -> None:
    snap = make_snapshot([waiting("a", 10)])
    cq = build(snap, token_predictor(intercept_ms=3.0))
    t = cq.segment_time_ms(np.array([0, 4, 10]), np.array([0, 4, 10]), 1)
    assert t.tolist() == [0.0, 0.0, 0.0]
    assert cq.segment_time_ms(np.array([0]), np.array([10]))[0] == pytest.approx(3.0 + 0.1)
