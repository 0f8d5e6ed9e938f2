"""The compiled kernels (numba) against their own Python source (``py_func``, the numpy
backend, what runs where numba is missing): equal bit for bit.

numba compiles the source without fast-math, but Python and numba still differ in places
(integer widths, ``max`` on signed zeros, unstable sorts), so each test computes the same
thing on both backends (``kernels.using``) and compares exactly: arrays byte for byte (a
last-bit difference in a predicted time can flip a comparison against a slack, and
plans carry their predicted time), plans by ``decision_key``.  Inputs: Hypothesis
snapshots (tight SLOs, partly prefilled requests, tiny KV and sequence limits, empty
queues) and predictors (random, non-monotone, the bundled one), seeded snapshots from
``tests/factories.py``, and queues of one-token remainders (minor batches).  What the
kernels compute is checked against independent oracles elsewhere: explicit batches
(tests/test_batch.py), brute-force TimeToBudget, knapsack and Moore–Hodgson
(tests/test_batch.py, test_constructor.py, test_sorter.py), plan limits
(tests/test_properties.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import BatchLatencyPredictor, Snapshot, default_predictor, kernels, registry
from scheduler_service.core.batch import CandidateQueue, select_decodes
from scheduler_service.core.chunker import sliding_chunk
from scheduler_service.core.constructor import construct_batch
from scheduler_service.core.sorter import (
    class_late_set,
    edf_order,
    late_set,
    mlps_order,
    ordered,
    prefill_indices,
)
from tests.factories import decoding, make_snapshot, prefilling, random_predictor, random_snapshot, waiting
from tests.strategies import predictors, snapshots

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")

KERNELS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
any_predictor = st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True))


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` on the kernels' Python source, then compiled."""
    with kernels.using("numpy") as b:
        assert b == "numpy"
        ref = fn()
    with kernels.using("numba") as b:
        assert b == "numba"
        got = fn()
    return ref, got


def same(a: Any, b: Any) -> bool:
    """Equal arrays, bit for bit (so 0.0 and -0.0 differ, as they would in a plan's JSON)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def queue_of(snap: Snapshot, pred: BatchLatencyPredictor, *, n_dec_cap: int | None = None,
             growth: int = 0) -> CandidateQueue:
    """A CandidateQueue of the snapshot's decodes and MLPS-ordered prefills (ordered on
    the Python path, so that both backends start from the same queue)."""
    with kernels.using("numpy"):
        dec = select_decodes(snap, np.flatnonzero(snap.is_decoding))
        if n_dec_cap is not None:
            dec = dec[:n_dec_cap]
        queue = mlps_order(snap, prefill_indices(snap), snap.prefill_throughput or 1000.0, 1.0, 1e-3)
    return CandidateQueue.build(snap, pred, dec, queue, n_all_decodes=len(dec), kv_growth_reserve=growth)


# ----------------------------------------------------------------- candidate queue
@KERNELS
@given(snap=snapshots(max_n=16, max_prompt=120, max_bmax=96), pred=any_predictor,
       no_decodes=st.booleans(), growth=st.sampled_from([0, 64]), data=st.data())
def test_queue_arrays_fill_curve_and_prefix_times_agree(snap: Snapshot, pred: BatchLatencyPredictor,
                                                         no_decodes: bool, growth: int,
                                                         data: st.DataObject) -> None:
    ref, got = both(lambda: queue_of(snap, pred, n_dec_cap=0 if no_decodes else None, growth=growth))
    for name in ("r", "u0", "R"):
        assert same(getattr(ref, name), getattr(got, name)), name
    for name in ("pf", "rbig", "pmax", "pw"):
        assert same(getattr(ref.view, name), getattr(got.view, name)), name
    assert (ref.first_cap, ref.iter_cap, ref.kv_cap, ref.dec_u) == (got.first_cap, got.iter_cap, got.kv_cap,
                                                                    got.dec_u)
    c_ref, c_got = both(lambda: ref.budget_curve())
    assert same(c_ref.times, c_got.times) and same(c_ref.suffix_min, c_got.suffix_min)
    P = np.array(data.draw(st.lists(st.integers(0, ref.supply), max_size=12)), dtype=np.int64)
    t_ref, t_got = both(lambda: ref.prefix_time_ms(P))
    assert same(t_ref, t_got)


@KERNELS
@given(snap=snapshots(max_n=16, max_prompt=120, max_bmax=96), pred=any_predictor, no_decodes=st.booleans())
def test_the_fill_agrees_and_gives_what_the_explaining_chunker_counts_on(
        snap: Snapshot, pred: BatchLatencyPredictor, no_decodes: bool) -> None:
    """The fill agrees on both backends, for every prompt token count up to past the
    supply, and gives ``min(p1, supply)`` tokens: every one of ``p1`` up to ``first_cap``,
    which the explaining chunker counts in its plan's budget before it fills."""
    cq = queue_of(snap, pred, n_dec_cap=0 if no_decodes else None)
    assert cq.first_cap <= cq.supply
    for p1 in range(cq.supply + 3):
        ref, got = both(lambda p=p1: kernels.ops().fill_prefills(cq, p))  # type: ignore[misc]
        assert same(ref[0], got[0]) and same(ref[1], got[1])
        assert int(ref[1].sum()) == min(p1, cq.supply) and (ref[1] >= 1).all()


# ------------------------------------------------------------------ window search
@KERNELS
@given(snap=snapshots(max_n=16, max_prompt=120, max_bmax=96), pred=any_predictor, k=st.integers(1, 4),
       granularity=st.sampled_from([1, 3, 16]), max_points=st.sampled_from([2, 8, 1 << 30]),
       tol=st.sampled_from([0.0, 0.5, 2.0]), scale=st.floats(0.2, 3.0), no_decodes=st.booleans())
def test_window_search_agrees(snap: Snapshot, pred: BatchLatencyPredictor, k: int, granularity: int,
                              max_points: int, tol: float, scale: float, no_decodes: bool) -> None:
    cq = queue_of(snap, pred, n_dec_cap=0 if no_decodes else None)
    base = cq.decode_only_ms(0) + float(cq.prefix_time_ms(np.array([min(cq.supply, cq.first_cap)]))[0])
    W = np.cumsum(np.full(k, max(base, 1.0) * scale))
    ref, got = both(lambda: sliding_chunk(cq, W, granularity, max_points, None, tol))
    assert ref == got


# ------------------------------------------------------------------------- orders
@KERNELS
@given(snap=snapshots(max_n=20), rho=st.floats(50.0, 1e5), alpha=st.sampled_from([0.5, 1.0, 4.0]),
       expired_last=st.booleans(), data=st.data())
def test_orders_and_lost_set_agree(snap: Snapshot, rho: float, alpha: float, expired_last: bool,
                                   data: st.DataObject) -> None:
    pre = prefill_indices(snap)
    lost = np.array(data.draw(st.lists(st.booleans(), min_size=len(pre), max_size=len(pre))), dtype=bool)
    for mask in (None, lost):
        ref, got = both(lambda m=mask: mlps_order(snap, pre, rho, alpha, 1e-3, expired_last, m))  # type: ignore[misc]
        assert same(ref, got)
    idx = np.arange(len(snap))
    s = snap.slack
    for keys in ((), (-s,), (s <= 0, s), (snap.protected.astype(np.int8), snap.arrival), (snap.output_tokens,)):
        ref, got = both(lambda ks=keys: ordered(snap, idx, *ks))  # type: ignore[misc]
        assert same(ref, got)
    ref, got = both(lambda: edf_order(snap, pre, expired_last))
    assert same(ref, got)
    ref, got = both(lambda: late_set(snap, pre, rho))
    assert same(ref, got)


@KERNELS
@given(snap=snapshots(max_n=20), rho=st.floats(50.0, 1e5), alpha=st.sampled_from([0.5, 1.0, 4.0]),
       expired_last=st.booleans(), levels=st.integers(1, 4), data=st.data())
def test_multi_class_orders_agree(snap: Snapshot, rho: float, alpha: float, expired_last: bool, levels: int,
                                  data: st.DataObject) -> None:
    """Request classes reach the compiled MLPS sort (the class rank packed in its key)."""
    d = snap.to_dict()
    for r in d["requests"]:
        r["priority"] = data.draw(st.integers(-levels, levels))
    snap = Snapshot.from_json(d)
    pre = prefill_indices(snap)
    lost = np.array(data.draw(st.lists(st.booleans(), min_size=len(pre), max_size=len(pre))), dtype=bool)
    for mask in (None, lost):
        ref, got = both(lambda m=mask: mlps_order(snap, pre, rho, alpha, 1e-3, expired_last, m))  # type: ignore[misc]
        assert same(ref, got)
    ref, got = both(lambda: class_late_set(snap, pre, rho))
    assert same(ref, got)


@pytest.mark.parametrize("name", ["slidingserve", "sarathi-edf+sc+mlps"])
def test_multi_class_plans_are_identical_on_both_backends(name: str) -> None:
    pol = registry.create(name)
    for seed in range(40):
        base = seeded_snapshot(seed)
        rng = np.random.default_rng(seed + 991)
        d = base.to_dict()
        for r in d["requests"]:
            r["priority"] = int(rng.integers(-2, 3))
        snap = Snapshot.from_json(d)
        for pred in (default_predictor(), random_predictor(seed)):
            ref, got = both(lambda s=snap, p=pred: pol.plan(s, p))  # type: ignore[misc]
            assert ref.decision_key() == got.decision_key(), (name, seed)
            assert repr(ref.predicted_latency_ms) == repr(got.predicted_latency_ms)


@KERNELS
@given(snap=snapshots(max_n=20), skip=st.sampled_from([0.0, 1.0, 6.0]), late=st.booleans(),
       starve=st.sampled_from([0.0, 0.5, 3.0]), shift=st.sampled_from([0.0, 0.1, 1.0]), data=st.data())
def test_sit_out_agrees(snap: Snapshot, skip: float, late: bool, starve: float, shift: float,
                        data: st.DataObject) -> None:
    """Which decodes sit out (far ahead, late but not starving) and the live prefills."""
    d = snap.to_dict()
    d["now"] += shift  # later: more late and starving decodes
    snap = Snapshot.from_json(d)
    pol = registry.create("slidingserve", {"decode_skip_tbts": skip, "skip_late_decodes": late,
                                           "starve_after": starve})
    pre = prefill_indices(snap)
    lost = np.array(data.draw(st.lists(st.booleans(), min_size=len(pre), max_size=len(pre))), dtype=bool)
    dec = np.flatnonzero(snap.is_decoding)
    ref, got = both(lambda: pol._sit_out(snap, dec, pre, lost))  # type: ignore[attr-defined]
    assert same(ref[0], got[0]) and same(ref[1], got[1])


def test_orders_break_exact_ties_by_id_on_both_backends() -> None:
    reqs = [waiting(f"z{i}", 50, arrival=1.0) for i in (3, 1, 2)] + [waiting("a", 50, arrival=1.0)]
    snap = make_snapshot(reqs, now=1.5)
    ref, got = both(lambda: mlps_order(snap, prefill_indices(snap), 1000.0, 1.0, 1e-3))
    assert same(ref, got)
    assert [snap.ids[i] for i in got] == ["a", "z1", "z2", "z3"]


# --------------------------------------------------------------- batch constructor
@KERNELS
@given(snap=snapshots(max_n=20, max_prompt=80, max_bmax=128), pred=any_predictor,
       margin=st.sampled_from([1.0, 1.1, 1.5]), max_candidates=st.sampled_from([2, 64]))
def test_constructor_agrees(snap: Snapshot, pred: BatchLatencyPredictor, margin: float,
                            max_candidates: int) -> None:
    def run() -> Any:
        cq = queue_of(snap, pred)
        curve = cq.budget_curve()
        live = prefill_indices(snap)
        live = live[snap.slack[live] > 0]
        t_full = float(curve.times[cq.first_cap]) if cq.first_cap < len(curve.times) else float(curve.times[-1])
        return construct_batch(snap, live, curve, cq.n_dec, t_full, token_cap=min(cq.iter_cap, cq.kv_cap),
                               seq_cap=max(0, snap.max_num_seqs - cq.n_dec), max_candidates=max_candidates,
                               margin=margin, predictor=pred, decodes=cq.decodes)

    ref, got = both(run)
    assert ref == got


# ----------------------------------------------------------- one-token remainders
def one_token_snapshot(n: int = 20, decodes: bool = True) -> Snapshot:
    """Prefills one token short of done: every fill of them is a minor batch (no prefill
    chunk over one token), priced by the scalar formula."""
    reqs = [prefilling(f"p{i}", 40, 39, arrival=1.0 + 0.01 * i, ttft=5.0) for i in range(n)]
    reqs += [waiting(f"w{i}", 30, arrival=2.0 + 0.01 * i, ttft=5.0) for i in range(4)]
    if decodes:
        reqs += [decoding(f"d{i}", 60, 3, arrival=0.5, ttft=5.0, tbt=2.0) for i in range(3)]
    return make_snapshot(reqs, now=2.5, max_batch_tokens=64)


@pytest.mark.parametrize("decodes", [True, False])
def test_one_token_remainders_agree(decodes: bool) -> None:
    snap = one_token_snapshot(decodes=decodes)
    pred = random_predictor(3)
    cq = queue_of(snap, pred)
    c_ref, c_got = both(lambda: cq.budget_curve())
    assert same(c_ref.times, c_got.times) and same(c_ref.suffix_min, c_got.suffix_min)
    W = np.array([40.0, 80.0, 120.0])
    ref, got = both(lambda: sliding_chunk(cq, W, 1, 1 << 30, None, 0.0))
    assert ref == got
    for name in registry.names():
        pol = registry.create(name)
        ref, got = both(lambda p=pol: p.plan(snap, pred).decision_key())  # type: ignore[misc]
        assert ref == got, name


# ------------------------------------------------------------------- whole plans
VARIANTS: list[tuple[str, dict[str, Any]]] = [(n, {}) for n in registry.names()] + [
    ("slidingserve", {"window": 1}), ("slidingserve", {"window": 4, "granularity": 1}),
    ("slidingserve", {"lost_rule": "alone", "margin": 1.0}),
    ("slidingserve", {"starve_after": 0}), ("slidingserve", {"starve_after": 0.5, "decode_skip_tbts": 1}),
]


def seeded_snapshot(seed: int) -> Snapshot:
    """Small and loaded snapshots, tight and loose limits, by seed."""
    shape = seed % 5
    if shape == 0:
        return random_snapshot(seed, n=12, max_prompt=300)
    if shape == 1:
        return random_snapshot(seed, n=24, max_prompt=60, max_batch_tokens=64, free_kv_tokens=400,
                               prefill_throughput=None)
    if shape == 2:
        return random_snapshot(seed, n=8, max_num_seqs=3, decode_frac=0.7)
    if shape == 3:
        return random_snapshot(seed, n=30, max_prompt=200, max_batch_tokens=512, prefill_throughput=None)
    # loaded: pools beyond max_candidates, long grids
    return random_snapshot(seed, n=150, max_prompt=2000, max_batch_tokens=2048, decode_frac=0.5,
                           prefill_throughput=None if seed % 2 else 5000.0)


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=[f"{n}{p or ''}" for n, p in VARIANTS])
def test_plans_are_identical_on_both_backends(name: str, params: dict[str, Any]) -> None:
    pol = registry.create(name, params)
    paths: set[str] = set()
    for seed in range(80):
        snap = seeded_snapshot(seed)
        for pred in (default_predictor(), random_predictor(seed), random_predictor(seed, allow_negative=True)):
            ref, got = both(lambda s=snap, p=pred: pol.plan(s, p))  # type: ignore[misc]
            assert ref.decision_key() == got.decision_key(), (name, params, seed)
            assert repr(ref.predicted_latency_ms) == repr(got.predicted_latency_ms)
            paths.add(got.path)
    if name == "slidingserve" and params == {"starve_after": 0}:
        assert {"batch_constructor", "sliding_chunker"} <= paths  # both halves were compared
    # (these snapshots hold a request that waited 3 TTFTs nearly always: the chunker path)
    if name == "slidingserve" and not params:
        assert "sliding_chunker" in paths


# ----------------------------------------------------------------- the switch
def test_warm_up_compiles_every_kernel_once() -> None:
    from scheduler_service.core.kernels import _warm

    with kernels.using("numba"):
        first = kernels.warm_up()
        assert first >= 0.0
        assert _warm.missing() == []
        assert kernels.warm_up() == 0.0  # idempotent and free the second time
    with kernels.using("numpy"):
        assert kernels.warm_up() == 0.0


def test_use_rejects_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="numba, numpy"):
        kernels.use("fortran")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != kernels.ENV} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300,
                          check=True)


PLAN_ONE = ("from scheduler_service.core import kernels, registry, default_predictor\n"
            "from tests.factories import random_snapshot\n"
            "p = registry.create('slidingserve').plan(random_snapshot(1), default_predictor())\n"
            "print(kernels.backend(), p.path)\n")


def test_environment_selects_the_backend() -> None:
    assert _run(PLAN_ONE, SLIDINGSERVE_KERNELS="numpy").stdout.split()[0] == "numpy"
    assert _run(PLAN_ONE, SLIDINGSERVE_KERNELS="numba").stdout.split()[0] == "numba"
    assert _run(PLAN_ONE).stdout.split()[0] == "numba"  # the default
    bad = _run(PLAN_ONE, SLIDINGSERVE_KERNELS="cuda")
    assert bad.stdout.split()[0] == "numba" and "SLIDINGSERVE_KERNELS='cuda'" in bad.stderr


def test_without_numba_the_kernels_run_as_plain_python_with_one_warning() -> None:
    code = ("import sys, logging\nsys.modules['numba'] = None\nlogging.basicConfig()\n" + PLAN_ONE
            + "registry.create('qoserve').plan(random_snapshot(2), default_predictor())\n"
              "print(kernels.warm_up())\n")
    out = _run(code, SLIDINGSERVE_KERNELS="numba")
    assert out.stdout.split()[0] == "numpy" and out.stdout.split()[-1] == "0.0"
    assert out.stderr.count("numba is not importable") == 1


def test_kernels_log_through_logging(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="scheduler_service.core.kernels"), kernels.using("numba"):
        os.environ[kernels.ENV] = "bogus"
        try:
            kernels.use(None)
            assert kernels.backend() == "numba"
        finally:
            del os.environ[kernels.ENV]
    assert any("bogus" in r.getMessage() for r in caplog.records)
