"""The adapter core a vLLM scheduler decides with, and its hot reload (no vLLM import).

:func:`build_core` makes an :class:`~engine_adapter.core.AdapterCore` from the
adapter's settings (gRPC to the service, or the policy in process); :class:`LiveCore`
holds the one in use, creates it on first use (after vLLM forks the engine process)
and swaps it when the settings file changes (:class:`.settings.SettingsWatcher`).
Tests: tests/test_vllm_pipeline.py (no vLLM needed).

The remote path's modules (gRPC, the client, :mod:`engine_adapter.remote`) are imported
when a remote core is built, and the predictor registry
(:mod:`scheduler_service.predictors`) when an in-process one is: importing this
module loads neither, and an engine with the policy in process never loads gRPC
(tests/test_layers.py).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from scheduler_service.core import default_predictor

from .settings import FOLLOW_DEFAULT, SettingsWatcher, VllmAdapterSettings, default_engine_id, slo_defaults
from .snapshot import SnapshotBuilder

if TYPE_CHECKING:
    from scheduler_service.predictors import PredictorRegistry

__all__ = ["LiveCore", "build_core"]

log = logging.getLogger("engine_adapter.vllm")


def _channel_factory(s: VllmAdapterSettings) -> Any:
    import grpc  # the remote path only (module doc)

    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # find a restarted service within about a second, not gRPC's default 120 s
        ("grpc.initial_reconnect_backoff_ms", min(100, s.reconnect_max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, s.reconnect_max_ms)),
        ("grpc.max_reconnect_backoff_ms", s.reconnect_max_ms),
        # several replicas behind one name: streams spread over them (see scheduler_service/client.py)
        ("grpc.lb_policy_name", "round_robin"),
    ]

    def make() -> Any:
        if not s.tls:
            return grpc.insecure_channel(s.address, options=options)

        def read(p: str) -> bytes | None:
            if not p:
                return None
            with open(p, "rb") as fh:
                return fh.read()

        creds = grpc.ssl_channel_credentials(read(s.tls_ca), read(s.tls_key), read(s.tls_cert))
        return grpc.secure_channel(s.address, creds, options=options)

    return make


def build_core(s: VllmAdapterSettings, profile: str, predictors: PredictorRegistry | None = None) -> AdapterCore:
    """An :class:`AdapterCore` whose fallback is "no plan" (vLLM's native scheduling);
    in process, learning into ``predictors`` when given (it outlives the core)."""
    a = AdapterSettings(
        policy="" if s.policy == FOLLOW_DEFAULT else s.policy, params=dict(s.params), deadline_ms=s.deadline_ms, fallback_policy="",
        profile=profile, engine_id=s.engine_id or default_engine_id(), report_batch=s.report_batch,
        max_backoff_decisions=s.max_backoff_decisions, explain_every=s.explain_every, shed_after=s.shed_after,
        record=s.record,
    )
    backend: Any
    if s.address == "inproc":
        backend = InProcessBackend(a, predictors=predictors)
    else:
        from engine_adapter.remote import GrpcBackend  # the remote path only (module doc)

        backend = GrpcBackend(s.address, a, channel_factory=_channel_factory(s), security=s.client_security())
    return AdapterCore(backend, a)


class LiveCore:
    """The core in use under the settings in force (``settings``), rebuilt when the file
    that ``watcher`` watches changes; ``builder``'s SLO defaults follow the settings."""

    def __init__(self, watcher: SettingsWatcher, profile: str, builder: SnapshotBuilder) -> None:
        self.watcher = watcher
        self.settings = watcher.current
        self.profile = profile
        self.builder = builder
        self.core: AdapterCore | None = None  # created on first use: after vLLM forks
        self.predictors: PredictorRegistry | None = None  # likewise (its refit thread)
        #: final stats of the cores retired by reloads
        self.retired: list[dict[str, Any]] = []

    def get(self) -> AdapterCore:
        """The core, after applying a changed settings file (call it when no decision is in
        flight: a swap is safe then)."""
        core = self.core
        if core is None:
            core = self.core = self._build(self.settings)
        new = self.watcher.poll()
        if new is not None and self.swap(new):
            core = self.core
            assert core is not None
        return core

    def _build(self, s: VllmAdapterSettings) -> AdapterCore:
        """A core under ``s``; in process, learning into :meth:`registry` (a remote core
        does not create one: it needs no predictor here)."""
        return build_core(s, self.profile, self.registry() if s.address == "inproc" else None)

    def registry(self) -> PredictorRegistry:
        """The in-process predictor registry, one per engine: a settings reload (another
        policy, in process again after a remote spell) keeps what it learned of this engine."""
        if self.predictors is None:
            from scheduler_service.predictors import (  # in process only
                PredictorRegistry,
                RefitSettings,
            )

            self.predictors = PredictorRegistry(default_predictor(), RefitSettings())
        return self.predictors

    def swap(self, new: VllmAdapterSettings) -> bool:
        """Hot reload: a new core (backend, policy, deadline); the old one is closed in the
        background so its queued reports are still delivered.  False (and the old settings
        kept) when the new core cannot be built."""
        old = self.core
        try:
            core = self._build(new)
        except Exception as e:
            log.error("slidingserve: cannot apply the new settings, keeping the old ones: %s", e)
            return False
        self.settings = new
        self.builder.defaults = slo_defaults(new)
        self.core = core
        if old is not None:
            self.retired.append(old.stats())
            threading.Thread(target=old.close, name="slidingserve-close", daemon=True).start()
        return True

    def labels(self) -> dict[str, str]:
        """What the metrics endpoint's info family shows of the settings in force."""
        return {"address": self.settings.address, "policy": self.settings.policy, "profile": self.profile}

    def stats(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The current core's stats, and the reload counters with the settings in force."""
        core = self.core.stats() if self.core is not None else {}
        return core, {"settings_reloads": self.watcher.reloads, "settings_errors": self.watcher.errors,
                      "policy": self.settings.policy, "address": self.settings.address, "profile": self.profile}

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
            self.core = None
        if self.predictors is not None:
            self.predictors.close()
            self.predictors = None
