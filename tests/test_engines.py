"""The engine table: engines seen through real decisions, stale ones expired, memory bounded."""

from __future__ import annotations

import time

from scheduler_service.client import SchedulerClient
from scheduler_service.server.engines import EngineTable
from scheduler_service.server.metrics import Metrics

from .grpc_support import make_server, mixed_snapshot


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_engines_are_counted_by_version_and_expire_over_grpc() -> None:
    with make_server(engine_ttl_s=0.3) as srv:
        assert srv.servicer is not None
        clients = [SchedulerClient(srv.target, timeout_s=5, engine_id=f"e{i}") for i in range(3)]
        try:
            for c in clients:
                c.schedule(mixed_snapshot(1))
            clients[0].schedule(mixed_snapshot(2), policy="vllm-fcfs")
            table = srv.servicer.engines
            recs = {r.engine_id: r for r in table.records()}
            assert set(recs) == {"e0", "e1", "e2"} and recs["e0"].decisions == 2
            assert srv.metrics.registry.get_sample_value("slidingserve_engines_active") == 3
            time.sleep(0.4)
            clients[1].schedule(mixed_snapshot(3))  # e1 is back; e0 and e2 went quiet
            assert table.sweep() == 2
            assert [r.engine_id for r in table.records()] == ["e1"]
            assert srv.metrics.registry.get_sample_value("slidingserve_engines_removed_total",
                                                         {"reason": "expired"}) == 2
            assert srv.metrics.registry.get_sample_value("slidingserve_engines_active") == 1
        finally:
            for c in clients:
                c.close()


def test_engine_table_is_bounded_and_tracks_deployments() -> None:
    m = Metrics()
    clock = Clock()
    t = EngineTable(m, ttl_s=10, max_engines=3, clock=clock)
    for i in range(5):
        clock.t += 1
        t.seen("default", f"e{i}", "v1" if i % 2 else "v2")
    assert len(t) == 3 and t.evicted == 2
    assert [r.engine_id for r in t.records()] == ["e2", "e3", "e4"]
    t.seen("default", "e3", "v2")  # e3 moves to v2 and becomes the most recent
    t.sweep()
    assert m.registry.get_sample_value("slidingserve_engines_by_deployment", {"deployment": "v2"}) == 3
    assert m.registry.get_sample_value("slidingserve_engines_by_deployment", {"deployment": "v1"}) == 0
    # one word: the pre-rename alias series is gone (CHANGELOG.md)
    assert "slidingserve_engines_by_version" not in {mf.name for mf in m.registry.collect()}
    clock.t += 100
    assert t.sweep() == 3 and len(t) == 0
    t.seen("tenant-b", "x" * 1000, "")
    assert len(t.records()[0].engine_id) == 128  # caller-chosen ids are truncated


def test_engine_streams_spread_over_replicas_and_stay_on_one() -> None:
    """A target naming two replicas: streams are spread round-robin at open, and every
    decision of one engine's stream lands on the same replica."""
    a = make_server().start()
    b = make_server(host="127.0.0.2").start()
    try:
        target = f"ipv4:127.0.0.1:{a.port},127.0.0.2:{b.port}"
        for i in range(16):
            with SchedulerClient(target, timeout_s=5, engine_id=f"e{i}") as c, c.stream() as s:
                for k in range(4):
                    s.schedule(mixed_snapshot(k))
        assert a.servicer is not None and b.servicer is not None
        on_a = {r.engine_id: r.decisions for r in a.servicer.engines.records()}
        on_b = {r.engine_id: r.decisions for r in b.servicer.engines.records()}
        assert on_a and on_b, (on_a, on_b)  # both replicas serve engines
        assert not set(on_a) & set(on_b)  # no engine split across replicas
        assert set(on_a.values()) | set(on_b.values()) == {4} and len(on_a) + len(on_b) == 16
    finally:
        a.stop(0)
        b.stop(0)
