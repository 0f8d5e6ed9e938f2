"""AsyncSchedulerClient (grpc.aio) against a real loopback server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from scheduler_service.client import AsyncSchedulerClient, EngineProfile, IterationReport, SchedulerError
from scheduler_service.core import default_predictor, registry
from scheduler_service.server import SchedulerServer
from tests.grpc_support import InjectedPolicy, inject, make_server, mixed_snapshot


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with make_server() as srv:
        yield srv


def test_async_client_all_methods(server: SchedulerServer) -> None:
    snap = mixed_snapshot(7)
    want = registry.create("sarathi-edf").plan(snap, default_predictor())
    prof = EngineProfile("m", "gpu", 2)

    async def main() -> None:
        async with AsyncSchedulerClient(server.target, timeout_s=10.0, profile=prof) as cl:
            got = await cl.schedule(snap, policy="sarathi-edf")
            assert got.decision_key() == want.decision_key()
            async with cl.stream() as s:
                for _ in range(3):
                    assert (await s.schedule(snap, policy="sarathi-edf")).decision_key() == want.decision_key()
                with pytest.raises(SchedulerError) as exc:
                    await s.schedule(snap, params={"window": 0})
                assert exc.value.fields == ["params.window"]
                assert (await s.schedule(snap, policy="sarathi-edf")).decision_key() == want.decision_key()
            with pytest.raises(SchedulerError) as exc:
                await cl.schedule(snap, policy="nope")
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and exc.value.fields == ["policy"]
            pol = await cl.list_policies()
            assert "slidingserve" in pol.names()

            async def reports():  # an async iterable works as well as a list
                for i in range(3):
                    yield IterationReport(latency_ms=10.0 + i, c=np.array([1, 1, 64]), u=np.array([5, 9, 0]))

            summary = await cl.report(reports())
            assert (summary.accepted, summary.rejected) == (3, 0)

            async def one_bad():
                yield IterationReport(latency_ms=10.0, c=np.array([1]), u=np.array([5]))
                yield IterationReport(latency_ms=10.0)  # no batch: cannot be encoded

            for bad in (one_bad(), [IterationReport(latency_ms=10.0)]):
                with pytest.raises(ValueError, match="needs c and u, or features"):
                    await cl.report(bad)
            info = await cl.get_predictor()  # the client's default profile
            assert info.profile_key == prof.key and info.reports_accepted == 4  # 3, and the one before the bad

    asyncio.run(main())


def test_async_deadline(server: SchedulerServer) -> None:
    inject(server, InjectedPolicy(name="slow", delay_s=0.3))
    snap = mixed_snapshot(0, 4, 4)

    async def main() -> None:
        async with AsyncSchedulerClient(server.target, timeout_s=10.0) as cl:
            with pytest.raises(SchedulerError) as exc:
                await cl.schedule(snap, policy="slow", timeout_s=0.05)
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            async with cl.stream() as s:
                with pytest.raises(SchedulerError) as exc:
                    await s.schedule(snap, policy="slow", timeout_s=0.05)
                assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert (await s.schedule(snap)).policy == "slidingserve"  # reopened

    asyncio.run(main())


def test_async_stream_reply_for_another_request_is_a_clear_error() -> None:
    """As the sync stream: INTERNAL naming both ids (not a wait for the deadline), and the
    next call opens a fresh stream."""
    from tests.grpc_support import WrongIdServer

    async def main() -> None:
        with WrongIdServer() as srv:
            async with AsyncSchedulerClient(srv.target, timeout_s=5.0) as cl, cl.stream() as s:
                for rid in ("a1", "a2"):
                    with pytest.raises(SchedulerError) as exc:
                        await s.schedule(mixed_snapshot(0, 2, 2), request_id=rid)
                    assert exc.value.code == grpc.StatusCode.INTERNAL
                    assert f"'not-{rid}'" in str(exc.value) and f"expected '{rid}'" in str(exc.value)

    asyncio.run(main())
