"""Prometheus metrics of one server instance.

Each :class:`Metrics` owns its own ``CollectorRegistry`` instead of the process-global one,
so that several embedded servers (tests, the demo) can live in one process without
"duplicated timeseries" errors.  Exposed on a separate HTTP port so that scraping never
competes with the gRPC port.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

__all__ = ["Metrics"]

#: Decision-latency buckets (seconds): the service targets sub-millisecond decisions.
DECISION_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6,
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
)
#: Predictor absolute-error buckets (milliseconds).
ERROR_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0)


class Metrics:
    """The server's metrics in a registry of their own, registered group by group."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._decision_metrics(r)
        self._predictor_metrics(r)
        self._call_metrics(r)
        self._deployment_metrics(r)
        self._fleet_metrics(r)
        self.known_engine_deployments: set[str] = set()
        self._http: Any = None
        self._lock = threading.Lock()

    def _decision_metrics(self, r: CollectorRegistry) -> None:
        """Decisions: how many, which failed, the server's time per decision."""
        self.decisions = Counter(
            "slidingserve_decisions", "Scheduling decisions made", ["policy", "path"], registry=r
        )
        self.decision_errors = Counter(
            "slidingserve_decision_errors", "Scheduling requests that failed", ["code"], registry=r
        )
        self.decision_seconds = Histogram(
            "slidingserve_decision_seconds",
            "Server time per decision (decode, validate, plan, encode)",
            ["policy"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.waiting_by_reason = Gauge(
            "slidingserve_requests_waiting_by_reason",
            "Requests the latest explained plan does not fully serve, by reason code (one decision in "
            'explain_every is explained; deployment "" = a registry policy named directly)',
            ["deployment", "reason"], registry=r,
        )

    def _predictor_metrics(self, r: CollectorRegistry) -> None:
        """The per-profile predictors and the iteration reports that refit them."""
        self.predictor_abs_error_ms = Histogram(
            "slidingserve_predictor_abs_error_ms",
            "Absolute error of the current predictor vs each reported measured latency (ms)",
            ["profile"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.predictor_overruns = Counter(
            "slidingserve_predictor_overruns",
            "Reported iterations measured above the current prediction times the predictor's learned margin "
            '(margin="learned") or times 1 (margin="none")',
            ["profile", "margin"],
            registry=r,
        )
        self.reports = Counter(
            "slidingserve_reports", "Iteration reports received", ["result"], registry=r
        )
        self.refits = Counter(
            "slidingserve_predictor_refits", "Predictor refits by outcome", ["profile", "outcome"], registry=r
        )
        self.predictor_version = Info(
            "slidingserve_predictor", "Current predictor version per profile", ["profile"], registry=r
        )

    def _call_metrics(self, r: CollectorRegistry) -> None:
        """Open streams and the calls refused by authentication or the per-identity limits."""
        self.active_streams = Gauge(
            "slidingserve_active_streams", "Open ScheduleStream calls", registry=r
        )
        # security: labelled by the token identity / certificate name, never by anything the
        # caller chooses freely (unauthenticated callers are all "anonymous"), so bounded
        self.rate_limited = Counter(
            "slidingserve_rate_limited", "Calls or stream messages refused by the per-identity limits",
            ["identity", "limit"], registry=r,
        )
        self.auth_failures = Counter(
            "slidingserve_auth_failures", "Calls refused by authentication or authorisation", ["reason"], registry=r
        )

    def _deployment_metrics(self, r: CollectorRegistry) -> None:
        """The policy config's deployments, its reloads and the shadow deployment."""
        # deployments (deployments.py): their names come from the operator's config, bounded.
        # Every series about a deployment labels it "deployment" (CHANGELOG.md: the *_version
        # aliases and the shadow series' "version" label are gone).
        self.deployment_decisions = Counter(
            "slidingserve_deployment_decisions", "Decisions by deployment of the policy config", ["deployment"],
            registry=r,
        )
        self.config_reloads = Counter(
            "slidingserve_policy_config_reloads", "Policy config reloads by result (a refused file keeps the last good one)",
            ["result"], registry=r,
        )
        self.policy_config = Info(
            "slidingserve_policy_config", "Policy config in force (digest, default and shadow deployment, deployments)", registry=r
        )
        self.shadow_decisions = Counter(
            "slidingserve_shadow_decisions",
            "Shadow decisions by result: same/different plan than the served one, error, dropped (busy)",
            ["deployment", "result"], registry=r,
        )
        self.shadow_token_delta = Histogram(
            "slidingserve_shadow_token_delta", "Shadow plan tokens minus served plan tokens", ["deployment"],
            buckets=(-2048, -512, -128, -32, -8, -1, 0, 1, 8, 32, 128, 512, 2048), registry=r,
        )
        self.shadow_latency_delta_ms = Histogram(
            "slidingserve_shadow_latency_delta_ms", "Shadow plan predicted latency minus served (ms)", ["deployment"],
            buckets=(-50, -20, -10, -5, -2, -1, 0, 1, 2, 5, 10, 20, 50), registry=r,
        )
        self.shadow_decision_seconds = Histogram(
            "slidingserve_shadow_decision_seconds", "Time the shadow deployment takes per decision", ["deployment"],
            buckets=DECISION_BUCKETS, registry=r,
        )

    def _fleet_metrics(self, r: CollectorRegistry) -> None:
        """The fleet (engines.py): gauges refreshed by the engine table's sweeps."""
        self.engines_active = Gauge(
            "slidingserve_engines_active", "Engines seen within engine_ttl_s", registry=r
        )
        self.engines_by_deployment = Gauge(
            "slidingserve_engines_by_deployment", "Active engines by the deployment of their last decision",
            ["deployment"], registry=r,
        )
        self.engines_removed = Counter(
            "slidingserve_engines_removed", "Engine records removed: expired (idle) or evicted (max_engines)",
            ["reason"], registry=r,
        )

    def serve_http(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; ``port`` 0 here means "any free port"."""
        with self._lock:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
            self._http = server
            return int(server.server_address[1])

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
                self._http = None
