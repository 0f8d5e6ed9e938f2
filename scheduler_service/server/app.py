"""The embeddable server (:class:`SchedulerServer`) and the blocking :func:`serve` of one process.

Lifecycle, and why:

1. bind and start gRPC with health NOT_SERVING — *liveness*: the process answers;
2. load the default policy and the bootstrap predictor, warm the hot path — then health
   turns SERVING (overall ``""`` and ``slidingserve.v1.SchedulerService``) — *readiness*;
3. on stop: health NOT_SERVING first (load balancers stop routing), then ``stop(grace)``
   rejects new calls and lets in-flight ones finish for up to ``grace_s`` seconds.

Security (TLS, mutual TLS, tokens, limits; see :mod:`.security` and ``docs/security.md``)
is set up before binding, so that a bad certificate or tokens file fails the start instead
of serving without the protection the operator configured.

Several worker processes on one port are :mod:`.workers`' (it imports this module, never
the other way round); ``scheduler_service.server.serve`` runs either.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from scheduler_service.core import BatchLatencyPredictor, Snapshot, ValidationError, default_predictor
from scheduler_service.core.kernels import warm_up as warm_kernels
from scheduler_service.predictors import PredictorRegistry, RefitSettings
from scheduler_service.recording import Recorder

from .board import PredictorBoard
from .config import ServerConfig
from .deployments import PolicyConfig, PolicyConfigWatcher, PolicySet, ShadowRunner
from .handlers import SERVICE_NAME, add_servicer
from .logs import configure_logging
from .metrics import Metrics
from .security import CertificateReloader, SecurityInterceptor, build_interceptor, server_credentials
from .servicer import PolicyCache, SchedulerServicer

__all__ = ["SERVICE_NAME", "SchedulerServer", "serve", "stop_on_signals"]

log = structlog.get_logger("slidingserve.server")


def _load_predictor(config: ServerConfig) -> BatchLatencyPredictor:
    if not config.predictor_file:
        return default_predictor()
    try:
        text = Path(config.predictor_file).read_text()
    except OSError as e:
        raise ValidationError.single("predictor_file", f"cannot read {config.predictor_file}: {e}") from None
    return BatchLatencyPredictor.from_json(text)


class SchedulerServer:
    """``with SchedulerServer(ServerConfig(port=0)) as srv: ... srv.port ...``"""

    def __init__(self, config: ServerConfig | None = None, *, reuse_port: bool = False) -> None:
        """``reuse_port``: bind with SO_REUSEPORT, as one of several workers on one port
        (:mod:`.workers`); off by default, so that a second server on a taken port fails."""
        self.config = config or ServerConfig()
        self._reuse_port = int(reuse_port)
        #: Refits shared with the other workers (``config.predictor_dir``), None without.
        self.board: PredictorBoard | None = None
        self.metrics = Metrics()
        self.port = 0
        self.metrics_port = 0
        self.health = health.HealthServicer()
        self.predictors: PredictorRegistry | None = None
        self.policies: PolicySet | None = None
        self.shadow: ShadowRunner | None = None
        self.policy_watcher: PolicyConfigWatcher | None = None
        self.servicer: SchedulerServicer | None = None
        self.security: SecurityInterceptor | None = None
        self.certificates: CertificateReloader | None = None
        #: Port of the plaintext health-only server (``config.health_port``), 0 when none.
        self.health_port = 0
        self._server: grpc.Server | None = None
        self._health_server: grpc.Server | None = None
        self._stopped = threading.Event()

    @property
    def target(self) -> str:
        """Address a local client should dial."""
        return self.config.dial_target(self.port)

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> SchedulerServer:
        cfg = self.config
        configure_logging(cfg.log_level)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        bootstrap = _load_predictor(cfg)  # fail fast on a bad file, before binding
        tls = server_credentials(cfg)  # likewise certificates and tokens
        self.security = build_interceptor(cfg, self.metrics)
        if cfg.auth_tokens_file and tls is None:
            log.warning("tokens_without_tls", hint="bearer tokens travel in plaintext; set tls_cert_file "
                        "unless every client is on loopback or a trusted network")
        predictors = self._start_predictors(bootstrap)
        try:  # a bad policy config or a port taken fails the start, like a bad predictor
            servicer = self._start_policies(predictors)
            if self._reuse_port:  # one of several workers: the kernel gives new connections to
                self._load()  # every socket on the port, so a worker binds only once it can decide
            server = self._bind(servicer, tls)
            if cfg.health_port:
                self._start_health_server()
        except Exception:
            predictors.close()
            raise
        server.start()
        self._server = server
        if not self._reuse_port:  # alone on the port: live (NOT_SERVING) while it loads
            self._load()
        self._start_side_services()
        servicer.ready.set()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("server_started", address=cfg.address, port=self.port, metrics_port=self.metrics_port,
                 default_policy=cfg.default_policy, predictor_version=bootstrap.version,
                 tls=tls is not None, mutual_tls=bool(cfg.tls_client_ca_file),
                 tokens=bool(cfg.auth_tokens_file), health_port=self.health_port)
        return self

    def _start_predictors(self, bootstrap: BatchLatencyPredictor) -> PredictorRegistry:
        """The predictor registry, and the board of refits shared with the other workers."""
        cfg = self.config
        # each RefitSettings field is the config's refit_<field>, or max_profiles(_per_tenant) as is
        refit = RefitSettings(**{n: getattr(cfg, f"refit_{n}") if hasattr(cfg, f"refit_{n}") else getattr(cfg, n)
                                 for n in RefitSettings.__dataclass_fields__})
        self.predictors = predictors = PredictorRegistry(bootstrap, refit, self.metrics, on_publish=self._publish)
        if cfg.predictor_dir:  # before serving: a restarted worker starts from the latest refits
            self.board = PredictorBoard(cfg.predictor_dir, predictors, cfg.predictor_sync_s)
            self.board.poll()
        return predictors

    def _start_policies(self, predictors: PredictorRegistry) -> SchedulerServicer:
        """The policy cache, the deployments of the policy config, the shadow runner and the servicer."""
        cfg = self.config
        policies = PolicyCache()
        pconf = PolicyConfig.from_file(cfg.policy_config) if cfg.policy_config else None
        self.policies = PolicySet(cfg.default_policy, policies, pconf)
        self.shadow = ShadowRunner(self.policies, self.metrics)
        self._note_policy_config(pconf)
        recorder = Recorder.within(cfg.record, cfg.record_max_mb, source="service") if cfg.record else None
        self.servicer = SchedulerServicer(cfg, predictors, self.metrics, policies,
                                          policyset=self.policies, shadow=self.shadow, recorder=recorder)
        return self.servicer

    def _bind(self, servicer: SchedulerServicer,
              tls: tuple[grpc.ServerCredentials, CertificateReloader] | None) -> grpc.Server:
        """The gRPC server with its services (scheduler, health, reflection), bound to the port."""
        cfg = self.config
        server = grpc.server(
            ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", self._reuse_port),
            ],
            interceptors=[self.security] if self.security is not None else None,
        )
        add_servicer(servicer, server)  # never-raising request decoding (handlers.py)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        if tls is None:
            port = server.add_insecure_port(cfg.address)
        else:
            port = server.add_secure_port(cfg.address, tls[0])
            self.certificates = tls[1]
        if port == 0:
            raise OSError(f"cannot bind {cfg.address}")
        self.port = port
        return server

    def _start_side_services(self) -> None:
        """The metrics endpoint, the policy config's watcher and the shared board's sync."""
        cfg = self.config
        if cfg.metrics_port:
            self.metrics_port = self.metrics.serve_http(
                "127.0.0.1" if self.target.startswith("127.") else cfg.host.strip("[]"),
                max(cfg.metrics_port, 0),
            )
        if cfg.policy_config:
            assert self.policies is not None
            self.policy_watcher = PolicyConfigWatcher(
                cfg.policy_config, self.policies, self.metrics, cfg.policy_config_poll_s,
                on_swap=self._note_policy_config).start()
        if self.board is not None:
            self.board.start()

    def _start_health_server(self) -> None:
        """Plaintext, health-only: probes (kubelet's gRPC probe, load balancers) speak
        neither TLS nor mutual TLS, and this port reveals nothing but SERVING/NOT_SERVING."""
        hs = grpc.server(ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-health"),
                         options=[("grpc.so_reuseport", self._reuse_port)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
        address = f"{self.config.host}:{self.config.health_port}"
        self.health_port = hs.add_insecure_port(address)
        if self.health_port == 0:
            raise OSError(f"cannot bind {address}")
        hs.start()
        self._health_server = hs

    def _publish(self, key: str, predictor: BatchLatencyPredictor) -> None:
        """A local refit was published: tell the other workers (no-op without a board)."""
        if self.board is not None:
            self.board.publish(key, predictor)

    def _note_policy_config(self, c: PolicyConfig | None) -> None:
        if c is not None:
            self.metrics.policy_config.info({"digest": c.digest, "default": c.default, "shadow": c.shadow,
                                             "deployments": ",".join(sorted(c.deployments))})

    def _load(self) -> None:
        """Load the default policy and warm the decision path (first-call numpy costs); a
        failure stops the server and raises."""
        assert self.predictors is not None and self.policies is not None
        try:
            policy, _ = self.policies.resolve("", {})
            snap = Snapshot.from_columns(
                now=1.0, max_batch_tokens=64, max_num_seqs=4, ids=["warm-d", "warm-p"],
                arrival=np.array([0.0, 0.5]), prompt_tokens=np.array([8, 100]),
                computed_tokens=np.array([8, 0]), output_tokens=np.array([2, 0]),
                ttft_slo=np.array([1.0, 1.0]), tbt_slo=np.array([0.1, 0.1]), protected=np.array([False, False]),
            )
            # Compile (or load from the on-disk cache) the policy kernels now, before this
            # process is SERVING or joins a shared port, never on an engine's first decision.
            warm_kernels()
            policy.plan(snap, self.predictors.bootstrap)
            # The first refit would import scikit-learn (about a second, mostly holding the GIL)
            # in the middle of serving; pay it here, before the server reports SERVING.
            import sklearn.linear_model  # noqa: F401  (deliberately here: this is when it is paid)
        except Exception:
            self.stop(0)
            raise

    def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, reject new calls, wait up to ``grace`` s for in-flight ones."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        g = self.config.grace_s if grace is None else grace
        self.health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(g).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        recorder = self.servicer.recorder if self.servicer is not None else None
        parts: tuple[Any, ...] = (self.board, self.policy_watcher, self.shadow, recorder, self.predictors)
        for part in parts:
            if part is not None:
                part.close()
        self.metrics.close()
        log.info("server_stopped", port=self.port)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates (or ``timeout``); True when it did."""
        assert self._server is not None
        return bool(self._server.wait_for_termination(timeout))

    def __enter__(self) -> SchedulerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGTERM/SIGINT set while the block runs; the previous handlers are
    restored after it (the main thread only, as for any signal handler)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def serve(config: ServerConfig) -> None:
    """Run one server process until SIGTERM/SIGINT, then shut down gracefully
    (``config.grace_s``).  ``config.workers`` > 1 is the supervisor's:
    ``scheduler_service.server.serve`` (:func:`.workers.serve`) runs either."""
    if config.workers > 1:
        raise ValueError(f"workers={config.workers}: several processes are run by "
                         "scheduler_service.server.serve (the supervisor), not by app.serve")
    with stop_on_signals() as stop:
        server = SchedulerServer(config).start()
        gc.freeze()  # start-up objects (modules, policies, predictors) are never scanned again
        try:
            while not stop.wait(0.5):
                pass
        finally:
            server.stop()
