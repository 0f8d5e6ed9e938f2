"""Fuzz the scheduling service with hostile input, over real loopback gRPC.

    .venv/bin/python -m benchmarks.fuzz_service [--cases 20000] [--seed 0] [--undecodable-share 0.25]

Starts one in-process :class:`SchedulerServer` with small limits and throws at it, in a
seeded mix: valid ``ScheduleRequest`` protobufs with hostile values (NaN/inf, int64
extremes, duplicate or empty ids, mismatched columns, too many requests, unknown policies,
bad parameters, unicode), random / truncated / bit-flipped bytes, oversized messages,
``ScheduleStream`` sequences with bad requests mid-stream, ``ReportIterations`` streams of
hostile reports, and hostile snapshot JSON for ``Snapshot.from_json`` and the CLI.  Prints
inputs tried, outcomes by status code and the server's RSS growth per phase; exits 1 on
any failure.

The *oracle* decodes and validates the same bytes in-process (``snapshot_from_pb``,
``registry.create``, the server's own predictor): a valid input must get exactly the
in-process plan (which must pass :func:`plan_violations`), an invalid one INVALID_ARGUMENT
naming exactly the violated fields, an oversized one RESOURCE_EXHAUSTED.  ``must_fail``
mutations must be rejected whatever the oracle says, so it cannot approve a hole in
validation; anything it raises besides ``ValidationError`` is a core bug.

Undecodable bytes are one more invalid request (``scheduler_service/server/handlers.py``):
INVALID_ARGUMENT naming the field ``request``, in a stream an error response after which
the stream goes on.  grpc's own decoding answered INTERNAL, leaked ~19 KB of server memory
per call and could leave a stream unreleased; the undecodable phase's RSS line shows that
this is gone.

A library as well (docs/development.md): ``tests/test_fuzz_service.py`` drives the
generators, the oracle and :class:`Target` from Hypothesis, ``benchmarks/fuzz_atheris.py``
from libFuzzer, so the test and the campaign judge alike.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import os
import random
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from clients.cli import main as cli_main
from scheduler_service.core import (
    Plan,
    Snapshot,
    ValidationError,
    default_predictor,
    plan_violations,
    registry,
)
from scheduler_service.core.snapshot import MAX_BATCH_TOKENS, MAX_SECONDS, MAX_TOKENS
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server import SchedulerServer, ServerConfig
from scheduler_service.wire.convert import plan_from_pb, report_from_pb, snapshot_from_pb, snapshot_to_pb
from scheduler_service.wire.profile import EngineProfile
from scheduler_service.wire.status import MAX_FIELD_BYTES, MAX_VIOLATIONS, clip

T = TypeVar("T")

#: Limits of the fuzzed server: small, so that "too many" and "too big" are cheap to reach.
MAX_REQUESTS = 32
MAX_MESSAGE = 64 * 1024
#: Engine profiles used by scheduling inputs; reports use disjoint ones, so a background
#: refit can never change the predictor an in-flight schedule oracle reads.
SCHEDULE_MODELS = ("", "fuzz-model", "模型-ü")
REPORT_MODELS = ("fuzz-report-0", "fuzz-report-1")
#: Reports that must all be rejected go to this profile: it must never get a state.
HOSTILE_MODEL = "fuzz-hostile"
METHOD = "/slidingserve.v1.SchedulerService/"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NAN, INF = float("nan"), float("inf")
FLOAT_MAX = sys.float_info.max
#: Snapshot request columns (``ids`` is ``id`` in the rows encoding).
_INT_COLS = ("prompt_tokens", "computed_tokens", "output_tokens")
_FLOAT_COLS = ("arrival", "ttft_slo", "tbt_slo")
_ALL_COLS = ("ids", *_FLOAT_COLS, *_INT_COLS, "protected")


class Rand(Protocol):
    """What the generators draw from: ``random.Random`` here, Hypothesis data in tests."""

    def randint(self, a: int, b: int) -> int: ...
    def choice(self, seq: Sequence[T]) -> T: ...
    def random(self) -> float: ...


Mutator = Callable[[pb.ScheduleRequest, Rand], None]


def fuzz_server(**overrides: Any) -> SchedulerServer:
    return SchedulerServer(ServerConfig(**{
        "host": "127.0.0.1", "port": 0, "log_level": "error", "grace_s": 1.0, "max_workers": 8,
        "max_requests_per_snapshot": MAX_REQUESTS, "max_message_bytes": MAX_MESSAGE,
        "refit_every": 16, "refit_window": 256, "refit_min_samples": 4, **overrides}))


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``) after a garbage collection
    and glibc's ``malloc_trim``, which returns what the allocator keeps in per-thread
    arenas: growth then means live memory (a leak), not which gRPC worker thread happened
    to serve the largest request."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ valid inputs
def _uniform(rnd: Rand, lo: float, hi: float) -> float:
    return lo + (hi - lo) * rnd.random()


def _ids(rnd: Rand, n: int) -> list[str]:
    make: Callable[[int], str] = {
        "plain": lambda i: f"r{i}",
        "unicode": lambda i: f"请求-{i}-🙂\u0301",
        "long": lambda i: f"{i:x}".rjust(256, "é"),  # 256 characters, 500+ bytes
        "mixed": lambda i: rnd.choice(["a", "ß", "\u200b", "x y", "\t"]) + str(i),
    }[rnd.choice(["plain", "unicode", "long", "mixed"])]
    return [make(i) for i in range(n)]


def valid_snapshot(rnd: Rand, *, max_n: int = 10) -> Snapshot:
    """A valid snapshot that still leans on the edges: one-token budgets, huge KV, clocks
    near the ±1e12 s bound, expired requests, empty queues."""
    n = rnd.randint(0, max_n)
    now = rnd.choice([100.0, 0.0, 1.7e9, -5e11, MAX_SECONDS - 10.0])
    max_prompt = rnd.choice([1, 16, 512, 4096])
    rows = []
    for _ in range(n):
        p = rnd.randint(1, max_prompt)
        kind = rnd.choice(["waiting", "prefilling", "decoding"])
        c = 0 if kind == "waiting" or p == 1 else rnd.randint(1, p - 1)
        o = 0
        if kind == "decoding":
            c, o = p, rnd.randint(1, rnd.choice([3, 1000, 1 << 30]))
        arrival = now - _uniform(rnd, 0.0, rnd.choice([0.01, 3.0, 100.0]))
        ttft = rnd.choice([_uniform(rnd, 0.001, 3.0), 1e-300, 1e9])
        rows.append((p, c, o, arrival, ttft, rnd.choice([_uniform(rnd, 0.0005, 0.3), 1e-300, 1e9])))
    columns: dict[str, Any] = {col: [row[k] for row in rows] for k, col in enumerate(_INT_COLS + _FLOAT_COLS)}
    return Snapshot.from_columns(
        now=now,
        max_batch_tokens=rnd.choice([1, rnd.randint(1, 64), 2048, MAX_BATCH_TOKENS]),
        max_num_seqs=rnd.choice([1, rnd.randint(1, 8), 256, MAX_TOKENS]),
        ids=_ids(rnd, n), protected=[rnd.random() < 0.2 for _ in range(n)],
        free_kv_tokens=rnd.choice([None, 0, rnd.randint(0, 64), MAX_TOKENS]),
        prefill_throughput=rnd.choice([None, _uniform(rnd, 100.0, 1e5), 1e-3, 1e12]),
        **columns,
    )


#: Parameter values that are valid and cheap.  Kept out of random draws, although valid:
#: slidingserve ``max_grid`` in the thousands with ``granularity`` 1 and ``window`` 4
#: (O(grid^2) chunker memory: 1.3 GB at 8k tokens, 16 GiB attempted at 64k) and qoserve
#: ``chunk_step`` 1 (a 2^20-entry Python list per decision at the largest budget).
SAFE_PARAMS: dict[str, list[dict[str, str]]] = {
    "slidingserve": [{"window": "1"}, {"window": "4", "granularity": "64"}, {"order": "edf"},
                     {"max_candidates": "1"}, {"batch_constructor": "false"}, {"margin": "10"},
                     {"alpha": "0"}, {"epsilon_s": "1e-9"}, {"tie_tolerance_ms": "0"}],
    "sarathi": [{"chunk_size": "1"}, {"chunk_size": "1048576"}, {"kv_decode_reserve": "1024"}],
    "qoserve": [{"min_chunk": "1", "chunk_step": "64"}, {"safety_factor": "0"}, {"hybrid_coef_s": "10"}],
}
#: Parameters that every policy must reject.
BAD_PARAMS: dict[str, list[dict[str, str]]] = {
    "slidingserve": [{"window": "0"}, {"window": "5"}, {"window": "two"}, {"window": "1.5"},
                     {"alpha": "nan"}, {"alpha": "inf"}, {"epsilon_s": "0"}, {"order": "random"},
                     {"batch_constructor": "maybe"}, {"window": "9" * 5000}, {"max_grid": "1"},
                     {"colour": "red"}, {"": ""}, {"k" * 30_000: "1"}],
    "sarathi": [{"chunk_size": "0"}, {"chunk_size": "-1"}, {"chunk_size": "1e400"}, {"chunk": "1"}],
    "qoserve": [{"safety_factor": "-0.1"}, {"min_chunk": ""}, {"hybrid_coef_s": "1e309"}],
}


def valid_request(rnd: Rand) -> pb.ScheduleRequest:
    snap = valid_snapshot(rnd)
    profile = EngineProfile(rnd.choice(SCHEDULE_MODELS), rnd.choice(["", "h100"]), rnd.choice([0, 1, 8]))
    msg = snapshot_to_pb(snap, profile=profile, engine_id=rnd.choice(["", "engine-7", "é" * 300]),
                         encoding=rnd.choice(["columns", "rows"]))
    if not len(snap) and rnd.random() < 0.5:
        msg.ClearField("requests")  # neither encoding set: an empty queue
    policy = rnd.choice(["", *registry.names()])
    req = pb.ScheduleRequest(request_id=rnd.choice(["", "q-1", "ü" * 64]), snapshot=msg, policy=policy)
    if policy in SAFE_PARAMS and rnd.random() < 0.3:
        req.params.update(rnd.choice(SAFE_PARAMS[policy]))
    return req


# --------------------------------------------------------------------- mutators
def _is_rows(s: pb.Snapshot) -> bool:
    return s.WhichOneof("requests") == "rows"


def _attr(col: str) -> str:
    """A column's field name in the rows encoding."""
    return "id" if col == "ids" else col


def _n(s: pb.Snapshot) -> int:
    """Rows every column has (columns may disagree after a length mutation)."""
    if _is_rows(s):
        return len(s.rows.requests)
    return min(len(getattr(s.columns, col)) for col in _ALL_COLS)


def _set(s: pb.Snapshot, col: str, i: int, v: Any) -> None:
    if _is_rows(s):
        setattr(s.rows.requests[i], _attr(col), v)
    else:
        getattr(s.columns, col)[i] = v


def _get(s: pb.Snapshot, col: str, i: int) -> Any:
    if _is_rows(s):
        return getattr(s.rows.requests[i], _attr(col))
    return getattr(s.columns, col)[i]


def _ensure(s: pb.Snapshot, k: int = 1) -> None:
    """At least ``k`` requests (adds valid waiting ones)."""
    while _n(s) < k:
        row = dict(ids=f"added-{_n(s)}", arrival=s.now, prompt_tokens=5, computed_tokens=0,
                   output_tokens=0, ttft_slo=1.0, tbt_slo=0.1, protected=False)
        if _is_rows(s):
            s.rows.requests.add(**{_attr(col): v for col, v in row.items()})
        else:
            for col, v in row.items():
                getattr(s.columns, col).append(v)


def _row(req: pb.ScheduleRequest, rnd: Rand, k: int = 1) -> tuple[pb.Snapshot, int]:
    """The request's snapshot, grown to at least ``k`` requests, and a random row of it."""
    _ensure(req.snapshot, k)
    return req.snapshot, rnd.randint(0, _n(req.snapshot) - 1)


def _to_columns(s: pb.Snapshot) -> None:
    if not _is_rows(s):
        return
    rows = list(s.rows.requests)
    s.columns.SetInParent()  # switches the oneof
    for col in _ALL_COLS:
        getattr(s.columns, col).extend(getattr(r, _attr(col)) for r in rows)


def _cells(bad: dict[str, list[Any]]) -> Mutator:
    """Sets one cell, of a random row and a column drawn from ``bad``, to one of that
    column's values (a callable value gets the row's prompt length)."""

    def mutate(req: pb.ScheduleRequest, rnd: Rand) -> None:
        s, i = _row(req, rnd)
        col = rnd.choice(list(bad))
        v = rnd.choice(bad[col])
        _set(s, col, i, v(_get(s, "prompt_tokens", i)) if callable(v) else v)

    return mutate


def _fields_of(part: Callable[[pb.ScheduleRequest], Message], bad: dict[str, list[Any]]) -> Mutator:
    """Sets one field, drawn from ``bad``, of ``part(request)`` to one of its values."""

    def mutate(req: pb.ScheduleRequest, rnd: Rand) -> None:
        name = rnd.choice(list(bad))
        setattr(part(req), name, rnd.choice(bad[name]))

    return mutate


def m_state(req: pb.ScheduleRequest, rnd: Rand) -> None:
    """Inconsistent lengths: output before the prompt is done, or a decode without output."""
    s, i = _row(req, rnd)
    p = _get(s, "prompt_tokens", i)
    if rnd.random() < 0.5 or p <= 1:  # (an earlier mutation may have made p absurd)
        _set(s, "computed_tokens", i, p)
        _set(s, "output_tokens", i, 0)
    else:
        _set(s, "computed_tokens", i, rnd.randint(0, min(p - 1, 1 << 40)))
        _set(s, "output_tokens", i, rnd.randint(1, 10))


def m_duplicate_id(req: pb.ScheduleRequest, rnd: Rand) -> None:
    s, i = _row(req, rnd, 2)
    j = rnd.choice([k for k in range(_n(s)) if k != i])
    _set(s, "ids", j, _get(s, "ids", i))


def m_column_length(req: pb.ScheduleRequest, rnd: Rand) -> None:
    s = req.snapshot
    _to_columns(s)
    if len({len(getattr(s.columns, c)) for c in _ALL_COLS}) > 1:
        return  # already mismatched (a second change could undo the first)
    col = rnd.choice(_ALL_COLS)
    values = getattr(s.columns, col)
    if len(values) and rnd.random() < 0.5:
        del values[rnd.randint(0, len(values) - 1)]
    else:
        values.append({"ids": "extra", "protected": True}.get(col, 1 if col in _INT_COLS else 1.0))


def m_bad_param(req: pb.ScheduleRequest, rnd: Rand) -> None:
    req.policy = rnd.choice(list(BAD_PARAMS))
    req.params.clear()
    req.params.update(rnd.choice(BAD_PARAMS[req.policy]))


def m_random_value(req: pb.ScheduleRequest, rnd: Rand) -> None:
    """Any value of the field's type, valid or not: the oracle decides."""
    s, i = _row(req, rnd)
    col = rnd.choice(_ALL_COLS)
    if col == "ids":
        v: Any = rnd.choice(["", "r0", "new", "\x00", "\U0010ffff", "a" * rnd.randint(0, 300)])
    elif col == "protected":
        v = rnd.random() < 0.5
    elif col in _INT_COLS:
        v = rnd.choice([rnd.randint(INT64_MIN, INT64_MAX), rnd.randint(-3, 3), rnd.randint(0, 5000)])
    else:
        v = rnd.choice([_uniform(rnd, -1e12, 1e12), rnd.random(), -rnd.random(), 5e-324, -0.0])
    _set(s, col, i, v)


_BAD_SLO = [0.0, -0.0, -1e-300, -5.0, MAX_SECONDS * 2, FLOAT_MAX]
_BAD_NAME = ["a|b", "|", "m" * 257]
#: (name, mutator, must_fail): every one of these makes a request invalid.
MUTATORS: list[tuple[str, Mutator, bool]] = [
    ("nonfinite", _cells({c: [NAN, INF, -INF, -NAN] for c in _FLOAT_COLS}), True),
    ("float-range", _cells({"arrival": [sign * v for sign in (1.0, -1.0)
                                        for v in (MAX_SECONDS * 1.0000001, 1e300, FLOAT_MAX)],
                            "ttft_slo": _BAD_SLO, "tbt_slo": _BAD_SLO}), True),
    ("int-extreme", _cells({
        "prompt_tokens": [0, -1, INT64_MIN, MAX_TOKENS + 1, INT64_MAX],
        "computed_tokens": [-1, INT64_MIN, lambda p: p + 1 if p < INT64_MAX else -1, INT64_MAX],
        "output_tokens": [-1, INT64_MIN, MAX_TOKENS + 1, INT64_MAX],
    }), True),
    ("state", m_state, True),
    ("duplicate-id", m_duplicate_id, True),
    ("bad-id", _cells({"ids": ["", "x" * 257, "🙂" * 300]}), True),
    ("column-length", m_column_length, True),
    ("scalar", _fields_of(lambda req: req.snapshot, {
        "now": [NAN, INF, -INF, MAX_SECONDS * 2, -FLOAT_MAX],
        "max_batch_tokens": [0, -1, INT64_MIN, MAX_BATCH_TOKENS + 1, INT64_MAX],
        "max_num_seqs": [0, -5, INT64_MIN, MAX_TOKENS + 1, INT64_MAX],
        "free_kv_tokens": [-1, INT64_MIN, MAX_TOKENS + 1, INT64_MAX],
        "prefill_throughput": [0.0, -1.0, NAN, INF, -INF, 1e-4, 5e-324, 1.0000001e12, 1e300],
    }), True),
    ("too-many", lambda req, rnd: _ensure(req.snapshot, MAX_REQUESTS + rnd.randint(1, 40)), True),
    ("bad-profile", _fields_of(lambda req: req.snapshot.engine_profile, {
        "model": _BAD_NAME, "hardware": _BAD_NAME, "tensor_parallel": [4097, 2**32 - 1]}), True),
    ("unknown-policy", _fields_of(lambda req: req, {
        "policy": ["nope", "SLIDINGSERVE", " slidingserve", "sarathi\x00", "p" * 20_000, "策略"]}), True),
    ("bad-param", m_bad_param, True),
]
#: Mutations that may or may not leave the request valid (no must_fail).
NEUTRAL_MUTATORS: list[tuple[str, Mutator, bool]] = [("random-value", m_random_value, False)]


def hostile_request(rnd: Rand) -> tuple[pb.ScheduleRequest, list[str], bool]:
    """A valid request with 0-2 mutations of any kind, then (usually) one must-fail
    mutation last, so that no later mutation can undo it: (request, names, must_fail)."""
    req = valid_request(rnd)
    pools = [MUTATORS + NEUTRAL_MUTATORS] * rnd.choice([0, 0, 1, 2])
    must_fail = rnd.random() < 0.8
    names = []
    for pool in pools + ([MUTATORS] if must_fail else []):
        name, fn, _ = rnd.choice(pool)
        fn(req, rnd)
        names.append(name)
    return req, names, must_fail


# ----------------------------------------------------------------- byte mutators
#: Suffixes that make a valid message invalid on the wire.
_BAD_SUFFIX = {
    "unknown-field": bytes([0xF8, 0x06, 0x01]),  # field 111, varint 1
    "bad-utf8": b"\x0a\x02\xc3\x28",  # request_id with invalid UTF-8
    "wrong-wire-type": b"\x1d\x00\x00\x00\x00",  # policy (field 3) as fixed32
    "huge-length": b"\x12\xff\xff\xff\xff\x0f",  # snapshot with a 4 GiB length prefix
}


def _junk(rnd: Rand, lo: int, hi: int) -> bytes:
    return bytes(rnd.randint(0, 255) for _ in range(rnd.randint(lo, hi)))


def hostile_bytes(rnd: Rand) -> tuple[bytes, str]:
    """Raw bytes for ScheduleRequest: (bytes, how they were made)."""
    base = hostile_request(rnd)[0].SerializeToString()
    how = rnd.choice(["random", "truncate", "bitflip", "insert", "both-encodings", "repeat", *_BAD_SUFFIX])
    if how == "random":
        return _junk(rnd, 0, 64), how
    if how == "truncate":
        return base[: rnd.randint(0, max(0, len(base) - 1))], how
    if how == "bitflip":
        b = bytearray(base or b"\x00")
        for _ in range(rnd.randint(1, 8)):
            b[rnd.randint(0, len(b) - 1)] ^= 1 << rnd.randint(0, 7)
        return bytes(b), how
    if how == "insert":
        k = rnd.randint(0, len(base))
        return base[:k] + _junk(rnd, 1, 8) + base[k:], how
    if how == "both-encodings":
        # Snapshot.columns then Snapshot.rows in one message: the oneof's last one wins.
        other = valid_request(rnd)
        other.snapshot.CopyFrom(pb.Snapshot(rows=snapshot_to_pb(valid_snapshot(rnd), encoding="rows").rows))
        return base + other.SerializeToString(), how
    if how == "repeat":
        return base + base, how  # repeated fields concatenate: every id twice
    return base + _BAD_SUFFIX[how], how


# ----------------------------------------------------------------------- oracle
@dataclass(frozen=True)
class Expected:
    """What the server must answer: ``kind`` is OK (with ``plan`` and ``snapshot``),
    INVALID_ARGUMENT (with the violated ``fields``), RESOURCE_EXHAUSTED, or CRASH (the
    policy raised on a valid snapshot, which the server answers INTERNAL: a core bug);
    ``request_id`` the id a response must echo ("" for bytes that do not decode)."""

    kind: str
    fields: tuple[str, ...] = ()
    plan: Plan | None = None
    snapshot: Snapshot | None = None
    request_id: str = ""


class FuzzFailure(AssertionError):
    pass


def expect_decoded(server: SchedulerServer, req: pb.ScheduleRequest) -> Expected:
    """The server's decision path, in-process (``SchedulerServicer._decide``)."""
    cfg = server.config
    assert server.predictors is not None
    try:
        snap, profile = snapshot_from_pb(req.snapshot, max_requests=cfg.max_requests_per_snapshot)
        policy = registry.create(req.policy or cfg.default_policy, dict(req.params) or None)
    except ValidationError as e:
        return Expected("INVALID_ARGUMENT", tuple(clip(v.field, MAX_FIELD_BYTES)
                                                  for v in e.violations[:MAX_VIOLATIONS]))
    try:
        plan = policy.plan(snap, server.predictors.current(profile.key))
    except Exception as e:
        return Expected("CRASH", (f"{type(e).__name__}: {e}",), snapshot=snap)
    return Expected("OK", plan=plan, snapshot=snap)


def expect_bytes(server: SchedulerServer, raw: bytes) -> Expected:
    if len(raw) > server.config.max_message_bytes:
        return Expected("RESOURCE_EXHAUSTED")
    try:
        req = pb.ScheduleRequest.FromString(raw)
    except DecodeError:
        return Expected("INVALID_ARGUMENT", ("request",))
    return replace(expect_decoded(server, req), request_id=req.request_id)


def _details(err: grpc.RpcError | None) -> str:
    return (err.details() or "") if isinstance(err, grpc.Call) else ""


def _bad_request_fields(err: grpc.RpcError) -> tuple[str, ...] | None:
    """Field paths of the error's google.rpc.BadRequest detail, or None without one."""
    status = rpc_status.from_call(err) if isinstance(err, grpc.Call) else None
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return tuple(v.field for v in bad.field_violations)
    return None


# ----------------------------------------------------------------- the target
@dataclass
class Tally:
    """Inputs tried and outcomes, by category and status code."""

    inputs: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def count(self, category: str, outcome: str, n: int = 1) -> None:
        self.inputs[category] += n
        self.outcomes[(category, outcome)] += n

    @property
    def total(self) -> int:
        return sum(self.inputs.values())


class Target(contextlib.AbstractContextManager["Target"]):
    """A channel to the fuzzed server with identity (bytes) serializers, so that any
    bytes can be sent, plus the checks of every RPC against the oracle."""

    def __init__(self, server: SchedulerServer, tally: Tally | None = None, timeout_s: float = 30.0) -> None:
        self.server = server
        self.tally = tally or Tally()
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(server.target)
        self._unary = self.channel.unary_unary(METHOD + "Schedule")
        self._stream = self.channel.stream_stream(METHOD + "ScheduleStream")
        self._report = self.channel.stream_unary(METHOD + "ReportIterations")
        self.stub = pb_grpc.SchedulerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schedule(self, raw: bytes, category: str = "schedule", *, must_fail: bool = False,
                 what: str = "") -> str:
        """Send ``raw`` to Schedule; check the answer; return the status code name."""
        want = expect_bytes(self.server, raw)
        try:
            resp: bytes | None = self._unary(raw, timeout=self.timeout_s)
            code, err = "OK", None
        except grpc.RpcError as e:
            resp, code, err = None, e.code().name, e
        self.tally.count(category, code)
        ctx = f"{category} {what}: want {want.kind} {want.fields}, got {code}"
        if must_fail and code == "OK":
            self._fail(f"{ctx}: a must-fail mutation was accepted", raw)
        if want.kind == "CRASH":
            self._fail(f"{ctx}: the policy raised on a valid snapshot", raw)
        elif want.kind == "OK":
            if resp is None:
                self._fail(f"{ctx} ({_details(err)})", raw)
            else:
                self._check_response(pb.ScheduleResponse.FromString(resp), want, ctx, raw)
        elif want.kind == "INVALID_ARGUMENT":
            got = _bad_request_fields(err) if err is not None and code == want.kind else None
            if got != want.fields:
                self._fail(f"{ctx}; fields {got} ({_details(err)})", raw)
            elif "Traceback" in _details(err):
                self._fail(f"{ctx}: traceback in the message", raw)
        elif code != want.kind:
            self._fail(ctx, raw)
        return code

    def _check_response(self, resp: pb.ScheduleResponse, want: Expected, ctx: str, raw: bytes) -> str:
        """One response (unary, or in a stream) to ``raw``: the echoed id, then the oracle's
        plan or an INVALID_ARGUMENT error naming its fields.  Returns the tally label."""
        if resp.request_id != want.request_id:
            self._fail(f"{ctx}: request_id {resp.request_id!r} != {want.request_id!r}", raw)
        if want.kind != "OK":
            fields = tuple(v.field for v in resp.error.field_violations)
            if resp.HasField("plan") or resp.error.code != grpc.StatusCode.INVALID_ARGUMENT.value[0] \
                    or fields != want.fields:
                self._fail(f"{ctx}: got error {resp.error.code} {fields}", raw)
            return "INVALID_ARGUMENT (in stream)"
        assert want.plan is not None and want.snapshot is not None
        if resp.HasField("error"):
            self._fail(f"{ctx}: error {resp.error.code} {resp.error.message}", raw)
            return "OK"
        plan = plan_from_pb(resp.plan)
        if plan.decision_key() != want.plan.decision_key():
            self._fail(f"{ctx}: plan differs from the in-process plan", raw)
        if problems := plan_violations(want.snapshot, plan):
            self._fail(f"{ctx}: invalid plan {problems}", raw)
        return "OK"

    def stream(self, raws: Sequence[bytes], category: str = "stream") -> list[str]:
        """Send ``raws`` on one ScheduleStream.  Each message before an oversized one gets
        a response in order (plan or error, undecodable bytes too, never the end of the
        stream); an oversized one ends the stream RESOURCE_EXHAUSTED.  Returns one label
        per response, then one for the end of the stream if it failed."""
        wants = [expect_bytes(self.server, r) for r in raws]
        kinds = [w.kind for w in wants]
        upto = kinds.index("RESOURCE_EXHAUSTED") if "RESOURCE_EXHAUSTED" in kinds else len(raws)
        want_end = "OK" if upto == len(raws) else "RESOURCE_EXHAUSTED"
        got: list[pb.ScheduleResponse] = []
        end_code, end_detail = "OK", ""
        try:
            for r in self._stream(iter(raws), timeout=self.timeout_s):
                got.append(pb.ScheduleResponse.FromString(r))
        except grpc.RpcError as e:
            end_code, end_detail = e.code().name, _details(e)
        blob = b"".join(raws)
        if end_code != want_end:
            self._fail(f"{category}: stream ended {end_code} ({end_detail}), want {want_end}", blob)
        if len(got) > upto or (want_end == "OK" and len(got) < upto):
            self._fail(f"{category}: {len(got)} responses to {upto} requests before the end", blob)
        labels = []
        for i, (want, resp) in enumerate(zip(wants[:upto], got, strict=False)):
            ctx = f"{category}[{i}]: want {want.kind} {want.fields}"
            if want.kind == "CRASH":
                self._fail(f"{ctx}: the policy raised on a valid snapshot", raws[i])
            labels.append(self._check_response(resp, want, ctx, raws[i]))
        if want_end != "OK":
            labels.append(f"{end_code} (stream ended)")
        for label in labels:
            self.tally.count(category, label)
        return labels

    def report(self, reports: Sequence[tuple[pb.IterationReport, bool]],
               category: str = "report") -> pb.ReportSummary:
        """Send reports (each with its must_fail flag); the summary must count exactly
        the oracle's accepted/rejected and quote the first rejection reasons."""
        reasons = []
        limit = self.server.config.max_requests_per_snapshot
        for i, (msg, must_fail) in enumerate(reports):
            try:
                report_from_pb(msg, max_requests=limit, field=f"report[{i}]")
            except ValidationError as e:
                reasons.append(str(e))
                continue
            if must_fail:
                self._fail(f"{category}[{i}]: a must-fail report validates in-process",
                           msg.SerializeToString())
        raws = [m.SerializeToString() for m, _ in reports]
        summary = pb.ReportSummary.FromString(self._report(iter(raws), timeout=self.timeout_s))
        want = (len(reports) - len(reasons), len(reasons))
        if (summary.accepted, summary.rejected) != want or list(summary.rejection_reasons) != reasons[:10]:
            self._fail(f"{category}: summary {summary.accepted}/{summary.rejected} "
                       f"{list(summary.rejection_reasons)[:2]}, want {want[0]}/{want[1]} {reasons[:2]}",
                       b"".join(raws))
        self.tally.count(category, "accepted", summary.accepted)
        self.tally.count(category, "rejected", summary.rejected)
        return summary

    def assert_healthy(self) -> None:
        """Health SERVING and a known-good request gets a valid plan."""
        for name in ("", "slidingserve.v1.SchedulerService"):
            st = self.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=self.timeout_s)
            if st.status != health_pb2.HealthCheckResponse.SERVING:
                raise FuzzFailure(f"health {name!r} is {st.status}")
        before = len(self.tally.failures)
        self.schedule(valid_request(random.Random(7)).SerializeToString(), "liveness")
        if len(self.tally.failures) > before:
            raise FuzzFailure(self.tally.failures[-1])

    def _fail(self, message: str, raw: bytes) -> None:
        self.tally.failures.append(f"{message} [input {raw[:200].hex()}{'...' if len(raw) > 200 else ''}]")


# ---------------------------------------------------------------- oversized
def oversized_request(rnd: Rand, limit: int = MAX_MESSAGE) -> bytes:
    """A decodable request just over ``limit`` bytes (a long engine_id or many requests)."""
    req = valid_request(rnd)
    if rnd.random() < 0.5:
        req.snapshot.engine_id = "e" * (limit + rnd.randint(1, limit))
    else:
        _to_columns(req.snapshot)
        missing = limit - req.ByteSize() + 1
        req.snapshot.columns.ids.extend(f"big-{i:06d}-{'x' * 200}" for i in range(missing // 200 + 1))
    return req.SerializeToString()


# ------------------------------------------------------------------- reports
def valid_report(rnd: Rand, model: str) -> pb.IterationReport:
    msg = pb.IterationReport(engine_profile=pb.EngineProfile(model=model),
                             latency_ms=_uniform(rnd, 1.0, 200.0))
    if rnd.random() < 0.7:
        n = rnd.randint(1, 8)
        msg.composition.c.extend(rnd.choice([1, rnd.randint(1, 512)]) for _ in range(n))
        msg.composition.u.extend(rnd.randint(0, 4096) for _ in range(n))
    else:
        msg.features.x.extend(rnd.randint(0, 10**6) * 1.0 for _ in range(7))
        msg.features.scenario = pb.Scenario.ValueType(rnd.choice([0, 1, 2, 3]))
    return msg


def hostile_report(rnd: Rand) -> pb.IterationReport:
    """A report that must be rejected (profile HOSTILE_MODEL unless the profile is the flaw)."""
    msg = valid_report(rnd, HOSTILE_MODEL)
    what = rnd.choice(["latency", "lengths", "empty", "c", "u", "sum", "too-many", "x-len", "x-value",
                       "scenario", "no-batch", "profile"])
    if what == "latency":
        msg.latency_ms = rnd.choice([NAN, INF, -INF, 0.0, -1.0, 600_000.5, FLOAT_MAX])
    elif what == "no-batch":
        msg.ClearField("batch")
    elif what == "profile":
        msg.engine_profile.model = rnd.choice(["a|b", "m" * 257])
    elif what in ("x-len", "x-value", "scenario"):
        x = [1.0] * (rnd.choice([0, 1, 6, 8, 100]) if what == "x-len" else 7)
        if what == "x-value":
            x[rnd.randint(0, 6)] = rnd.choice([NAN, INF, -INF, -1.0, -5e-324, 2.0**62, FLOAT_MAX])
        scenario = rnd.choice([4, 99, -1, 2**31 - 1]) if what == "scenario" else 0  # an open enum
        msg.features.CopyFrom(pb.BatchFeatures(x=x, scenario=pb.Scenario.ValueType(scenario)))
    else:
        n = rnd.randint(1, 4)
        bad_c = [0, -1, INT64_MIN, MAX_BATCH_TOKENS + 1, INT64_MAX]
        c, u = {  # (c, u) of a batch of n requests with one computed token each, then the flaw
            "lengths": lambda: ([1] * n, [0] * (n + 1)),
            "empty": lambda: ([], []),
            "c": lambda: ([rnd.choice(bad_c)] + [1] * (n - 1), [0] * n),
            "u": lambda: ([1] * n, [rnd.choice([-1, INT64_MIN, MAX_TOKENS + 1, INT64_MAX])] + [0] * (n - 1)),
            "sum": lambda: ([MAX_BATCH_TOKENS // n + 1] * n, [0] * n),
            "too-many": lambda: ([1] * (MAX_REQUESTS + 1), [0] * (MAX_REQUESTS + 1)),
        }[what]()
        msg.composition.CopyFrom(pb.BatchComposition(c=c, u=u))
    return msg


# ---------------------------------------------------------------------- JSON
_JSON_SCALARS = ["now", "max_batch_tokens", "max_num_seqs", "free_kv_tokens", "prefill_throughput"]


def _mutate_json_doc(d: Any, how: str, rnd: Rand) -> Any:
    """``hostile_json``'s changes to the parsed document; returns the new document."""
    requests = d["requests"]
    if how == "type":  # may stay valid (1.5 for a time, None for an optional field)
        where = rnd.choice(requests) if requests and rnd.random() < 0.7 else d
        key = rnd.choice(sorted(where)) if where is not d else rnd.choice(_JSON_SCALARS)
        where[key] = rnd.choice(["1", None, [], {}, True, 1.5, 10**30, -1, "NaN"])
    elif how == "missing":
        if requests and rnd.random() < 0.5:
            del requests[0][rnd.choice(["id", "arrival", "prompt_tokens", "ttft_slo", "tbt_slo"])]
        else:
            del d[rnd.choice(["now", "max_batch_tokens", "max_num_seqs", "requests"])]
    elif how == "unknown":
        where = requests[0] if requests and rnd.random() < 0.5 else d
        where[rnd.choice(["colour", "Now", "a\nb", "", "🙂" * 50])] = 1
    elif how == "top":
        return rnd.choice([[], 1, "snapshot", None, True, [d]])
    elif how == "requests":
        d["requests"] = rnd.choice([{}, "r", 5, None, [1], [[]], [None], [{"id": "only"}],
                                    [{"id": f"x{i}"} for i in range(3)]])
    elif how == "nonfinite":
        where = requests[0] if requests else d
        key = rnd.choice(["arrival", "ttft_slo", "tbt_slo"]) if where is not d else "now"
        where[key] = rnd.choice([NAN, INF, -INF])
    elif how == "huge-int":  # beyond float range for times, beyond int64 for counts
        key = rnd.choice(["max_batch_tokens", "max_num_seqs", "free_kv_tokens", "now", "prefill_throughput"])
        ints = key not in ("now", "prefill_throughput")
        d[key] = rnd.choice([10**400, -(10**400), *([2**64, -(2**63) - 1] if ints else [])])
    return d


def _mutate_json_text(raw: bytes, how: str, rnd: Rand) -> bytes:
    """``hostile_json``'s changes to the encoded text."""
    if how == "text-truncate":
        return raw[: rnd.randint(0, max(0, len(raw) - 1))]
    if how == "text-junk":  # may stay valid: junk inside a string
        k = rnd.randint(0, len(raw))
        return raw[:k] + rnd.choice([b"}", b",", b"\x00", b"[", b"\"", b"]]", b"#"]) + raw[k:]
    if how == "deep":
        depth = rnd.choice([100, 5000, 100_000])
        return raw[:-1] + b', "requests": ' + b"[" * depth + b"]" * depth + b"}" if raw.endswith(b"}") \
            else raw
    if how == "bad-utf8":
        return raw.replace(b'"r', b'"\xff\xfer', 1) if b'"r' in raw else b"\xff" + raw
    if how == "big-int-literal":
        return raw.replace(b'"now": ', b'"now": ' + b"9" * 5000 + b', "x": ', 1) if b'"now": ' in raw \
            else b"9" * 5000
    if how == "duplicate-key":
        return raw[:-1] + b', "now": "later"}' if raw.endswith(b"}") else raw + b"{"
    return raw


def hostile_json(rnd: Rand) -> tuple[bytes, bool]:
    """Snapshot JSON text (as bytes) and whether it must be rejected."""
    d: Any = valid_snapshot(rnd, max_n=4).to_dict()
    if d["requests"] and rnd.random() < 0.5:
        d["requests"][0]["id"] = rnd.choice(["r-ü", "x\ny", "🙂"])
    how = rnd.choice(["none", "type", "missing", "unknown", "top", "requests", "nonfinite", "huge-int",
                      "text-truncate", "text-junk", "deep", "bad-utf8", "big-int-literal", "duplicate-key"])
    text = json.dumps(_mutate_json_doc(d, how, rnd), allow_nan=True, ensure_ascii=rnd.random() < 0.5)
    return _mutate_json_text(text.encode(), how, rnd), how not in ("none", "type", "text-junk")


def check_json(raw: bytes, must_fail: bool, tally: Tally, *, cli: bool = False,
               tmpdir: Path | None = None) -> str:
    """``Snapshot.from_json`` returns a valid snapshot (whose plan passes plan_violations)
    or raises ValidationError; with ``cli`` also ``slidingserve plan --snapshot FILE``:
    exit 0 with a plan, or exit 2 with one line on stderr and no traceback."""
    try:
        snap: Snapshot | None = Snapshot.from_json(raw)
        outcome = "valid"
    except ValidationError:
        snap, outcome = None, "ValidationError"
    except Exception as e:
        tally.failures.append(f"json: from_json raised {type(e).__name__}: {str(e)[:200]} "
                              f"[input {raw[:200]!r}]")
        tally.count("json", f"CRASH {type(e).__name__}")
        return "crash"
    if snap is not None:
        if must_fail:
            tally.failures.append(f"json: must-fail input accepted [input {raw[:300]!r}]")
        plan = registry.create("slidingserve").plan(snap, default_predictor())
        if problems := plan_violations(snap, plan):
            tally.failures.append(f"json: invalid plan {problems} [input {raw[:200]!r}]")
    tally.count("json", outcome)
    if cli:
        assert tmpdir is not None
        _check_cli(raw, snap is not None, tally, tmpdir)
    return outcome


def _check_cli(raw: bytes, valid: bool, tally: Tally, tmpdir: Path) -> None:
    path = tmpdir / "snapshot.json"
    path.write_bytes(raw)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["plan", "--snapshot", str(path)])
    text = err.getvalue()
    try:  # only on plain UTF-8 (no BOM) must the CLI and from_json agree
        raw.decode("utf-8")
        plain = not raw.startswith(b"\xef\xbb\xbf")
    except UnicodeDecodeError:
        plain = False
    if code == 0:
        ok = (valid or not plain) and "allocations" in json.loads(out.getvalue())
    else:
        ok = code == 2 and text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text \
            and (not valid or not plain)
    tally.count("cli", f"exit {code}")
    if not ok:
        tally.failures.append(f"cli: exit {code}, stderr {text[:300]!r}, from_json valid={valid} "
                              f"[input {raw[:200]!r}]")


# ------------------------------------------------------------------ campaign
#: Phase 1: every input decodes (or is oversized), so the server's RSS must stay flat.
DECODABLE: list[tuple[str, float]] = [
    ("schedule", 0.46), ("stream", 0.12), ("oversize", 0.01), ("report", 0.12), ("json", 0.25),
    ("cli", 0.04),
]
#: Phase 2: undecodable bytes, alone and anywhere in a stream (first message included).
UNDECODABLE: list[tuple[str, float]] = [("bytes", 0.8), ("stream-bytes", 0.2)]


def run_one(target: Target, rnd: random.Random, category: str, tmpdir: Path) -> None:
    if category == "schedule":
        req, names, must_fail = hostile_request(rnd)
        target.schedule(req.SerializeToString(), "schedule", must_fail=must_fail, what=",".join(names))
    elif category == "bytes":
        raw, how = hostile_bytes(rnd)
        target.schedule(raw, "bytes", what=how)
    elif category == "oversize":
        target.schedule(oversized_request(rnd), "oversize")
    elif category in ("stream", "stream-bytes"):
        msgs = [hostile_request(rnd)[0].SerializeToString() for _ in range(rnd.randint(1, 6))]
        if category == "stream-bytes":
            msgs.insert(rnd.randint(0, len(msgs)), hostile_bytes(rnd)[0])
        target.stream(msgs, category)
    elif category == "report":
        reports = [(hostile_report(rnd), True) if rnd.random() < 0.7
                   else (valid_report(rnd, rnd.choice(REPORT_MODELS)), False)
                   for _ in range(rnd.randint(1, 12))]
        target.report(reports)
    elif category in ("json", "cli"):
        raw, must_fail = hostile_json(rnd)
        check_json(raw, must_fail, target.tally, cli=category == "cli", tmpdir=tmpdir)


def hostile_profile_untouched(target: Target) -> list[str]:
    """Hostile-only reports left no trace: no state, bootstrap predictor, same plans."""
    server = target.server
    assert server.predictors is not None
    problems = []
    key = EngineProfile(HOSTILE_MODEL).key
    if server.predictors.state(key) is not None:
        problems.append(f"profile {key} got a state from rejected reports")
    profile = pb.EngineProfile(model=HOSTILE_MODEL)
    info = target.stub.GetPredictor(pb.GetPredictorRequest(engine_profile=profile), timeout=target.timeout_s)
    if info.version != server.predictors.bootstrap.version or info.reports_accepted:
        problems.append(f"GetPredictor({HOSTILE_MODEL}) = {info.version}, {info.reports_accepted} accepted")
    req = valid_request(random.Random(11))
    req.snapshot.engine_profile.CopyFrom(profile)
    resp = target.stub.Schedule(req, timeout=target.timeout_s)
    want = expect_decoded(server, req)
    if want.plan is None or plan_from_pb(resp.plan).decision_key() != want.plan.decision_key() \
            or resp.plan.predictor_version != server.predictors.bootstrap.version:
        problems.append("a plan for the hostile-report profile is not the bootstrap predictor's plan")
    return problems


@dataclass
class PhaseResult:
    name: str
    cases: int
    inputs: int
    seconds: float
    rss_growth: int  # bytes


def run_phase(target: Target, rnd: random.Random, name: str, mix: list[tuple[str, float]], cases: int,
              tmpdir: Path, out: Callable[[str], None]) -> PhaseResult:
    """``cases`` draws from ``mix`` after a 1000-case warm-up; RSS measured around them."""
    names, weights = [c for c, _ in mix], [w for _, w in mix]
    for _ in range(1000):  # first-call costs, caches, allocator arenas, grpc buffers
        run_one(target, rnd, rnd.choices(names, weights)[0], tmpdir)
    n0, rss0, t0 = target.tally.total, rss_bytes(), time.perf_counter()
    for i in range(1, cases + 1):
        run_one(target, rnd, rnd.choices(names, weights)[0], tmpdir)
        if i % 2000 == 0:
            target.assert_healthy()
            out(f"  {name}: {i} cases, {len(target.tally.failures)} failures, "
                f"RSS {rss_bytes() / 2**20:.1f} MiB, {time.perf_counter() - t0:.0f} s")
    return PhaseResult(name, cases, target.tally.total - n0, time.perf_counter() - t0, rss_bytes() - rss0)


def stop_within(server: SchedulerServer, seconds: float) -> bool:
    """Stop the server on a helper thread; False when it is still stopping after ``seconds``
    (``stop()`` waits for any RPC left behind)."""
    done = threading.Event()

    def stop() -> None:
        server.stop()
        done.set()  # not when stop() raises

    threading.Thread(target=stop, daemon=True).start()
    return done.wait(seconds)


def campaign(cases: int, seed: int, *, undecodable_share: float = 0.25,
             out: Callable[[str], None] = print) -> tuple[Tally, list[PhaseResult], bool]:
    """Phase 1 (decodable) then phase 2 (undecodable); returns the tally, the phases and
    whether the server stopped within 10 s."""
    tally = Tally()
    rnd = random.Random(seed)
    n2 = round(cases * undecodable_share)
    server = fuzz_server().start()
    with Target(server, tally) as target, tempfile.TemporaryDirectory() as tmp:
        phases = [run_phase(target, rnd, "decodable", DECODABLE, cases - n2, Path(tmp), out)]
        assert server.predictors is not None
        server.predictors.wait_idle()
        tally.failures.extend(hostile_profile_untouched(target))
        if n2:
            phases.append(run_phase(target, rnd, "undecodable", UNDECODABLE, n2, Path(tmp), out))
        target.assert_healthy()
    stopped = stop_within(server, 10.0)
    out(f"\ninputs tried: {tally.total} (messages and JSON documents, incl. 2 x 1000 warm-up cases)")
    out(f"{'category':13s} {'inputs':>7s}  outcomes")
    for cat, _ in DECODABLE + UNDECODABLE:
        outs = ", ".join(f"{o} {n}" for (c, o), n in sorted(tally.outcomes.items()) if c == cat)
        out(f"{cat:13s} {tally.inputs[cat]:7d}  {outs}")
    for ph in phases:
        out(f"phase {ph.name}: {ph.cases} cases, {ph.inputs} inputs in {ph.seconds:.1f} s; server RSS growth "
            f"{ph.rss_growth / 2**20:+.1f} MiB ({ph.rss_growth / max(ph.inputs, 1) / 1024:+.2f} KiB/input)")
    out(f"server stopped within 10 s: {stopped}")
    return tally, phases, stopped


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--cases", type=int, default=20_000, help="fuzz cases (one to a dozen inputs each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--undecodable-share", type=float, default=0.25,
                    help="share of cases in the undecodable-bytes phase (0 skips it)")
    ap.add_argument("--max-growth-kib-per-input", type=float, default=1.0,
                    help="RSS growth per input allowed in each phase (allocator noise is ~0.1)")
    ap.add_argument("--allow-warnings", action="store_true",
                    help="do not turn numpy RuntimeWarnings (overflow on valid input) into failures")
    args = ap.parse_args(argv)
    with warnings.catch_warnings():
        if not args.allow_warnings:  # as under pytest: an overflow in a policy becomes INTERNAL
            warnings.simplefilter("error", RuntimeWarning)
        tally, phases, stopped = campaign(args.cases, args.seed, undecodable_share=args.undecodable_share)
    problems = list(tally.failures)
    limit = args.max_growth_kib_per_input
    for ph in phases:
        if (per_input := ph.rss_growth / max(ph.inputs, 1) / 1024) > limit:
            problems.append(f"phase {ph.name}: RSS grew {per_input:.2f} KiB per input (limit {limit})")
    if not stopped:
        problems.append("the server did not stop within 10 s (RPCs left behind)")
    for f in problems[:20]:
        print(f"FAIL {f}")
    print(f"{len(problems)} failures" if problems else "no failures")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
