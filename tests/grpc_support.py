"""Helpers for the gRPC tests: embedded servers on port 0, snapshots, injected policies.

Injected policies (slow, failing) exist only here, to exercise shutdown and error paths;
they are put straight into a running server's policy cache, never registered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_service.core import Allocation, BatchLatencyPredictor, Plan, Snapshot
from scheduler_service.server import SchedulerServer, ServerConfig


def make_server(**overrides: Any) -> SchedulerServer:
    cfg = dict(host="127.0.0.1", port=0, log_level="warning", grace_s=2.0, max_workers=8)
    cfg.update(overrides)
    return SchedulerServer(ServerConfig(**cfg))


def mixed_snapshot(seed: int = 0, n_decode: int = 24, n_prefill: int = 48, *, now: float = 100.0,
                   max_batch_tokens: int = 2048, profile: str = "") -> Snapshot:
    """Decodes + waiting/prefilling requests with spread-out slacks (deterministic)."""
    rng = np.random.default_rng(seed)
    n = n_decode + n_prefill
    prompt = rng.integers(16, 2048, n)
    computed = np.where(np.arange(n) < n_decode, prompt, 0)
    part = (np.arange(n) >= n_decode) & (rng.random(n) < 0.3)
    computed = np.where(part, prompt // 2, computed)
    output = np.where(np.arange(n) < n_decode, rng.integers(1, 200, n), 0)
    arrival = now - rng.uniform(0.0, 3.0, n)
    return Snapshot.from_columns(
        now=now, max_batch_tokens=max_batch_tokens, max_num_seqs=256,
        ids=[f"r{i}" for i in range(n)], arrival=arrival, prompt_tokens=prompt,
        computed_tokens=computed, output_tokens=output,
        ttft_slo=rng.uniform(0.5, 5.0, n), tbt_slo=rng.uniform(0.05, 0.2, n),
        protected=rng.random(n) < 0.1, free_kv_tokens=500_000, profile=profile,
    )


@dataclass
class UnknownId:
    """A policy whose plan names a request the snapshot does not have (the engine's plan
    check refuses it): it cannot be explained."""

    name: str = "unknown-id"
    version: str = "test"
    params: object = None

    def plan(self, snapshot: Snapshot, predictor: object) -> Plan:
        return Plan(self.name, self.version, "p", "decode_only", 1, 0.0, (Allocation("not-a-request", 1),))


@dataclass(frozen=True)
class InjectedPolicy:
    """Schedules every decode for one token after ``delay_s``; raises when ``fail``."""

    name: str = "injected"
    version: str = "test"
    params: Any = None
    delay_s: float = 0.0
    fail: bool = False

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
        if self.fail:
            raise RuntimeError("injected failure with a secret traceback")
        time.sleep(self.delay_s)
        allocs = tuple(Allocation(i, 1) for i, d in zip(snapshot.ids, snapshot.is_decoding, strict=True) if d)
        return Plan(self.name, self.version, predictor.version, "decode_only", len(allocs), 0.0, allocs)


def inject(server: SchedulerServer, policy: InjectedPolicy) -> None:
    assert server.servicer is not None
    cache = server.servicer._policies
    with cache._lock:
        cache._items[(policy.name, ())] = policy  # type: ignore[assignment]


class WrongIdServer:
    """A misbehaving service on loopback whose ScheduleStream answers every request with
    another request's id (``"not-" + request_id``) and an empty plan."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc

        from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
        from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc

        class Servicer(pb_grpc.SchedulerServiceServicer):
            def ScheduleStream(self, requests: Any, context: Any) -> Any:
                for req in requests:
                    yield pb.ScheduleResponse(request_id="not-" + req.request_id)

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_SchedulerServiceServicer_to_server(Servicer(), self._server)  # type: ignore[abstract]
        self.target = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def __enter__(self) -> WrongIdServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
