"""Server configuration: one typed, validated dataclass on the settings kit
(:mod:`scheduler_service.settings`).

Loaded from a YAML, TOML or JSON file (``--config FILE``, by extension) whose keys are the
field names below; unknown keys and wrong types are errors, not silently ignored, because a
typo in a deployment config (``refit_evry``) would otherwise fall back to a default nobody
chose.  Errors are :class:`~scheduler_service.core.ValidationError` naming the field, so
that the CLI prints them like any other bad input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler_service.core import FieldViolation, ValidationError
from scheduler_service.core.snapshot import MAX_REQUESTS
from scheduler_service.settings import Checks, read_document, type_violations, unknown_keys

__all__ = ["LOG_LEVELS", "REASONS_MODES", "ServerConfig", "read_document"]

LOG_LEVELS = ("debug", "info", "warning", "error")
#: Which plans carry their reasons in the compact wire form (``ServerConfig.reasons``).
REASONS_MODES = ("every", "sampled")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    #: Address to bind; "0.0.0.0" for all IPv4 interfaces, "[::]" for all, "127.0.0.1" local only.
    host: str = "0.0.0.0"
    #: gRPC port; 0 picks a free port (see ``SchedulerServer.port``).
    port: int = 50051
    #: Policy used when a request names none.
    default_policy: str = "slidingserve"
    #: Largest gRPC message accepted or sent (bytes).
    max_message_bytes: int = 64 * 1024 * 1024
    #: Largest number of requests in one snapshot (and in one reported batch).
    max_requests_per_snapshot: int = 100_000
    #: Prometheus HTTP port; 0 disables metrics, -1 picks a free port (tests, embedding).
    metrics_port: int = 0
    #: Refit a profile's predictor after this many new accepted reports.
    refit_every: int = 256
    #: Sliding window of recent reports a refit uses, per profile (bounds memory).
    refit_window: int = 4096
    #: Fraction of the window (the most recent reports) held out to compare old vs new model.
    refit_holdout_fraction: float = 0.2
    #: A scenario model is fitted only with at least this many samples (else global fallback).
    refit_min_samples: int = 30
    #: A refit replaces the current model only if its held-out MAE is this fraction lower.
    refit_min_gain: float = 0.02
    #: Share of held-out measured/predicted ratios the learned margin covers (0 = margin 1).
    refit_margin_quantile: float = 0.9
    #: Cap of the learned margin.
    refit_max_margin: float = 2.0
    #: The current model is republished with a new margin only when it moved this much.
    refit_margin_hysteresis: float = 0.1
    #: Most engine profiles with their own predictor (reports for more are rejected).
    max_profiles: int = 64
    #: Seconds that shutdown waits for in-flight calls before cancelling them.
    grace_s: float = 5.0
    #: gRPC worker threads; each open ScheduleStream/ReportIterations holds one.
    max_workers: int = 32
    #: Bootstrap predictor JSON file for every profile; empty uses the packaged default.
    predictor_file: str = ""
    #: Log level: debug, info, warning or error.
    log_level: str = "info"
    #: Explain one decision in this many (0 = never): its plan carries the reasons why
    #: requests wait (returned to the engine) and sets ``slidingserve_requests_waiting_by_reason``.
    explain_every: int = 16
    #: Which plans carry the reasons why requests wait in the compact wire form (plan
    #: fields 16-19, docs/reasons.md): "every" plan, or only the "sampled" ones (one in
    #: ``explain_every``, and those a request asks for).  Either way the sampled and asked
    #: plans also carry them as PlanReason messages (field 15), as before.
    reasons: str = "sampled"
    # deployments (scheduler_service/server/deployments.py)
    #: Policy config file (YAML/TOML/JSON): named deployments side by side, the default, a shadow.
    #: Re-read on change; a bad file is refused and the last good one keeps serving.  Empty:
    #: no deployments, requests name registry policies and ``default_policy`` applies.
    policy_config: str = ""
    #: Seconds between checks of the policy config file for changes.
    policy_config_poll_s: float = 2.0
    # several processes (scheduler_service/server/workers.py, docs/operations.md)
    #: Worker processes sharing the gRPC port (SO_REUSEPORT); 1 = one process, as before.
    #: Decisions hold the GIL, so decisions/s grow with workers up to the cores.  Honoured
    #: by ``serve`` (the CLI) and ``MultiProcessServer``; an embedded ``SchedulerServer`` is
    #: always the one process it runs in.
    workers: int = 1
    #: Directory where workers publish refitted predictors for each other; empty = a fresh
    #: temporary directory, removed at exit.  A directory that outlives the service makes a
    #: restarted service start from the predictors last published.
    predictor_dir: str = ""
    #: Seconds between a worker's looks at the other workers' publications: a refit on one
    #: worker is served by all within about this long.
    predictor_sync_s: float = 0.5
    #: An engine unseen this long is dropped from the engine table (metrics, logs).
    engine_ttl_s: float = 300.0
    #: Most engines tracked; beyond it the least recently seen is evicted (bounded memory).
    max_engines: int = 10_000

    # security (docs/security.md; enforced by scheduler_service/server/security.py)
    #: PEM certificate chain and private key of the server; both set = TLS on the gRPC port.
    #: The files are re-read when they change (certificate rotation without a restart).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: PEM CA bundle for client certificates; set = mutual TLS (a client without a
    #: certificate signed by one of these CAs fails the handshake).  Needs tls_cert_file.
    tls_client_ca_file: str = ""
    #: YAML/JSON file of accepted tokens: identity → {sha256, tenant, scopes}; set = every
    #: SchedulerService call needs ``authorization: Bearer <token>``.  Re-read on change.
    auth_tokens_file: str = ""
    #: Refuse to start without an authentication method (tokens or mutual TLS), so that a
    #: production config that lost its secrets fails loudly instead of serving openly.
    require_auth: bool = False
    #: Messages per second per identity (token identity, client certificate CN, or client
    #: IP when unauthenticated): a unary call or one message of a stream; 0 = no limit.
    rate_limit_rps: float = 0.0
    #: Token-bucket depth: messages an identity may send at once above the steady rate.
    rate_limit_burst: int = 200
    #: Open streams (ScheduleStream, ReportIterations) per identity; 0 = no limit.  Each
    #: open stream holds a worker thread, so this keeps one tenant from taking them all.
    max_streams_per_identity: int = 0
    #: Profiles with their own predictor per tenant (when authenticated); 0 = only max_profiles.
    max_profiles_per_tenant: int = 0
    # recording (scheduler_service/recording.py; `slidingserve whatif`, docs/operations.md)
    #: Directory of a bounded, rotating recording of every engine's traffic (the requests'
    #: shapes, SLOs and outcomes, the iterations' costs; no prompt text); empty = none.
    record: str = ""
    #: Bound on the recording's size on disk, per worker process (MiB); the oldest files go first.
    record_max_mb: int = 256
    #: Longest a WhatIf call may run (seconds); it runs in its own process.
    whatif_timeout_s: float = 600.0
    #: Plaintext port serving only grpc.health.v1 (for probes that cannot do (m)TLS); 0 = none.
    health_port: int = 0

    def __post_init__(self) -> None:
        errs = type_violations(self)
        if errs:
            raise ValidationError(errs)
        c = Checks(self)
        check = c.check
        check("host", bool(self.host), "must not be empty")
        check("port", 0 <= self.port <= 65535, "must be in [0, 65535]")
        check("default_policy", bool(self.default_policy), "must not be empty")
        check("max_message_bytes", 1024 <= self.max_message_bytes <= 2**31 - 1, "must be in [1024, 2^31-1]")
        check("max_requests_per_snapshot", 1 <= self.max_requests_per_snapshot <= MAX_REQUESTS,
              f"must be in [1, {MAX_REQUESTS}]")
        check("metrics_port", -1 <= self.metrics_port <= 65535, "must be in [-1, 65535]")
        check("refit_every", self.refit_every >= 1, "must be >= 1")
        check("refit_window", self.refit_window >= 10, "must be >= 10")
        check("refit_holdout_fraction", 0.0 < self.refit_holdout_fraction < 1.0, "must be in (0, 1)")
        check("refit_min_samples", self.refit_min_samples >= 2, "must be >= 2")
        check("refit_min_gain", 0.0 <= self.refit_min_gain < 1.0, "must be in [0, 1)")
        check("refit_margin_quantile", 0.0 <= self.refit_margin_quantile < 1.0, "must be in [0, 1)")
        check("refit_max_margin", 1.0 <= self.refit_max_margin <= 10.0, "must be in [1, 10]")
        check("refit_margin_hysteresis", 0.0 <= self.refit_margin_hysteresis <= 10.0, "must be in [0, 10]")
        check("max_profiles", self.max_profiles >= 1, "must be >= 1")
        check("grace_s", 0.0 <= self.grace_s <= 3600.0, "must be in [0, 3600]")
        check("max_workers", 1 <= self.max_workers <= 4096, "must be in [1, 4096]")
        check("explain_every", 0 <= self.explain_every <= 1_000_000, "must be in [0, 1000000]")
        check("reasons", self.reasons in REASONS_MODES, f"must be one of {list(REASONS_MODES)}")
        check("log_level", self.log_level in LOG_LEVELS, f"must be one of {list(LOG_LEVELS)}")
        check("policy_config_poll_s", 0.05 <= self.policy_config_poll_s <= 3600, "must be in [0.05, 3600]")
        check("workers", 1 <= self.workers <= 256, "must be in [1, 256]")
        check("predictor_sync_s", 0.01 <= self.predictor_sync_s <= 3600, "must be in [0.01, 3600]")
        check("engine_ttl_s", 0.01 <= self.engine_ttl_s <= 86400 * 30, "must be in [0.01, 2592000]")
        check("max_engines", 1 <= self.max_engines <= 10_000_000, "must be in [1, 10000000]")
        check("record_max_mb", 1 <= self.record_max_mb <= 1 << 20, "must be in [1, 1048576]")
        check("whatif_timeout_s", 1.0 <= self.whatif_timeout_s <= 86400, "must be in [1, 86400]")
        # security
        check("tls_key_file", bool(self.tls_cert_file) == bool(self.tls_key_file),
              "must be set together with tls_cert_file")
        check("tls_client_ca_file", not self.tls_client_ca_file or bool(self.tls_cert_file),
              "needs tls_cert_file and tls_key_file (mutual TLS is TLS first)")
        check("require_auth", not self.require_auth or bool(self.auth_tokens_file or self.tls_client_ca_file),
              "needs auth_tokens_file or tls_client_ca_file")
        check("rate_limit_rps", 0.0 <= self.rate_limit_rps <= 1e7, "must be in [0, 1e7]")
        check("rate_limit_burst", self.rate_limit_burst >= 1, "must be >= 1")
        check("max_streams_per_identity", self.max_streams_per_identity >= 0, "must be >= 0")
        check("max_profiles_per_tenant", self.max_profiles_per_tenant >= 0, "must be >= 0")
        check("health_port", 0 <= self.health_port <= 65535 and (self.health_port == 0 or self.health_port != self.port),
              "must be in [0, 65535] and differ from port")
        c.raise_if_any()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ServerConfig:
        if not isinstance(data, Mapping):
            raise ValidationError.single("config", "must be a mapping of option names to values")
        unknown, known = unknown_keys(cls, data)
        if unknown:
            raise ValidationError([FieldViolation(str(k), f"unknown option; valid: {', '.join(sorted(known))}")
                                   for k in unknown])
        return cls(**dict(data))

    @classmethod
    def from_file(cls, path: str | Path) -> ServerConfig:
        """Load ``.yaml``/``.yml``, ``.toml`` or ``.json``."""
        return cls.from_mapping(read_document(path, "config") or {})

