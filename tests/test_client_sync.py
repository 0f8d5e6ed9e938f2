"""SchedulerClient behaviour that needs no policy: errors, defaults, request encoding."""

from __future__ import annotations

import grpc
import pytest

from scheduler_service.client import EngineProfile, IterationReport, SchedulerClient, SchedulerError
from tests.grpc_support import make_server, mixed_snapshot


def test_unreachable_server_is_a_scheduler_error() -> None:
    with SchedulerClient("127.0.0.1:1", timeout_s=0.5) as cl, pytest.raises(SchedulerError) as exc:
        cl.schedule(mixed_snapshot(0, 2, 2))
    assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert exc.value.violations == ()


def test_report_needs_a_batch() -> None:
    with pytest.raises(ValueError):
        IterationReport(latency_ms=1.0).to_pb()


def test_a_report_that_cannot_be_sent_is_a_clear_error_and_the_ones_before_it_arrive() -> None:
    good = [IterationReport(latency_ms=10.0 + i, c=[1, 1, 64], u=[5, 9, 0]) for i in range(2)]
    with make_server() as srv, SchedulerClient(srv.target, timeout_s=10.0) as cl:
        with pytest.raises(ValueError, match=r"^reports\[2\]: an IterationReport needs c and u, or features "
                                             r"\(the 2 before it were sent\)$"):
            cl.report(iter([*good, IterationReport(latency_ms=1.0), *good]))
        assert cl.get_predictor().reports_accepted == 2
        assert cl.report(good).accepted == 2  # the client goes on


def test_profile_defaults_and_stream_reuse() -> None:
    prof = EngineProfile("m", "h", 8)
    with make_server() as srv, SchedulerClient(srv.target, timeout_s=10.0, profile=prof, engine_id="e1") as cl:
        assert cl.get_predictor().profile_key == prof.key
        assert cl.get_predictor("").profile_key == prof.key
        assert cl.get_predictor("x|y|tp2").profile_key == "x|y|tp2"
        s = cl.stream()
        plans = [s.schedule(mixed_snapshot(i, 3, 3), request_id=f"id{i}") for i in range(5)]
        s.close()
        assert all(p.policy == "slidingserve" for p in plans)
        with pytest.raises(SchedulerError) as exc:
            s.schedule(mixed_snapshot(0, 3, 3))
        assert exc.value.code == grpc.StatusCode.CANCELLED
        assert cl.get_predictor().to_dict()["profile_key"] == prof.key


def test_policy_list_dict_matches_registry_describe() -> None:
    from scheduler_service.core import registry

    with make_server() as srv, SchedulerClient(srv.target, timeout_s=10.0) as cl:
        d = cl.list_policies().to_dict()
    assert d["default"] == "slidingserve"
    for p in d["policies"]:
        want = registry.describe(p["name"])
        assert [q["name"] for q in p["params"]] == [q["name"] for q in want["params"]]
        assert [q["default"] for q in p["params"]] == [q["default"] for q in want["params"]]


def test_stream_reply_at_the_deadline_does_not_poison_the_next_call() -> None:
    """A reply arriving just as the watchdog fires is returned or reported as a deadline miss,
    and the next call works: never a CANCELLED error from a stream cancelled after the fact."""
    from scheduler_service.client import SchedulerClient, SchedulerError
    from tests.grpc_support import InjectedPolicy, inject, make_server, mixed_snapshot

    snap = mixed_snapshot(0, n_decode=4, n_prefill=4)
    codes: list[str] = []
    with make_server() as srv, SchedulerClient(srv.target, timeout_s=5) as c:
        inject(srv, InjectedPolicy(name="edge", delay_s=0.010))
        with c.stream() as s:
            for i in range(60):
                try:
                    s.schedule(snap, policy="edge", timeout_s=0.0105 + 0.0002 * (i % 10))
                    codes.append("OK")
                except SchedulerError as e:
                    codes.append(e.code.name)
            s.schedule(snap, policy="edge", timeout_s=5)  # and the stream still works
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"}, codes


def test_stream_deadline_shorter_than_the_last_is_enforced_in_time() -> None:
    """The watchdog sleeps toward the pending deadline: a call with a shorter timeout than the
    one before (the pipelined adapter's timeout is its deadline plus the running step's time,
    which varies) must still be cut at its own deadline, not when the longer one would have
    expired."""
    import time

    from tests.grpc_support import InjectedPolicy, inject

    snap = mixed_snapshot(0, n_decode=4, n_prefill=4)
    with make_server() as srv, SchedulerClient(srv.target, timeout_s=5) as c:
        inject(srv, InjectedPolicy(name="slow", delay_s=0.3))
        with c.stream() as s:
            s.schedule(snap, timeout_s=5.0)  # connected; the watchdog sleeps toward 5 s
            t0 = time.monotonic()
            with pytest.raises(SchedulerError) as e:
                s.schedule(snap, policy="slow", timeout_s=0.05)
            took = time.monotonic() - t0
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert took < 0.25, f"a 50 ms deadline took {took:.3f} s to fire"
            s.schedule(snap, timeout_s=5.0)  # and the stream works again


def test_stream_reply_for_another_request_is_a_clear_error() -> None:
    """A reply carrying the wrong request_id fails the call with INTERNAL naming both ids,
    and the next call opens a fresh stream (the same as the async client)."""
    from tests.grpc_support import WrongIdServer

    with WrongIdServer() as srv, SchedulerClient(srv.target, timeout_s=5.0) as cl, cl.stream() as s:
        for rid in ("a1", "a2"):
            with pytest.raises(SchedulerError) as exc:
                s.schedule(mixed_snapshot(0, 2, 2), request_id=rid)
            assert exc.value.code == grpc.StatusCode.INTERNAL
            assert f"'not-{rid}'" in str(exc.value) and f"expected '{rid}'" in str(exc.value)
