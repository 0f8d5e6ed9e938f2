"""The in-process planner: the policy in the engine's own process.

One of the two implementations of the planner interface
(:class:`engine_adapter.core.SchedulerBackend`) that an :class:`~engine_adapter.core.AdapterCore`
is handed; the other is the remote service (:class:`engine_adapter.remote.GrpcBackend`).  Reports
refit the predictor online with the service's own per-profile registry
(:mod:`scheduler_service.predictors`, imported when a backend is built: it loads
neither the gRPC server nor prometheus, and importing this module loads no server module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Snapshot,
    batch_features,
    default_predictor,
    kernels,
    registry,
)
from scheduler_service.core.reasons import plan_explained

from .core import AdapterSettings, IterationSample

if TYPE_CHECKING:
    from scheduler_service.predictors import PredictorRegistry

__all__ = ["InProcessBackend"]


class InProcessBackend:
    """The policy in the engine's own process, with online predictor refits
    from its reports (the same registry the service uses)."""

    def __init__(self, settings: AdapterSettings, predictor: BatchLatencyPredictor | None = None,
                 refit: bool = True, predictors: PredictorRegistry | None = None) -> None:
        """``predictors``: a registry to learn into that outlives this backend (the vLLM
        adapter keeps one across settings reloads, so a policy switch keeps what the
        predictor learned of the engine); it is not closed with the backend."""
        from scheduler_service.predictors import PredictorRegistry, RefitSettings

        self._policy = registry.create(settings.policy or "slidingserve", settings.params)
        self._profile = settings.profile or "default"
        self._owns_registry = predictors is None
        self._registry = predictors if predictors is not None else PredictorRegistry(
            predictor or default_predictor(), RefitSettings(), synchronous=settings.report_inline
        ) if refit else None
        self._fixed = predictor or default_predictor()
        self._explain_every = max(0, settings.explain_every)
        self._plans = 0
        # compiled kernels load (or compile) now, not in the engine's first iteration
        kernels.warm_up()

    @property
    def predictor(self) -> BatchLatencyPredictor:
        return self._registry.current(self._profile) if self._registry else self._fixed

    def schedule(self, snapshot: Snapshot, timeout_s: float) -> Plan:
        """The policy's plan; every ``explain_every``-th one explained (with its reasons)."""
        self._plans += 1
        if self._explain_every and self._plans % self._explain_every == 0:
            return plan_explained(self._policy, snapshot, self.predictor)
        return self._policy.plan(snapshot, self.predictor)

    def report(self, samples: Sequence[IterationSample]) -> None:
        if self._registry is None:
            return
        for s in samples:
            x, scen = batch_features(s.c, s.u)
            self._registry.add(self._profile, x, scen, s.latency_ms)

    def wait_refits(self, timeout: float = 10.0) -> bool:
        return self._registry.wait_idle(timeout) if self._registry else True

    def close(self) -> None:
        if self._registry is not None and self._owns_registry:
            self._registry.close()
