"""The fast columnar wire path (``Snapshot.from_arrays`` behind ``snapshot_from_pb``) against
the generic one (``Snapshot.from_columns``): same snapshots, same plans, and for bad input the
same violations in the same order, so that the speed-up changes no answer a client sees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.snapshots import busy_snapshot
from scheduler_service.core import Plan, Snapshot, ValidationError, default_predictor, registry
from scheduler_service.core.plan import Allocation
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import (
    columns_to_arrays,
    plan_from_pb,
    plan_to_pb,
    snapshot_from_pb,
    snapshot_to_pb,
)
from tests.strategies import snapshots

COLUMNS = ("arrival", "prompt_tokens", "computed_tokens", "output_tokens", "ttft_slo", "tbt_slo", "protected")


def _arrays(snap: Snapshot) -> dict[str, np.ndarray]:
    """The always-sent columns, and cached_tokens where the strategy drew cached prefixes."""
    extra = ("cached_tokens",) if snap.cached_tokens.any() else ()
    return {k: np.array(getattr(snap, k)) for k in COLUMNS + extra}


def _scalars(snap: Snapshot) -> dict[str, object]:
    return {"now": snap.now, "max_batch_tokens": snap.max_batch_tokens, "max_num_seqs": snap.max_num_seqs,
            "free_kv_tokens": snap.free_kv_tokens, "prefill_throughput": snap.prefill_throughput}


def _both(ids: tuple[str, ...], cols: dict[str, np.ndarray], **scal: object) -> tuple[object, object]:
    """(generic result, fast result): a Snapshot's dict or the violations raised."""
    out = []
    for build in (lambda: Snapshot.from_columns(ids=ids, **{k: v.copy() for k, v in cols.items()}, **scal),
                  lambda: Snapshot.from_arrays(ids=ids, columns={k: v.copy() for k, v in cols.items()}, **scal)):
        try:
            out.append(build().to_dict())
        except ValidationError as e:
            out.append(e.violations)
    return out[0], out[1]


@settings(max_examples=150, deadline=None)
@given(snapshots(max_n=12))
def test_same_snapshot_as_generic_path(snap: Snapshot) -> None:
    generic, fast = _both(snap.ids, _arrays(snap), **_scalars(snap))
    assert generic == fast == snap.to_dict()


# (column, row, bad value): every value check of _validate_rows, and NaN/inf.
BAD = [
    ("arrival", 0, np.nan), ("arrival", 1, np.inf), ("arrival", 2, -2e12),
    ("ttft_slo", 1, 0.0), ("ttft_slo", 0, np.nan), ("ttft_slo", 2, 2e12),
    ("tbt_slo", 2, -1.0), ("tbt_slo", 0, np.inf),
    ("prompt_tokens", 0, 0), ("prompt_tokens", 1, 1 << 41),
    ("computed_tokens", 1, -1), ("computed_tokens", 0, 10**6),
    ("output_tokens", 2, -3), ("output_tokens", 0, 1 << 41), ("output_tokens", 1, 0), ("output_tokens", 2, 5),
]


@pytest.mark.parametrize(("column", "row", "value"), BAD)
def test_same_violations_as_generic_path(column: str, row: int, value: float) -> None:
    snap = busy_snapshot(2, 3, seed=1)  # rows 0-1 decode, 2-4 queued
    cols = _arrays(snap)
    cols[column][row] = value
    generic, fast = _both(snap.ids, cols, **_scalars(snap))
    assert isinstance(fast, tuple) and fast == generic


@pytest.mark.parametrize("ids", [("a", "b", "a"), ("a", "", "c"), ("a", "x" * 257, "c"), ("", "", "y" * 300)])
def test_same_id_violations(ids: tuple[str, ...]) -> None:
    snap = busy_snapshot(1, 2, seed=2)
    generic, fast = _both(ids, _arrays(snap), **_scalars(snap))
    assert isinstance(fast, tuple) and fast == generic


def test_same_length_and_scalar_violations() -> None:
    snap = busy_snapshot(2, 2, seed=3)
    cols = _arrays(snap)
    cols["tbt_slo"] = cols["tbt_slo"][:-1]
    cols["protected"] = cols["protected"][:1]
    bad = {**_scalars(snap), "now": float("nan"), "max_batch_tokens": 0, "prefill_throughput": -1.0}
    generic, fast = _both(snap.ids, cols, **bad)
    assert isinstance(fast, tuple) and fast == generic and len(fast) == 5


def test_wrong_dtype_is_the_callers_bug() -> None:
    snap = busy_snapshot(1, 1, seed=4)
    cols = _arrays(snap)
    cols["prompt_tokens"] = cols["prompt_tokens"].astype(np.float64)
    with pytest.raises(TypeError, match="prompt_tokens"):
        Snapshot.from_arrays(ids=snap.ids, columns=cols, **_scalars(snap))  # type: ignore[arg-type]


def test_columns_to_arrays_types_and_ownership() -> None:
    snap = busy_snapshot(8, 8, seed=5)
    msg = pb.Snapshot.FromString(snapshot_to_pb(snap).SerializeToString())
    ids, cols = columns_to_arrays(msg.columns)
    assert ids == snap.ids
    for k in COLUMNS:
        assert cols[k].dtype == getattr(snap, k).dtype and np.array_equal(cols[k], getattr(snap, k))
        assert cols[k].flags.owndata  # a copy: the message may be reused or freed


def test_decoded_snapshot_is_exact_and_read_only() -> None:
    snap = busy_snapshot(256, 512, seed=6)
    back, _ = snapshot_from_pb(pb.Snapshot.FromString(snapshot_to_pb(snap).SerializeToString()),
                               max_requests=100_000)
    assert back.ids == snap.ids
    for k in COLUMNS:
        a, b = getattr(back, k), getattr(snap, k)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes() and not a.flags.writeable
    assert back.index_of == {rid: i for i, rid in enumerate(snap.ids)}  # built on first use
    pol, pred = registry.create("slidingserve"), default_predictor()
    assert pol.plan(back, pred).decision_key() == pol.plan(snap, pred).decision_key()


@pytest.mark.parametrize("allocations", [(), (Allocation("a", 3),), tuple(Allocation(f"r{i}", i + 1) for i in range(300))])
def test_plan_round_trip_columnar(allocations: tuple[Allocation, ...]) -> None:
    plan = Plan("slidingserve", "1.0.0", "p-x", "sliding_chunker", sum(a.tokens for a in allocations), 3.25,
                allocations, 99, {"sorter": 4}, deployment="v2")
    assert plan_from_pb(pb.Plan.FromString(plan_to_pb(plan).SerializeToString())) == plan


@given(st.integers(0, 40), st.integers(0, 40))
@settings(max_examples=25, deadline=None)
def test_busy_round_trip_any_size(decodes: int, queued: int) -> None:
    snap = busy_snapshot(decodes, queued, seed=decodes * 41 + queued)
    back, _ = snapshot_from_pb(pb.Snapshot.FromString(snapshot_to_pb(snap).SerializeToString()), max_requests=1000)
    assert back.to_dict() == {**snap.to_dict(), "profile": "||tp1"}  # the default profile's key


@pytest.mark.parametrize("scalars", [
    {"now": 1.5}, {"now": -1e12}, {"now": 1e13}, {"now": float("inf")}, {"now": 3},
    {"max_batch_tokens": True}, {"max_batch_tokens": 1 << 20}, {"max_batch_tokens": (1 << 20) + 1},
    {"max_num_seqs": np.int64(4)}, {"max_num_seqs": 0}, {"free_kv_tokens": 0}, {"free_kv_tokens": -1},
    {"free_kv_tokens": None}, {"prefill_throughput": 1e-3}, {"prefill_throughput": 1e-4},
    {"prefill_throughput": float("nan")}, {"prefill_throughput": 1e12}, {"prefill_throughput": 5},
])
def test_same_scalars_as_generic_path(scalars: dict[str, object]) -> None:
    snap = busy_snapshot(2, 2, seed=7)
    generic, fast = _both(snap.ids, _arrays(snap), **{**_scalars(snap), **scalars})
    assert fast == generic


@pytest.mark.parametrize("value", [-(1 << 63), (1 << 31), -(1 << 31), (1 << 31) - 1])
def test_priority_bounds_same_on_both_paths(value: int) -> None:
    """Including int64's minimum, whose absolute value overflows to itself."""
    snap = busy_snapshot(2, 2, seed=8)
    cols = {**_arrays(snap), "priority": np.array([0, value, 0, 0], dtype=np.int64)}
    generic, fast = _both(snap.ids, cols, **_scalars(snap))
    assert fast == generic
    assert isinstance(fast, tuple) == (abs(value) > (1 << 31) - 1)
