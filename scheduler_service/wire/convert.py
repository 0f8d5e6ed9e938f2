"""Protobuf ↔ core conversion, used at the edges only (server and client both import it).

The core works on numpy columns; the wire's columnar encoding maps onto them directly:
``np.array(repeated_field, dtype)`` reads a packed repeated field through the buffer
protocol in a few µs for hundreds of requests, without a Python loop.  The row encoding is
supported for engines that find it easier to build, at a measured cost (see
``benchmarks/grpc_latency.py``).

Validation is the core's (:meth:`Snapshot.from_columns`); this module only renames the
violated fields from the core's JSON paths (``requests[3].computed_tokens``) to the wire
paths of the message the client sent (``snapshot.columns.computed_tokens[3]``), so that an
error names the field the caller actually set.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from scheduler_service.core import (
    Allocation,
    BatchLatencyPredictor,
    FieldViolation,
    Plan,
    Rejection,
    Snapshot,
    ValidationError,
    batch_features,
)
from scheduler_service.core.columns import COLUMNS
from scheduler_service.core.params import param_text
from scheduler_service.core.plan import Reason, Reasons
from scheduler_service.core.predictor import N_FEATURES, scenario_codes
from scheduler_service.core.reasons import CODES
from scheduler_service.core.snapshot import MAX_BATCH_TOKENS, MAX_TOKENS
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb

from .profile import EngineProfile
from .status import MAX_DESCRIPTION_BYTES, MAX_FIELD_BYTES, MAX_VIOLATIONS, clip

__all__ = ["MAX_TOKENS", "describe_to_pb", "encode_plan", "plan_from_pb", "plan_to_pb", "profile_from_pb",
           "profile_to_pb", "report_from_pb", "snapshot_from_pb", "snapshot_to_pb", "violations_from_pb",
           "violations_to_pb"]

#: Largest plausible iteration latency (ms): anything above is a unit error, not a sample.
MAX_LATENCY_MS = 600_000.0
#: Largest feature a composition within the limits can produce: Σc <= MAX_BATCH_TOKENS
#: (2^20, so also <= 2^20 requests) and u <= 2^40 bound every x_i by 2^20 * (2^40 + 2^20).
MAX_FEATURE = float(2**61)

#: The request columns (the core's schema, ``scheduler_service.core.columns``): those
#: always sent, and the optional ones (empty on the wire = the default for every request).
_ALWAYS = tuple(c for c in COLUMNS if not c.optional)
_OPTIONAL = tuple(c for c in COLUMNS if c.optional)
#: Always-sent columns encoded as packed fixed-width bytes straight from numpy (doubles,
#: bools; with their field numbers), and those protobuf encodes as varints (int64).
_FIXED_COLUMNS = tuple((c, pb.RequestColumns.DESCRIPTOR.fields_by_name[c.wire].number)
                       for c in _ALWAYS if c.dtype in (np.float64, np.bool_))
_VARINT_COLUMNS = tuple(c for c in _ALWAYS if c.dtype not in (np.float64, np.bool_))
#: The core's column name → the field of ``RequestColumns`` and ``Request``.
_WIRE_NAMES = {c.name: c.wire for c in COLUMNS}
_ROW_PATH = re.compile(r"^requests\[(\d+)\]\.(\w+)$")
#: The snapshot's scalar fields, the same names in the core and on the wire; the optional
#: ones (proto3 ``optional``) are None in the core when unset.
_OPTIONAL_SCALARS: tuple[Literal["free_kv_tokens", "prefill_throughput"], ...] = (
    "free_kv_tokens", "prefill_throughput")
_SCALARS = ("now", "max_batch_tokens", "max_num_seqs", *_OPTIONAL_SCALARS)
#: The plan's scalar fields, the same names in :class:`Plan` and ``pb.Plan``.
_PLAN_SCALARS = ("policy", "policy_version", "predictor_version", "path", "token_budget",
                 "predicted_latency_ms", "decision_us", "deployment")


# ---------------------------------------------------------------- profiles
def profile_from_pb(msg: pb.EngineProfile, field: str = "snapshot.engine_profile") -> EngineProfile:
    try:
        return _profile(msg.model, msg.hardware, int(msg.tensor_parallel))
    except ValueError as e:
        raise ValidationError.single(field, str(e)) from None


@functools.lru_cache(maxsize=1024)
def _profile(model: str, hardware: str, tensor_parallel: int) -> EngineProfile:
    """Profiles are immutable and an engine sends the same one every iteration, so its
    checks run once per distinct profile (bounded: the names come from clients; a
    ``ValueError`` is not cached)."""
    return EngineProfile(model, hardware, tensor_parallel)


def profile_to_pb(profile: EngineProfile) -> pb.EngineProfile:
    return pb.EngineProfile(model=profile.model, hardware=profile.hardware,
                            tensor_parallel=profile.tensor_parallel)


# --------------------------------------------------------------- snapshots
def _wire_field(core_field: str, prefix: str, encoding: str) -> str:
    """Rename a core (JSON) field path to the path in the protobuf message."""
    if m := _ROW_PATH.match(core_field):
        i, name = m.groups()
        if encoding == "rows":
            return f"{prefix}.rows.requests[{i}].{_WIRE_NAMES.get(name, name)}"
        return f"{prefix}.columns.{'ids' if name == 'id' else _WIRE_NAMES.get(name, name)}[{i}]"
    if core_field in _SCALARS:
        return f"{prefix}.{core_field}"
    if core_field == "requests":
        return f"{prefix}.rows.requests" if encoding == "rows" else f"{prefix}.columns"
    if encoding == "columns":
        return f"{prefix}.columns.{_WIRE_NAMES.get(core_field, core_field)}"
    return f"{prefix}.{core_field}"


def _rename(err: ValidationError, prefix: str, encoding: str) -> ValidationError:
    return ValidationError([FieldViolation(_wire_field(v.field, prefix, encoding), v.description)
                            for v in err.violations])


def snapshot_from_pb(msg: pb.Snapshot, *, max_requests: int,
                     prefix: str = "snapshot") -> tuple[Snapshot, EngineProfile]:
    """Validate a wire snapshot into a core :class:`Snapshot` (profile key set) and its profile."""
    profile = profile_from_pb(msg.engine_profile, f"{prefix}.engine_profile")
    encoding = msg.WhichOneof("requests") or "columns"
    n = len(msg.columns.ids) if encoding == "columns" else len(msg.rows.requests)
    if n > max_requests:  # before any column is read: the limit bounds the work
        raise ValidationError.single(_wire_field("requests", prefix, encoding),
                                     f"has {n} requests, more than the limit {max_requests}")
    scalars: dict[str, Any] = {k: getattr(msg, k) for k in _SCALARS}
    scalars.update({k: None for k in _OPTIONAL_SCALARS if not msg.HasField(k)})
    scalars.update(profile=profile.key, max_requests=max_requests)
    try:
        if encoding == "columns":
            ids, columns = columns_to_arrays(msg.columns)
            snap = Snapshot.from_arrays(ids=ids, columns=columns, **scalars)
        else:
            snap = _rows_snapshot(msg.rows.requests, scalars)
    except ValidationError as e:
        raise _rename(e, prefix, encoding) from None
    return snap, profile


def columns_to_arrays(c: pb.RequestColumns) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The columnar encoding straight into numpy: each repeated field is one C-level copy
    (``np.asarray`` on protobuf's typed container; measured as fast as ``np.array`` and
    10x faster than ``np.fromiter``), no per-request Python object but the id strings.
    Not validated: :meth:`Snapshot.from_arrays` does that vectorised, relying on the
    container's type for each element's."""
    columns = {col.name: np.asarray(getattr(c, col.wire), dtype=col.dtype) for col in _ALWAYS}
    for col in _OPTIONAL:  # sent only when some request has a value
        values = getattr(c, col.wire)
        if len(values):
            columns[col.name] = np.asarray(values, dtype=col.dtype)
    return tuple(c.ids), columns


def _rows_snapshot(rows: Sequence[pb.Request], scalars: dict[str, Any]) -> Snapshot:
    """The row encoding: one Python object per request and field (slower; see the module)."""
    cols: dict[str, Any] = {c.name: np.array([getattr(r, c.wire) for r in rows], dtype=c.dtype)
                            for c in COLUMNS}
    return Snapshot.from_columns(ids=tuple(r.id for r in rows), **scalars, **cols)


def snapshot_to_pb(
    snap: Snapshot,
    *,
    profile: EngineProfile | None = None,
    engine_id: str = "",
    encoding: str = "columns",
) -> pb.Snapshot:
    """Encode a core snapshot; ``encoding`` is ``"columns"`` (default, faster) or ``"rows"``."""
    msg = pb.Snapshot(engine_id=engine_id, **{k: getattr(snap, k) for k in _SCALARS})  # None: unset
    if profile is None and snap.profile:
        profile = EngineProfile.parse(snap.profile)
    if profile is not None:
        msg.engine_profile.CopyFrom(profile_to_pb(profile))
    if encoding == "columns":
        c = msg.columns
        c.ids.extend(snap.ids)
        for col in _VARINT_COLUMNS:
            getattr(c, col.wire).extend(getattr(snap, col.name).tolist())
        c.MergeFromString(_packed_fixed_columns(snap))
        for col in _OPTIONAL:  # sent only when some request is not of the default
            values = getattr(snap, col.name)
            if (values != col.default).any():
                getattr(c, col.wire).extend(values.tolist())
    elif encoding == "rows":
        wires = ("id", *(col.wire for col in COLUMNS))
        lists = [getattr(snap, col.name).tolist() for col in COLUMNS]
        add = msg.rows.requests.add
        for row in zip(snap.ids, *lists, strict=True):
            add(**dict(zip(wires, row, strict=True)))
    else:
        raise ValueError(f"encoding must be 'columns' or 'rows', got {encoding!r}")
    return msg


_LEN = [bytes((n,)) for n in range(128)]  # the one-byte varints


def _varint(n: int) -> bytes:
    if n < 128:
        return _LEN[n]
    if n < 16384:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _packed(field_number: int, raw: bytes) -> bytes:
    """A length-delimited field (a packed repeated one, a string) as wire bytes."""
    return _varint((field_number << 3) | 2) + _varint(len(raw)) + raw


def _packed_fixed_columns(snap: Snapshot) -> bytes:
    """The double and bool columns of RequestColumns as packed wire bytes, straight from
    numpy (little-endian IEEE doubles; bools are one-byte varints 0/1).  About twice as
    fast as ``extend(arr.tolist())``; merged into the message, so the result is the same
    message protobuf itself would build (pinned by a test)."""
    arrays = ((number, getattr(snap, col.name)) for col, number in _FIXED_COLUMNS)
    return b"".join(_packed(number, a.astype(np.uint8 if a.dtype == np.bool_ else "<f8").tobytes())
                    for number, a in arrays if len(a))


# ------------------------------------------------------------------- plans
def plan_to_pb(plan: Plan) -> pb.Plan:
    """Columnar: the allocations split into two tuples in one ``zip`` and handed to the
    message constructor, which copies each repeated field at C speed.  Reasons go in
    field 15 and, kept as :class:`Reasons` arrays, in the compact fields too (what
    :func:`encode_plan` writes faster)."""
    msg = _plan_msg(plan, plan.reasons)
    if isinstance(plan.reasons, Reasons):  # kept as arrays: the compact form too
        msg.MergeFromString(_compact_reasons(plan.reasons))
    return msg


def _plan_msg(plan: Plan, reasons: Iterable[Reason] = ()) -> pb.Plan:
    """The plan's message with ``reasons`` as field 15 (the compact fields left to the caller)."""
    ids, tokens = zip(*plan.allocations, strict=True) if plan.allocations else ((), ())
    msg = pb.Plan(policy=plan.policy, policy_version=plan.policy_version,
                  predictor_version=plan.predictor_version, path=plan.path, token_budget=plan.token_budget,
                  predicted_latency_ms=plan.predicted_latency_ms, decision_us=plan.decision_us,
                  deployment=plan.deployment, allocation_ids=ids, allocation_tokens=tokens)
    # every decision: only the fields a plan has are set (empty ones cost ~2 us through the constructor)
    if plan.breakdown_us:
        msg.breakdown_us.update({str(k): int(v) for k, v in plan.breakdown_us.items()})
    if plan.rejections:
        msg.reject_ids.extend([r.id for r in plan.rejections])
        msg.reject_reasons.extend([r.reason for r in plan.rejections])
    if plan.preemptions:
        msg.preempt_ids.extend(plan.preemptions)
    if reasons:
        msg.reasons.extend([pb.PlanReason(id=r.id, code=r.code, value=r.value) for r in reasons])
    return msg


#: ``Plan.reasons`` (field 15) entries: each code's encoded ``code`` field, one-byte lengths.
_CODE_FIELDS = [b"\x12" + bytes((len(c),)) + c.encode() for c in CODES]
#: The compact reason fields (16-19).
_F_TABLE, _F_CODES = pb.Plan.REASON_CODE_TABLE_FIELD_NUMBER, pb.Plan.REASON_CODES_FIELD_NUMBER
_F_ROWS, _F_VALUES = pb.Plan.REASON_ROWS_FIELD_NUMBER, pb.Plan.REASON_VALUES_FIELD_NUMBER


@functools.lru_cache(maxsize=16)
def _table_bytes(names: tuple[str, ...]) -> bytes:
    """``reason_code_table`` of ``names`` as wire bytes (built once per table)."""
    return b"".join(_packed(_F_TABLE, c.encode()) for c in names)


_CODES_TABLE = _table_bytes(CODES)


def _compact_reasons(reasons: Reasons) -> bytes:
    """The compact reason fields (16-19) of ``reasons`` as wire bytes, straight from the
    arrays: the code table (constant; built once), one byte per code, the rows as little-endian
    fixed32 and the values as doubles, each one numpy ``tobytes``."""
    rows, codes, values = reasons.arrays()
    table = _CODES_TABLE if reasons.names is CODES else _table_bytes(reasons.names)
    if not len(rows):
        return table
    raw = codes.view(np.uint8) if codes.itemsize == 1 else codes.astype(np.uint8)  # int8 codes: a view
    return b"".join((table, _packed(_F_CODES, raw.tobytes()), _packed(_F_ROWS, rows.astype("<u4").tobytes()),
                     _packed(_F_VALUES, values.astype("<f8", copy=False).tobytes())))


def encode_plan(plan: Plan, ids: Sequence[str], *, full: bool = True) -> pb.Plan:
    """``plan_to_pb(plan)`` of a plan made for a snapshot with ``ids``.  An explained plan
    (reasons kept as :class:`Reasons` arrays) carries them in the compact fields (16-19)
    and, with ``full``, also one ``PlanReason`` per waiting request (field 15, what
    engines built before the compact form read), written straight from the arrays into
    wire bytes (``Reason`` and ``PlanReason`` objects per waiting request cost about
    twice the decision itself)."""
    reasons = plan.reasons
    if not isinstance(reasons, Reasons):
        return plan_to_pb(plan)
    rows, codes, values = reasons.arrays()
    full = full and len(rows) > 0
    # Field 15 of a table decoded from the wire by protobuf itself, of CODES as bytes here.
    msg = _plan_msg(plan, reasons if full and reasons.names is not CODES else ())
    parts = [_compact_reasons(reasons)]
    if full and reasons.names is CODES:
        parts.append(_plan_reasons(rows, codes, values, ids))
    msg.MergeFromString(b"".join(parts))
    return msg


def _plan_reasons(rows: np.ndarray, codes: np.ndarray, values: np.ndarray, ids: Sequence[str]) -> bytes:
    """Field 15, one ``PlanReason`` per waiting request, as wire bytes (codes: :data:`CODES`)."""
    vals = values.astype("<f8").tobytes()
    fields = _CODE_FIELDS
    parts: list[bytes] = []
    for r, c, k in zip(rows.tolist(), codes.tolist(), range(0, len(vals), 8), strict=True):
        rid = ids[r].encode()
        code, n = fields[c], _varint(len(rid))
        # z: field 15, length-delimited; \n: field 1 (id); \x19: field 3 (value), a double
        parts += (b"z", _varint(len(rid) + len(n) + len(code) + 10), b"\n", n, rid, code, b"\x19",
                  vals[k:k + 8])
    return b"".join(parts)


def plan_from_pb(msg: pb.Plan, ids: Sequence[str] | None = None) -> Plan:
    """The plan of ``msg``.  Its reasons: with ``ids`` (those of the snapshot the plan
    answers) and the compact fields set, a lazy :class:`Reasons` over them (no object per
    request until read); else the ``PlanReason`` entries of field 15 (an older service's
    plan, or a caller without the snapshot).  Compact fields that do not fit ``ids`` (rows
    out of range, lengths that differ, an index past the table) are ignored for field 15."""
    reasons: Sequence[Reason] = tuple(Reason(r.id, r.code, r.value) for r in msg.reasons)
    if ids is not None and msg.reason_code_table:
        reasons = _decode_reasons(msg, ids) or reasons
    return Plan(
        **{k: getattr(msg, k) for k in _PLAN_SCALARS},
        allocations=tuple(Allocation(i, t)
                          for i, t in zip(msg.allocation_ids, msg.allocation_tokens, strict=True)),
        breakdown_us=dict(msg.breakdown_us),
        rejections=tuple(map(Rejection, msg.reject_ids, msg.reject_reasons)),
        preemptions=tuple(msg.preempt_ids),
        reasons=reasons,
    )


def _decode_reasons(msg: pb.Plan, ids: Sequence[str]) -> Reasons | None:
    """The compact reason fields as :class:`Reasons` (None: they do not fit ``ids``)."""
    table = tuple(msg.reason_code_table)
    codes = np.frombuffer(msg.reason_codes, dtype=np.uint8)
    rows = np.asarray(msg.reason_rows, dtype=np.int64)
    values = np.asarray(msg.reason_values, dtype=np.float64)
    if not len(codes) == len(rows) == len(values):
        return None
    if len(rows) and (int(rows.max()) >= len(ids) or int(codes.max()) >= len(table)):
        return None
    return Reasons(ids, rows, codes, values, names=CODES if table == CODES else table)


# -------------------------------------------------------------- violations
def violations_to_pb(err: ValidationError) -> list[pb.FieldViolation]:
    """Bounded like the unary status (:mod:`.status`): violations echo client input."""
    return [pb.FieldViolation(field=clip(v.field, MAX_FIELD_BYTES),
                              description=clip(v.description, MAX_DESCRIPTION_BYTES))
            for v in err.violations[:MAX_VIOLATIONS]]


def violations_from_pb(items: Sequence[Any]) -> tuple[FieldViolation, ...]:
    """Works for ``slidingserve.v1.FieldViolation`` and ``google.rpc.BadRequest.FieldViolation``."""
    return tuple(FieldViolation(v.field, v.description) for v in items)


# ----------------------------------------------------------------- reports
def report_from_pb(
    msg: pb.IterationReport, *, max_requests: int, field: str = "report"
) -> tuple[EngineProfile, np.ndarray, int, float]:
    """Validate one report: (profile, features x[7], scenario code, latency ms).

    Reports train the predictor every engine of the profile relies on, so anything not
    plainly sane is rejected rather than clipped: one unit error (seconds sent as ms) would
    otherwise skew every later decision.
    """
    profile = profile_from_pb(msg.engine_profile, f"{field}.engine_profile")
    lat = msg.latency_ms
    if not np.isfinite(lat) or not 0 < lat <= MAX_LATENCY_MS:
        raise ValidationError.single(f"{field}.latency_ms", f"must be finite, > 0 and <= {MAX_LATENCY_MS:g}")
    kind = msg.WhichOneof("batch")
    at = f"{field}.{kind}"
    if kind == "composition":
        c = np.array(msg.composition.c, dtype=np.int64)
        u = np.array(msg.composition.u, dtype=np.int64)
        if len(c) != len(u):
            raise ValidationError.single(f"{at}.u", f"has {len(u)} entries, c has {len(c)}")
        if not 1 <= len(c) <= max_requests:
            raise ValidationError.single(f"{at}.c", f"must have 1..{max_requests} entries")
        if c.min() < 1 or c.max() > MAX_BATCH_TOKENS or int(c.sum()) > MAX_BATCH_TOKENS:
            raise ValidationError.single(f"{at}.c",
                                         f"every entry must be >= 1, all together <= {MAX_BATCH_TOKENS}")
        if u.min() < 0 or u.max() > MAX_TOKENS:
            raise ValidationError.single(f"{at}.u", f"every entry must be in [0, {MAX_TOKENS}]")
        x, scen = batch_features(c, u)
    elif kind == "features":
        x = np.array(msg.features.x, dtype=np.float64)
        if len(x) != N_FEATURES or not np.all((x >= 0) & (x <= MAX_FEATURE)):
            raise ValidationError.single(f"{at}.x", f"must be {N_FEATURES} numbers in [0, {MAX_FEATURE:.3g}]")
        s = int(msg.features.scenario)
        if s == pb.SCENARIO_UNSPECIFIED:
            scen = int(scenario_codes(np.array([x[3]]), np.array([x[5]]))[0])
        elif s in (pb.SCENARIO_DECODE, pb.SCENARIO_PREFILL, pb.SCENARIO_MIXED):
            scen = s - 1  # wire enums are offset by the UNSPECIFIED zero value
        else:
            raise ValidationError.single(f"{at}.scenario", f"unknown scenario {s}")
    else:
        raise ValidationError.single(f"{field}.batch", "set either composition or features")
    return profile, x, scen, float(lat)


# ---------------------------------------------------------------- policies
def describe_to_pb(d: Mapping[str, Any]) -> pb.PolicyInfo:
    """``registry.describe(name)`` → :class:`pb.PolicyInfo`."""
    info = pb.PolicyInfo(name=d["name"], version=d["version"], doc=d.get("doc", ""))
    for p in d.get("params", []):
        bounds: dict[str, Any] = {k: float(p[k]) for k in ("min", "max") if p.get(k) is not None}
        info.params.add(name=p["name"], type=str(p["type"]), default_value=param_text(p["default"]),
                        doc=p.get("doc", ""), choices=[param_text(c) for c in p.get("choices") or ()],
                        **bounds)
    return info


def predictor_sample_counts(p: BatchLatencyPredictor) -> dict[str, int]:
    """The per-scenario sample counts recorded in a predictor's meta (empty for bootstrap)."""
    samples = p.meta.get("samples", {}) if isinstance(p.meta, Mapping) else {}
    if not isinstance(samples, Mapping):
        return {}
    return {str(k): int(v) for k, v in samples.items() if isinstance(v, int | float)}
