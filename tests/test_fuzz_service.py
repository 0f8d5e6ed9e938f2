"""Hostile input against a real server over loopback gRPC, driven by Hypothesis.

The generators (hostile requests, bytes, reports, JSON) and the oracle that judges every
answer are :mod:`benchmarks.fuzz_service`'s, which also runs the long campaign; here
Hypothesis draws their random choices, so failures shrink and replay.  Every valid input
must get exactly the in-process plan (checked with ``plan_violations``), every invalid one
INVALID_ARGUMENT naming exactly the violated fields, oversized ones RESOURCE_EXHAUSTED;
after every test the server still answers health SERVING and a known-good request.

Examples per test are moderate (the file runs in well under a minute on 2 cores);
``SLIDINGSERVE_FUZZ_EXAMPLES=2000`` runs that many per test, randomised.

Bytes that are no valid message: with grpc's own decoding a request that fails to
deserialize got INTERNAL, leaked ~19 KB of server memory per call, and a stream whose
first message failed could stay unreleased so that ``stop()`` hung.  The server registers
never-raising deserializers (``scheduler_service/server/handlers.py``); the last tests here
pin the result: INVALID_ARGUMENT with details, streams that go on, no growth, clean stops.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_service import (
    MAX_MESSAGE,
    MAX_REQUESTS,
    MUTATORS,
    REPORT_MODELS,
    Tally,
    Target,
    check_json,
    fuzz_server,
    hostile_bytes,
    hostile_json,
    hostile_profile_untouched,
    hostile_report,
    hostile_request,
    oversized_request,
    rss_bytes,
    stop_within,
    valid_report,
    valid_request,
)
from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import Snapshot, ValidationError
from scheduler_service.core.snapshot import MAX_BATCH_TOKENS
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.server import SchedulerServer
from scheduler_service.wire.convert import snapshot_to_pb
from scheduler_service.wire.status import MAX_FIELD_BYTES
from tests.grpc_support import mixed_snapshot

T = TypeVar("T")

_EXAMPLES = int(os.environ.get("SLIDINGSERVE_FUZZ_EXAMPLES", "0"))


def fuzz(n: int) -> settings:
    """``n`` examples (or the env override), derandomised unless overridden."""
    return settings(max_examples=_EXAMPLES or n, deadline=None, derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=list(HealthCheck))


class DrawRand:
    """The generators' ``Rand`` on top of Hypothesis data: every choice is a draw."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def randint(self, a: int, b: int) -> int:
        return self.data.draw(st.integers(a, b))

    def choice(self, seq: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(list(seq)))

    def random(self) -> float:
        return self.data.draw(st.floats(0.0, 1.0, exclude_max=True))


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    srv = fuzz_server().start()
    yield srv
    # Nothing these tests send may leave an RPC behind (see the xfail test for what does).
    assert stop_within(srv, 15.0), "server.stop() hung: an RPC was left behind"


@pytest.fixture(scope="module")
def target(server: SchedulerServer) -> Iterator[Target]:
    with Target(server, Tally(), timeout_s=20.0) as t:
        yield t
    print(f"\nfuzz inputs tried: {t.tally.total} {dict(t.tally.inputs)}")


@pytest.fixture(autouse=True)
def still_serving(target: Target) -> Iterator[None]:
    yield
    target.assert_healthy()
    no_failures(target)


def no_failures(target: Target) -> None:
    failures, target.tally.failures[:] = list(target.tally.failures), []
    assert not failures, "\n".join(failures[:5])


# ------------------------------------------------------------------ Schedule
@fuzz(60)
@given(data=st.data())
def test_hostile_requests_get_the_oracles_answer(target: Target, data: st.DataObject) -> None:
    req, names, must_fail = hostile_request(DrawRand(data))
    target.schedule(req.SerializeToString(), must_fail=must_fail, what=",".join(names))
    no_failures(target)


@pytest.mark.parametrize(("name", "mutate"), [(n, m) for n, m, _ in MUTATORS], ids=[n for n, _, _ in MUTATORS])
def test_every_must_fail_mutation_is_invalid_argument(target: Target, name: str, mutate: Any) -> None:
    for seed in range(15):
        rnd = random.Random(seed)
        req = valid_request(rnd)
        mutate(req, rnd)
        assert target.schedule(req.SerializeToString(), must_fail=True, what=name) == "INVALID_ARGUMENT"
    no_failures(target)


@fuzz(60)
@given(data=st.data())
def test_mutated_bytes_get_the_oracles_answer(target: Target, data: st.DataObject) -> None:
    raw, how = hostile_bytes(DrawRand(data))
    target.schedule(raw, "bytes", what=how)
    no_failures(target)


@fuzz(30)
@given(raw=st.binary(max_size=256))
def test_random_bytes_never_crash_the_server(target: Target, raw: bytes) -> None:
    assert target.schedule(raw, "bytes") in ("OK", "INVALID_ARGUMENT", "INTERNAL")
    no_failures(target)


def test_undecodable_bytes_get_invalid_argument(target: Target) -> None:
    """Bytes that are no ScheduleRequest: INVALID_ARGUMENT naming the field ``request``."""
    for raw in (b"\xff\xff\xff", b"\x0a\x02\xc3\x28", b"\x12\x05abc"):  # bad tag, bad UTF-8, truncated
        assert target.schedule(raw, "undecodable", must_fail=True) == "INVALID_ARGUMENT"
    no_failures(target)


def test_oversized_messages_are_resource_exhausted(target: Target) -> None:
    rnd = random.Random(0)
    for _ in range(6):
        raw = oversized_request(rnd)
        assert len(raw) > MAX_MESSAGE
        assert target.schedule(raw, "oversize") == "RESOURCE_EXHAUSTED"
    # Just under the limit but over max_requests: a validation error, not a size error.
    req = valid_request(rnd)
    req.snapshot.CopyFrom(pb.Snapshot(now=1.0, max_batch_tokens=8, max_num_seqs=8))
    n = MAX_REQUESTS + 1
    c = req.snapshot.columns
    c.ids.extend(f"{i:04d}" + "x" * 1500 for i in range(n))
    c.arrival.extend([0.0] * n)
    c.prompt_tokens.extend([4] * n)
    c.computed_tokens.extend([0] * n)
    c.output_tokens.extend([0] * n)
    c.ttft_slo.extend([1.0] * n)
    c.tbt_slo.extend([1.0] * n)
    c.protected.extend([False] * n)
    assert req.ByteSize() <= MAX_MESSAGE
    assert target.schedule(req.SerializeToString(), "oversize", must_fail=True) == "INVALID_ARGUMENT"
    # On a stream: the answers before it arrive, then the stream ends RESOURCE_EXHAUSTED.
    good = valid_request(rnd).SerializeToString()
    assert target.stream([good, oversized_request(rnd)])[-1] == "RESOURCE_EXHAUSTED (stream ended)"
    no_failures(target)


def test_long_echoed_input_keeps_bad_request_details(target: Target, server: SchedulerServer) -> None:
    """A 20 KB policy name used to be echoed into the trailers, which clients refuse above
    16 KiB: they saw a bare RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT with fields."""
    snap = mixed_snapshot(0, 4, 4)
    with SchedulerClient(server.target, timeout_s=10.0) as client:
        for policy, params, field in [("p" * 20_000, None, "policy"),
                                      ("slidingserve", {"k" * 30_000: "1"}, "params.kkk"),
                                      ("slidingserve", {"window": "9" * 4000}, "params.window")]:
            with pytest.raises(SchedulerError) as exc:
                client.schedule(snap, policy=policy, params=params)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            assert exc.value.fields and exc.value.fields[0].startswith(field)
            assert all(len(f.encode()) <= MAX_FIELD_BYTES for f in exc.value.fields)
            with client.stream() as s, pytest.raises(SchedulerError) as exc2:
                s.schedule(snap, policy=policy, params=params)
            assert exc2.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert exc2.value.fields[0].startswith(field)


def test_huge_batch_budget_is_rejected_not_allocated(target: Target, server: SchedulerServer) -> None:
    """Policies build per-token curves up to max_batch_tokens: 10^9 used to mean 8 GB."""
    snap = mixed_snapshot(1, 2, 2, max_batch_tokens=MAX_BATCH_TOKENS)
    with SchedulerClient(server.target, timeout_s=10.0) as client:
        assert client.schedule(snap).token_budget > 0
        msg = pb.ScheduleRequest(snapshot=snapshot_to_pb(snap))
        for bad in (MAX_BATCH_TOKENS + 1, 10**9, 2**62):
            msg.snapshot.max_batch_tokens = bad
            with pytest.raises(grpc.RpcError) as exc:
                target.stub.Schedule(msg, timeout=10)
            err = SchedulerError.from_rpc_error(exc.value)
            assert (err.code, err.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["snapshot.max_batch_tokens"])


# ------------------------------------------------------------ ScheduleStream
@fuzz(25)
@given(data=st.data())
def test_stream_survives_hostile_requests(target: Target, data: st.DataObject) -> None:
    rnd = DrawRand(data)
    msgs = [hostile_request(rnd)[0].SerializeToString() for _ in range(rnd.randint(1, 6))]
    msgs.append(valid_request(random.Random(5)).SerializeToString())
    labels = target.stream(msgs)
    assert len(labels) == len(msgs) and labels[-1] == "OK"
    no_failures(target)


def test_undecodable_message_mid_stream_is_answered_and_the_stream_goes_on(target: Target) -> None:
    good = valid_request(random.Random(2)).SerializeToString()
    labels = target.stream([good, good, b"\xff\xff", good])
    assert labels[0] == labels[1] == labels[3] == "OK" and labels[2] != "OK" and len(labels) == 4, labels
    no_failures(target)


# ---------------------------------------------------------- ReportIterations
@fuzz(25)
@given(data=st.data())
def test_hostile_reports_are_rejected_counted_and_leave_no_trace(target: Target, data: st.DataObject) -> None:
    rnd = DrawRand(data)
    reports = [(hostile_report(rnd), True) if rnd.random() < 0.75 else (valid_report(rnd, rnd.choice(REPORT_MODELS)), False)
               for _ in range(rnd.randint(1, 12))]
    target.report(reports)
    no_failures(target)
    assert hostile_profile_untouched(target) == []


def test_many_hostile_reports_then_the_predictor_is_unchanged(target: Target, server: SchedulerServer) -> None:
    rnd = random.Random(3)
    summary = target.report([(hostile_report(rnd), True) for _ in range(300)])
    assert (summary.accepted, summary.rejected, len(summary.rejection_reasons)) == (0, 300, 10)
    assert summary.predictor_version == ""
    assert hostile_profile_untouched(target) == []
    no_failures(target)


# ----------------------------------------------------------------------- JSON
@fuzz(200)
@given(data=st.data())
def test_snapshot_from_json_rejects_hostile_json_cleanly(target: Target, data: st.DataObject) -> None:
    raw, must_fail = hostile_json(DrawRand(data))
    check_json(raw, must_fail, target.tally)
    no_failures(target)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@fuzz(100)
@given(value=json_values, keys=st.sampled_from([{}, {"now": 1.0, "max_batch_tokens": 4, "max_num_seqs": 2}]))
def test_snapshot_from_json_on_arbitrary_json(value: Any, keys: dict[str, Any]) -> None:
    doc = {**keys, "requests": value} if keys else value
    try:
        Snapshot.from_json(json.dumps(doc, allow_nan=True))
    except ValidationError:
        pass


@fuzz(20)
@given(data=st.data())
def test_cli_plan_on_hostile_json_prints_one_line_and_exits_2(target: Target, data: st.DataObject) -> None:
    raw, must_fail = hostile_json(DrawRand(data))
    with tempfile.TemporaryDirectory() as tmp:
        check_json(raw, must_fail, target.tally, cli=True, tmpdir=Path(tmp))
    no_failures(target)


@pytest.mark.parametrize("raw", [
    b'{"now": 1, "max_batch_tokens": 4, "max_num_seqs": 1, "requests": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"now": ' + b"9" * 5000 + b', "max_batch_tokens": 4, "max_num_seqs": 1, "requests": []}',
    b'{"now": NaN, "max_batch_tokens": 4, "max_num_seqs": 1, "requests": [], "a\\nb": 1}',
    b'{"now": 1, "max_batch_tokens": 4, "max_num_seqs": 1, "requests": [{"id": "\xff"}]}',
], ids=["deep-nesting", "5000-digit-int", "nan-and-newline-key", "invalid-utf8"])
def test_cli_plan_subprocess_has_no_traceback(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(raw)
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "plan", "--snapshot", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------- memory
def _hostile_decodable_calls(target: Target, rnd: random.Random, n: int) -> None:
    for i in range(n):
        if i % 10 == 0:
            target.stream([hostile_request(rnd)[0].SerializeToString() for _ in range(3)])
        elif i % 10 == 1:
            target.report([(hostile_report(rnd), True) for _ in range(3)])
        else:
            req, _, must_fail = hostile_request(rnd)
            target.schedule(req.SerializeToString(), must_fail=must_fail)


def test_memory_is_bounded_over_2000_hostile_calls(target: Target) -> None:
    rnd = random.Random(42)
    _hostile_decodable_calls(target, rnd, 500)  # warm-up: caches, allocator arenas, grpc buffers
    before = rss_bytes()  # (after gc and malloc_trim)
    _hostile_decodable_calls(target, rnd, 2000)
    growth = rss_bytes() - before
    no_failures(target)
    # Measured 0.1-2.6 MiB (allocator noise); the undecodable-bytes leak below shows ~40 MiB
    # over as many calls, a 4 KB-per-call leak would show 8 MiB.
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 2000 hostile calls"


def test_undecodable_requests_do_not_leak(target: Target) -> None:
    def send(n: int) -> None:
        for _ in range(n):
            with pytest.raises(grpc.RpcError) as exc:
                target._unary(b"\xff\xff", timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid slidingserve.v1.ScheduleRequest" in (exc.value.details() or "")

    send(300)
    before = rss_bytes()
    send(2000)
    assert rss_bytes() - before < 8 * 2**20


@pytest.mark.parametrize("method", ["ScheduleStream", "ReportIterations"])
def test_server_stops_after_undecodable_first_stream_messages(method: str) -> None:
    """An undecodable first message is one bad request: the stream answers it (error
    response / rejected report), serves the good ones after it, and the server stops."""
    srv = fuzz_server().start()
    good = (valid_request(random.Random(1)) if method == "ScheduleStream"
            else valid_report(random.Random(1), REPORT_MODELS[0])).SerializeToString()
    with grpc.insecure_channel(srv.target) as ch:
        call: Any = (ch.stream_stream if method == "ScheduleStream" else ch.stream_unary)(
            f"/slidingserve.v1.SchedulerService/{method}")
        for k in range(10):
            n_good = k % 3
            result = call(iter([b"\xff\xff"] + [good] * n_good), timeout=10)
            if method == "ScheduleStream":
                replies = [pb.ScheduleResponse.FromString(b) for b in result]
                assert len(replies) == 1 + n_good
                assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert all(r.HasField("plan") for r in replies[1:])
            else:
                summary = pb.ReportSummary.FromString(result)
                assert summary.rejected == 1 and summary.accepted + summary.rejected == 1 + n_good
    assert stop_within(srv, 3.0)
