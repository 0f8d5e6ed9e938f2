"""Server configuration: one typed, validated dataclass on the settings kit
(:mod:`scheduler_service.settings`).

Loaded from a YAML, TOML or JSON file (``--config FILE``, by extension) whose keys are the
field names below; unknown keys and wrong types are errors, not silently ignored, because a
typo in a deployment config (``refit_evry``) would otherwise fall back to a default nobody
chose.  Errors are :class:`~scheduler_service.core.ValidationError` naming the field, so
that the CLI prints them like any other bad input.  A numeric option's range is written
next to it (:func:`_in`).
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


def _in(default: float, bounds: str) -> Any:
    """A field whose value must lie in ``bounds``: ``"[lo, hi]"`` (a round bracket leaves
    that end out) or ``">= lo"``; the error says "must be in [lo, hi]" / "must be >= lo"."""
    return dataclasses.field(default=default, metadata={"bounds": bounds})


def _within(value: float, bounds: str) -> bool:
    if bounds.startswith(">="):
        return value >= float(bounds[2:])
    lo, hi = (float(x) for x in bounds[1:-1].split(","))
    return (lo < value if bounds[0] == "(" else lo <= value) and (value < hi if bounds[-1] == ")" else value <= hi)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    #: Address to bind; "0.0.0.0" for all IPv4 interfaces, "[::]" for all, "127.0.0.1" local only.
    host: str = "0.0.0.0"
    #: gRPC port; 0 picks a free port (see ``SchedulerServer.port``).
    port: int = _in(50051, "[0, 65535]")
    #: Policy used when a request names none.
    default_policy: str = "slidingserve"
    #: Largest gRPC message accepted or sent (bytes).
    max_message_bytes: int = _in(64 * 1024 * 1024, "[1024, 2147483647]")
    #: Largest number of requests in one snapshot (and in one reported batch).
    max_requests_per_snapshot: int = _in(100_000, f"[1, {MAX_REQUESTS}]")
    #: Prometheus HTTP port; 0 disables metrics, -1 picks a free port (tests, embedding).
    metrics_port: int = _in(0, "[-1, 65535]")
    #: Refit a profile's predictor after this many new accepted reports.
    refit_every: int = _in(256, ">= 1")
    #: Sliding window of recent reports a refit uses, per profile (bounds memory).
    refit_window: int = _in(4096, ">= 10")
    #: Fraction of the window (the most recent reports) held out to compare old vs new model.
    refit_holdout_fraction: float = _in(0.2, "(0, 1)")
    #: A scenario model is fitted only with at least this many samples (else global fallback).
    refit_min_samples: int = _in(30, ">= 2")
    #: A refit replaces the current model only if its held-out MAE is this fraction lower.
    refit_min_gain: float = _in(0.02, "[0, 1)")
    #: Share of held-out measured/predicted ratios the learned margin covers (0 = margin 1).
    refit_margin_quantile: float = _in(0.9, "[0, 1)")
    #: Cap of the learned margin.
    refit_max_margin: float = _in(2.0, "[1, 10]")
    #: The current model is republished with a new margin only when it moved this much.
    refit_margin_hysteresis: float = _in(0.1, "[0, 10]")
    #: Most engine profiles with their own predictor (reports for more are rejected).
    max_profiles: int = _in(64, ">= 1")
    #: Seconds that shutdown waits for in-flight calls before cancelling them.
    grace_s: float = _in(5.0, "[0, 3600]")
    #: gRPC worker threads; each open ScheduleStream/ReportIterations holds one.
    max_workers: int = _in(32, "[1, 4096]")
    #: Bootstrap predictor JSON file for every profile; empty uses the packaged default.
    predictor_file: str = ""
    #: Log level: debug, info, warning or error.
    log_level: str = "info"
    #: Explain one decision in this many (0 = never): its plan carries the reasons why
    #: requests wait (returned to the engine) and sets ``slidingserve_requests_waiting_by_reason``.
    explain_every: int = _in(16, "[0, 1000000]")
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
    policy_config_poll_s: float = _in(2.0, "[0.05, 3600]")
    # several processes (scheduler_service/server/workers.py, docs/operations.md)
    #: Worker processes sharing the gRPC port (SO_REUSEPORT); 1 = one process.  Decisions
    #: hold the GIL, so decisions/s grow with workers up to the cores.  Honoured by ``serve``
    #: (the CLI) and ``MultiProcessServer``; an embedded ``SchedulerServer`` is one process.
    workers: int = _in(1, "[1, 256]")
    #: Directory where workers publish refitted predictors for each other; empty = a fresh
    #: temporary directory, removed at exit.  A directory that outlives the service makes a
    #: restarted service start from the predictors last published.
    predictor_dir: str = ""
    #: Seconds between a worker's looks at the other workers' publications: a refit on one
    #: worker is served by all within about this long.
    predictor_sync_s: float = _in(0.5, "[0.01, 3600]")
    #: An engine unseen this long is dropped from the engine table (metrics, logs).
    engine_ttl_s: float = _in(300.0, "[0.01, 2592000]")
    #: Most engines tracked; beyond it the least recently seen is evicted (bounded memory).
    max_engines: int = _in(10_000, "[1, 10000000]")

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
    rate_limit_rps: float = _in(0.0, "[0, 1e7]")
    #: Token-bucket depth: messages an identity may send at once above the steady rate.
    rate_limit_burst: int = _in(200, ">= 1")
    #: Open streams (ScheduleStream, ReportIterations) per identity; 0 = no limit.  Each
    #: open stream holds a worker thread, so this keeps one tenant from taking them all.
    max_streams_per_identity: int = _in(0, ">= 0")
    #: Profiles with their own predictor per tenant (when authenticated); 0 = only max_profiles.
    max_profiles_per_tenant: int = _in(0, ">= 0")
    # recording (scheduler_service/recording.py; `slidingserve whatif`, docs/operations.md)
    #: Directory of a bounded, rotating recording of every engine's traffic (the requests'
    #: shapes, SLOs and outcomes, the iterations' costs; no prompt text); empty = none.
    record: str = ""
    #: Bound on the recording's size on disk, per worker process (MiB); the oldest files go first.
    record_max_mb: int = _in(256, "[1, 1048576]")
    #: Longest a WhatIf call may run (seconds); it runs in its own process.
    whatif_timeout_s: float = _in(600.0, "[1, 86400]")
    #: Plaintext port serving only grpc.health.v1 (for probes that cannot do (m)TLS); 0 = none.
    health_port: int = 0

    def __post_init__(self) -> None:
        errs = type_violations(self)
        if errs:
            raise ValidationError(errs)
        c = Checks(self)
        for f in dataclasses.fields(self):
            if "bounds" in f.metadata:
                bounds = f.metadata["bounds"]
                c.check(f.name, _within(getattr(self, f.name), bounds),
                        f"must be {bounds}" if bounds[0] == ">" else f"must be in {bounds}")
        c.check("host", bool(self.host), "must not be empty")
        c.check("default_policy", bool(self.default_policy), "must not be empty")
        c.check("reasons", self.reasons in REASONS_MODES, f"must be one of {list(REASONS_MODES)}")
        c.check("log_level", self.log_level in LOG_LEVELS, f"must be one of {list(LOG_LEVELS)}")
        c.check("tls_key_file", bool(self.tls_cert_file) == bool(self.tls_key_file),
                "must be set together with tls_cert_file")
        c.check("tls_client_ca_file", not self.tls_client_ca_file or bool(self.tls_cert_file),
                "needs tls_cert_file and tls_key_file (mutual TLS is TLS first)")
        c.check("require_auth", not self.require_auth or bool(self.auth_tokens_file or self.tls_client_ca_file),
                "needs auth_tokens_file or tls_client_ca_file")
        hp = self.health_port
        c.check("health_port", hp == 0 or (0 < hp <= 65535 and hp != self.port),
                "must be in [0, 65535] and differ from port")
        c.raise_if_any()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def dial_target(self, port: int) -> str:
        """Address a local client should dial to reach ``port`` on this config's host."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::", "") else self.host
        return f"{host}:{port}"

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
