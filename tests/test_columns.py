"""The request-column schema (``scheduler_service.core.columns``) is the one source of the
snapshot's columns: for every column, JSON and protobuf (both encodings) round trip, an
out-of-bounds value is rejected with the same field path by the generic and the fast
path (and renamed to the field the client set on the wire), and the simulator's and the
vLLM adapter's snapshots carry it.  Nothing here names a column: a new row of the schema
is covered as it is added."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.snapshots import busy_snapshot
from engine_adapter.sim.engine import SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.vllm.snapshot import SloDefaults, SnapshotBuilder
from scheduler_service.core import Request, Snapshot, ValidationError
from scheduler_service.core.columns import COLUMNS, COUNTER_COLUMNS, ROW_RULES, Column
from scheduler_service.core.snapshot import ALL_COLUMN_DTYPES, CLASS_COLUMN_DTYPES, COLUMN_DTYPES
from scheduler_service.core.validate import CHECKS, checks_pass, find_violations
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import snapshot_from_pb, snapshot_to_pb

IDS = [c.name for c in COLUMNS]
BOUNDED = [c for c in COLUMNS if c.bounded]
ROW = 1  # the row the bad values go into (a decode of busy_snapshot(2, 3))


def _columns(snap: Snapshot) -> dict[str, np.ndarray]:
    return {c.name: np.array(getattr(snap, c.name)) for c in COLUMNS}


def _scalars(snap: Snapshot) -> dict[str, Any]:
    return {"now": snap.now, "max_batch_tokens": snap.max_batch_tokens, "max_num_seqs": snap.max_num_seqs,
            "free_kv_tokens": snap.free_kv_tokens, "prefill_throughput": snap.prefill_throughput}


def _in_bounds(c: Column) -> Any:
    """A value of ``c`` other than its default, inside its bounds (an extreme one)."""
    if c.dtype == np.bool_:
        return not c.default
    v = c.hi if c.hi is not None else (c.lo or 0) + 7
    return c.dtype(v)


def _out_of_bounds(c: Column) -> list[Any]:
    out: list[Any] = []
    if c.hi is not None:
        out.append(c.hi + 1 if c.dtype == np.int64 else c.hi * 2)
    if c.lo is not None:
        out.append(c.lo if c.lo_open else c.lo - 1)
    if c.dtype == np.float64:
        out += [np.nan, np.inf]
    return out


def _with(snap: Snapshot, name: str, value: Any, row: int = ROW) -> dict[str, np.ndarray]:
    cols = _columns(snap)
    cols[name][row] = value
    return cols


def _sample(c: Column) -> Snapshot:
    """A valid snapshot in which ``c`` is not all default (the counters are not in busy
    snapshots; the other columns are set to an extreme value in range)."""
    snap = busy_snapshot(2, 3, seed=11)
    if c.name == "cached_tokens":  # a counter busy snapshots leave at 0: the last (waiting) row,
        # moved first, with prefix-cache hits (the row rule: at most its computed tokens)
        order = np.roll(np.arange(len(snap)), 1)
        cols = {k: v[order] for k, v in _columns(snap).items()}
        cols["computed_tokens"][0] = cols["cached_tokens"][0] = min(7, int(cols["prompt_tokens"][0]) - 1)
        return Snapshot.from_columns(ids=[snap.ids[i] for i in order], **_scalars(snap), **cols)
    if c.name in COUNTER_COLUMNS:
        return snap
    cols = _with(snap, c.name, _in_bounds(c), 0)
    if c.name == "tpot_slo":  # a paced decode's pace starts at its first token (the row rule)
        cols["first_token_time"][0] = cols["arrival"][0]
    return Snapshot.from_columns(ids=snap.ids, **_scalars(snap), **cols)


# ------------------------------------------------------------------ one source
def test_everything_is_derived_from_the_schema() -> None:
    names = [c.name for c in COLUMNS]
    assert list(ALL_COLUMN_DTYPES) == names
    assert {**COLUMN_DTYPES, **CLASS_COLUMN_DTYPES} == {c.name: c.dtype for c in COLUMNS}
    snap = busy_snapshot(1, 1)
    for c in COLUMNS:
        col = getattr(snap, c.name)
        assert col.dtype == c.dtype and len(col) == 2 and not col.flags.writeable
    assert [f for f in Request.__dataclass_fields__][1:] == names
    # every optional column may be left out of the constructor and of from_columns
    required = {c.name: getattr(snap, c.name) for c in COLUMNS if not c.optional}
    bare = Snapshot.from_columns(ids=snap.ids, **_scalars(snap), **required)
    for c in COLUMNS:
        assert np.array_equal(getattr(bare, c.name), getattr(snap, c.name) if not c.optional
                              else np.full(2, c.default, c.dtype))
    with pytest.raises(TypeError, match="missing request columns"):
        Snapshot.from_columns(ids=snap.ids, **_scalars(snap), **{**required, names[0]: None})
    with pytest.raises(TypeError, match="unknown request columns"):
        Snapshot.from_columns(ids=snap.ids, **_scalars(snap), **required, no_such_column=[1, 2])
    # every check names a column of the schema; every rule is checked
    assert {chk.column for chk in CHECKS} <= set(names)
    assert sum(chk.rule is not None for chk in CHECKS) == len(ROW_RULES)


_PB_TYPES = {np.float64: FieldDescriptor.TYPE_DOUBLE, np.int64: FieldDescriptor.TYPE_INT64,
             np.bool_: FieldDescriptor.TYPE_BOOL}


@pytest.mark.parametrize("message", [pb.RequestColumns, pb.Request])
def test_proto_has_a_field_per_column(message: Any) -> None:
    fields = {f.name: f for f in message.DESCRIPTOR.fields}
    assert set(fields) == {"ids" if message is pb.RequestColumns else "id", *(c.wire for c in COLUMNS)}
    for c in COLUMNS:
        assert fields[c.wire].type == _PB_TYPES[c.dtype], c.name


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("column", COLUMNS, ids=IDS)
def test_json_round_trip(column: Column) -> None:
    snap = _sample(column)
    assert (getattr(snap, column.name) != column.default).any()
    back = Snapshot.from_json(snap.to_json())
    assert back.to_dict() == snap.to_dict()
    for c in COLUMNS:
        assert getattr(back, c.name).tobytes() == getattr(snap, c.name).tobytes()
    assert Snapshot.from_requests(snap.requests(), **{k: v for k, v in _scalars(snap).items() if k != "now"},
                                  now=snap.now).to_dict() == snap.to_dict()
    row = snap.to_dict()["requests"][0]
    assert (column.json_key in row) == (not column.optional or row.get(column.json_key) != column.default)


@pytest.mark.parametrize("encoding", ["columns", "rows"])
@pytest.mark.parametrize("column", COLUMNS, ids=IDS)
def test_protobuf_round_trip(column: Column, encoding: str) -> None:
    snap = _sample(column)
    msg = pb.Snapshot.FromString(snapshot_to_pb(snap, encoding=encoding).SerializeToString())
    back, _ = snapshot_from_pb(msg, max_requests=100)
    for c in COLUMNS:
        a, b = getattr(back, c.name), getattr(snap, c.name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), c.name
    if encoding == "columns":  # an optional column is sent only where some request differs
        sent = len(getattr(msg.columns, column.wire))
        assert sent == len(snap) if not column.optional or (getattr(snap, column.name) != column.default).any() \
            else sent == 0


def test_optional_columns_left_out_on_the_wire_when_all_default() -> None:
    snap = busy_snapshot(2, 2, seed=3)
    msg = snapshot_to_pb(snap)
    for c in COLUMNS:
        assert len(getattr(msg.columns, c.wire)) == (0 if c.optional else len(snap)), c.name


# ---------------------------------------------------------------- validation
def _violations(fn: Any) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as ei:
        fn()
    return [(v.field, v.description) for v in ei.value.violations]


@pytest.mark.parametrize(("column", "value"), [(c, v) for c in BOUNDED for v in _out_of_bounds(c)],
                         ids=[f"{c.name}={v}" for c in BOUNDED for v in _out_of_bounds(c)])
def test_out_of_bounds_rejected_identically(column: Column, value: Any) -> None:
    snap = busy_snapshot(2, 3, seed=11)
    cols = _with(snap, column.name, value)
    expected = (f"requests[{ROW}].{column.name}", column.bounds_message)
    generic = _violations(lambda: Snapshot.from_columns(ids=snap.ids, **_scalars(snap),
                                                        **{k: v.copy() for k, v in cols.items()}))
    fast = _violations(lambda: Snapshot.from_arrays(ids=snap.ids, columns={k: v.copy() for k, v in cols.items()},
                                                    **_scalars(snap)))
    assert expected in generic and generic == fast
    # JSON: the same check, at the JSON key
    bad = Snapshot(ids=snap.ids, **_scalars(snap), **cols)  # the constructor does not validate
    as_json = _violations(lambda: Snapshot.from_json(bad.to_dict()))
    assert (f"requests[{ROW}].{column.json_key}", column.bounds_message) in as_json
    # protobuf: renamed to the field the client set, in either encoding
    for encoding, path in (("columns", f"snapshot.columns.{column.wire}[{ROW}]"),
                           ("rows", f"snapshot.rows.requests[{ROW}].{column.wire}")):
        msg = pb.Snapshot.FromString(snapshot_to_pb(bad, encoding=encoding).SerializeToString())
        assert (path, column.bounds_message) in _violations(lambda m=msg: snapshot_from_pb(m, max_requests=100))


def _edge_values(c: Column) -> list[Any]:
    """In-range, boundary and out-of-range values of ``c``."""
    if c.dtype == np.bool_:
        return [False, True]
    vals: list[Any] = [c.default, 0, 1, 2, 3, *_out_of_bounds(c)]
    for b in (c.lo, c.hi):
        if b is not None:
            vals += [b, b + 1, b - 1]
    return [v for v in vals if c.dtype != np.int64 or (isinstance(v, int | float) and np.isfinite(v))]


@st.composite
def _arrays(draw: Any) -> dict[str, np.ndarray]:
    n = draw(st.integers(0, 6))
    out = {}
    for c in COLUMNS:
        if c.optional and draw(st.booleans()):
            continue  # left out
        out[c.name] = np.array([draw(st.sampled_from(_edge_values(c))) for _ in range(n)], dtype=c.dtype)
    return out


@settings(max_examples=300, deadline=None)
@given(_arrays())
def test_fast_verdict_is_the_generic_one(a: dict[str, np.ndarray]) -> None:
    """The fast path's verdict (a few reductions) is exactly "the generic path finds no
    violation", on any values, NaN and the bounds themselves included."""
    assert checks_pass(a) == (find_violations(a) == [])


@pytest.mark.parametrize("column", COLUMNS, ids=IDS)
def test_wrong_json_type_names_the_key(column: Column) -> None:
    doc = busy_snapshot(1, 1).to_dict()
    doc["requests"][ROW][column.json_key] = "x"
    v = _violations(lambda: Snapshot.from_json(doc))
    assert v[0][0] == f"requests[{ROW}].{column.json_key}" and v[0][1].startswith("must be ")


@pytest.mark.parametrize("column", [c for c in COLUMNS if c.required], ids=[c.name for c in COLUMNS if c.required])
def test_required_json_key(column: Column) -> None:
    doc = busy_snapshot(1, 1).to_dict()
    del doc["requests"][0][column.json_key]
    assert _violations(lambda: Snapshot.from_json(doc)) == [(f"requests[0].{column.json_key}", "is required")]


# ------------------------------------------------------------------- builders
def test_simulator_snapshot_has_every_column() -> None:
    n = 4
    w = Workload(arrival=np.arange(n, dtype=np.float64), prompt_tokens=np.full(n, 64, np.int64),
                 output_tokens=np.full(n, 8, np.int64), ttft_slo=np.full(n, 2.0), tbt_slo=np.full(n, 0.1),
                 protected=np.array([True, False, False, False]), priority=np.array([0, 1, -2, 0]),
                 sheddable=np.array([False, True, False, False]), e2e_slo=np.array([0.0, 5.0, 0.0, 0.0]))
    eng = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILES[DEFAULT_PROFILE], adapter=None)  # type: ignore[arg-type]
    act = np.arange(n)
    snap = eng._snapshot(act)
    for c in COLUMNS:
        col = getattr(snap, c.name)
        assert col.dtype == c.dtype and len(col) == n, c.name
        if c.name not in COUNTER_COLUMNS and hasattr(w, c.name):
            assert np.array_equal(col, getattr(w, c.name)), c.name


def _vllm_request(i: int, running: bool, **extra: Any) -> Any:
    p = 50 + i
    return types.SimpleNamespace(
        request_id=f"q{i}", arrival_time=100.0 + i, num_prompt_tokens=p,
        num_computed_tokens=p + 2 if running else 0, num_tokens=p + 3 if running else p,
        num_output_tokens=3 if running else 0, num_output_placeholders=0, max_tokens=64,
        priority=i % 3, sampling_params=types.SimpleNamespace(extra_args=extra or None))


def test_vllm_builder_snapshot_has_every_column_and_is_validated() -> None:
    b = SnapshotBuilder(SloDefaults(), profile="m|h|tp1")
    run = [_vllm_request(i, True) for i in range(2)]
    wait = [_vllm_request(2, False, slo_sheddable=True, slo_e2e_ms=4000, slo_protected=True),
            _vllm_request(3, False, slo_ttft_ms=1e30)]  # clipped into the schema's bounds
    snap, rows = b.build(run, wait, max_batch_tokens=4096, max_num_seqs=8, free_kv_tokens=1000, now=200.0)
    assert rows == run + wait
    for c in COLUMNS:
        col = getattr(snap, c.name)
        assert col.dtype == c.dtype and len(col) == 4 and not col.flags.writeable, c.name
    assert snap.priority.tolist() == [0, 1, 2, 0] and snap.sheddable.tolist() == [False, False, True, False]
    assert snap.e2e_slo.tolist()[2] == 4.0 and snap.protected.tolist()[2]
    ttft = next(c for c in COLUMNS if c.name == "ttft_slo")
    assert snap.ttft_slo[3] == ttft.hi
    # the same snapshot as the generic, validating path builds from the same columns
    generic = Snapshot.from_columns(ids=snap.ids, profile=snap.profile, **_scalars(snap), **_columns(snap))
    assert generic.to_dict() == snap.to_dict()
    # it goes through the schema's checks: a row that breaks one is rejected, by name
    bad = _vllm_request(4, False)
    bad.arrival_time = float("nan")
    with pytest.raises(ValidationError) as ei:
        b.build(run, [bad], max_batch_tokens=4096, max_num_seqs=8, free_kv_tokens=1000, now=200.0)
    assert [v.field for v in ei.value.violations] == ["requests[2].arrival"]
    with pytest.raises(ValidationError, match="duplicates"):
        b.build(run, [run[0]], max_batch_tokens=4096, max_num_seqs=8, free_kv_tokens=1000, now=200.0)


def test_snapshot_and_request_declare_the_schema_columns() -> None:
    """Each request column of the schema is a declared field of both classes, in the
    schema's order; a request's default is the schema's, and a column every request
    must set has none."""
    from dataclasses import MISSING, fields

    from scheduler_service.core import Request, Snapshot

    names = [c.name for c in COLUMNS]
    snap_fields = [f.name for f in fields(Snapshot) if f.init]
    assert snap_fields[snap_fields.index(names[0]):] == names
    req = {f.name: f for f in fields(Request)}
    assert [n for n in req if n != "id"] == names
    for c in COLUMNS:
        f = req[c.name]
        assert (f.default is MISSING) == c.required, c.name
        if not c.required:
            assert f.default == c.default and type(f.default) is type(np.zeros(1, c.dtype)[0].item()), c.name
