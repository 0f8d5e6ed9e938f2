"""The engines a service instance is serving: who, since when, on which deployment.

A fleet shares one service, so operators need to see it as a fleet — how many engines are
active, how many follow each deployment during a rollout — and the service must not
grow with every engine that ever connected.  :class:`EngineTable` keeps one small record per
(tenant, engine id) in least-recently-seen order: records unseen for ``ttl_s`` are expired
(swept at most once per second, from the stale end, so a sweep costs only what it removes)
and beyond ``max_engines`` the least recently seen is evicted, so memory is bounded whatever
clients send.  Per-engine *stream* state needs no table: each ScheduleStream/ReportIterations
call keeps its state in its own handler, and a policy is immutable and shared.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from .metrics import Metrics

__all__ = ["EngineRecord", "EngineTable"]

log = structlog.get_logger("slidingserve.server")

#: Longest engine id kept (ids are caller-chosen).
MAX_ID = 128


@dataclass(slots=True)
class EngineRecord:
    tenant: str
    engine_id: str
    first_seen: float
    last_seen: float
    decisions: int = 0
    #: deployment that served its last decision ("" = a registry policy named directly)
    deployment: str = ""


class EngineTable:
    def __init__(self, metrics: Metrics, ttl_s: float = 300.0, max_engines: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.max_engines = max_engines
        self._clock = clock
        self._items: OrderedDict[tuple[str, str], EngineRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._next_sweep = 0.0
        self.expired = 0
        self.evicted = 0

    def seen(self, tenant: str, engine_id: str, deployment: str) -> None:
        """Record one decision for an engine (called on every decision: O(1))."""
        engine_id = engine_id[:MAX_ID]
        key = (tenant, engine_id)
        now = self._clock()
        joined = evicted = None
        with self._lock:
            rec = self._items.pop(key, None)
            if rec is None:
                rec = joined = EngineRecord(tenant, engine_id, now, now)
            rec.last_seen = now
            rec.decisions += 1
            rec.deployment = deployment
            self._items[key] = rec
            if len(self._items) > self.max_engines:
                _, evicted = self._items.popitem(last=False)
                self.evicted += 1
            sweep = now >= self._next_sweep
            if sweep:
                self._next_sweep = now + 1.0
        if joined is not None:
            log.info("engine_joined", tenant=tenant, engine_id=engine_id or "(unnamed)", deployment=deployment)
        if evicted is not None:
            self.metrics.engines_removed.labels("evicted").inc()
            log.warning("engine_evicted", tenant=evicted.tenant, engine_id=evicted.engine_id,
                        max_engines=self.max_engines)
        if sweep or joined is not None or evicted is not None:
            self.sweep(now)

    def sweep(self, now: float | None = None) -> int:
        """Expire engines unseen for ``ttl_s`` and refresh the gauges; returns how many expired."""
        now = self._clock() if now is None else now
        gone: list[EngineRecord] = []
        with self._lock:
            while self._items:
                key, rec = next(iter(self._items.items()))
                if now - rec.last_seen < self.ttl_s:
                    break
                del self._items[key]
                gone.append(rec)
            self.expired += len(gone)
            active = len(self._items)
            by_deployment = Counter(r.deployment for r in self._items.values())
        m = self.metrics
        m.engines_active.set(active)
        for d in list(m.known_engine_deployments):
            if d not in by_deployment:
                m.engines_by_deployment.labels(d).set(0)
        for d, n in by_deployment.items():
            m.engines_by_deployment.labels(d).set(n)
            m.known_engine_deployments.add(d)
        for rec in gone:
            m.engines_removed.labels("expired").inc()
            log.info("engine_expired", tenant=rec.tenant, engine_id=rec.engine_id or "(unnamed)",
                     idle_s=round(now - rec.last_seen, 1), decisions=rec.decisions)
        return len(gone)

    def records(self) -> list[EngineRecord]:
        """Copies, least recently seen first."""
        with self._lock:
            return [EngineRecord(r.tenant, r.engine_id, r.first_seen, r.last_seen, r.decisions, r.deployment)
                    for r in self._items.values()]

    def __len__(self) -> int:
        return len(self._items)
