"""The remote planner: the scheduling service, reached with :class:`~scheduler_service.client.SchedulerClient`.

One of the two implementations of the planner interface
(:class:`engine_adapter.core.SchedulerBackend`) that an :class:`~engine_adapter.core.AdapterCore`
is handed; the other is the policy in the engine's process
(:class:`engine_adapter.inprocess.InProcessBackend`).  It lives in its own module, next to
the core rather than in it, so that the adapter core never imports the client; the client
(:mod:`scheduler_service.client`) stands below the adapter, so the vLLM scheduler class
can build this planner itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine_adapter.core import AdapterSettings, IterationSample
from scheduler_service.client import ClientSecurity, IterationReport, SchedulerClient
from scheduler_service.core import Plan, Snapshot

__all__ = ["GrpcBackend"]


class GrpcBackend:
    """The remote service over one long-lived ScheduleStream per engine.

    Channels are created lazily on first use, so an engine that forks (vLLM's
    EngineCore) creates them in the process that uses them.  ``security`` adds
    TLS / mutual TLS and the engine's token (sent on every call and stream);
    with a ``channel_factory`` the factory's channel carries the transport and
    ``security`` only contributes the token.
    """

    def __init__(self, target: str, settings: AdapterSettings, *, unary: bool = False,
                 channel_factory: Callable[[], Any] | None = None,
                 security: ClientSecurity | None = None) -> None:
        self.target = target
        self._settings = settings
        self._unary = unary
        #: Builds the ``grpc.Channel`` (TLS, reconnect options); called lazily,
        #: after any fork, like the default insecure channel.
        self._channel_factory = channel_factory
        self._security = security
        self._client: Any = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        if self._client is None:
            self._client = SchedulerClient(
                self.target, timeout_s=self._settings.deadline_ms / 1e3,
                profile=self._settings.profile or None, engine_id=self._settings.engine_id,
                channel=self._channel_factory() if self._channel_factory else None,
                security=self._security,
            )
        return self._client

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan:
        client = self._connect()
        policy = self._settings.policy or None
        if self._unary:
            return client.schedule(snapshot, policy=policy, params=self._settings.params, timeout_s=timeout_s)
        if self._stream is None:
            self._stream = client.stream()
        return self._stream.schedule(snapshot, policy=policy, params=self._settings.params, timeout_s=timeout_s)

    def report(self, samples: Sequence[IterationSample]) -> None:
        client = self._connect()
        client.report(
            [IterationReport(latency_ms=s.latency_ms, c=s.c, u=s.u) for s in samples],
            timeout_s=max(1.0, 10 * self._settings.deadline_ms / 1e3),
        )

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._client is not None:
            self._client.close()
