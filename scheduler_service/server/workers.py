"""Several service processes on one port: decisions/s that grow with cores.

A decision is mostly Python and holds the GIL, so one process serves about one core's worth
of decisions however many threads it has.  ``workers: N`` (``slidingserve serve --workers
N``) runs N worker processes, each a complete :class:`~.app.SchedulerServer`, all listening
on the same port with ``SO_REUSEPORT``: the kernel hands each new TCP connection to one of
them.  Why this shape, and what it means (docs/operations.md, "Several workers"):

* **Affinity.**  A gRPC channel is one TCP connection, so everything an engine sends on it
  (its ScheduleStream, unary calls, ReportIterations) lands on one worker for the
  connection's life; workers share nothing on the hot path.
* **A supervisor, not a load balancer.**  The parent process only reserves the port (a
  bound, never listening ``SO_REUSEPORT`` socket, so that port 0 resolves once for all and
  nobody else takes the port between restarts), starts the workers (``spawn``: no gRPC state
  crosses a fork), restarts a worker that dies, and forwards SIGTERM/SIGINT for a drain.
* **Predictors.**  A worker refits from the reports its own connections send.  Each
  publication is written to :class:`~.board.PredictorBoard` (one JSON file per profile in
  ``predictor_dir``, replaced atomically) and every worker polls the board every
  ``predictor_sync_s``: a refit on one worker is served by all within about that long, and
  the newest publication wins (eventual consistency, last writer wins; a plan names the
  predictor version it used, so any plan can still be replayed exactly).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog

from .board import PredictorBoard  # its home before board.py: still importable here
from .config import ServerConfig
from .logs import bind_process, configure_logging

__all__ = ["MultiProcessServer", "PredictorBoard", "reserve_port", "serve", "serve_workers"]

log = structlog.get_logger("slidingserve.server")

#: Seconds a worker may take from spawn to SERVING (imports, predictor, warm-up, kernels).
START_TIMEOUT_S = 180.0
#: A worker that dies sooner than this after its start is restarted only after a back-off
#: (1 s, doubling up to RESTART_MAX_S): a worker that cannot start must not spin.
STABLE_S = 10.0
RESTART_MAX_S = 30.0


# ------------------------------------------------------------------------ port
def reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) ``SO_REUSEPORT`` socket on ``host:port``; port 0 picks one.
    Workers bind the same port with ``grpc.so_reuseport``; this one holds it meanwhile."""
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------------- worker
def _worker_main(config: dict[str, Any], index: int, conn: Connection) -> None:
    """One worker process: a full server on the shared port until SIGTERM/SIGINT or until
    the supervisor is gone (then nobody would restart or stop it)."""
    from .app import SchedulerServer  # in the child: the parent never builds a gRPC server

    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    parent = os.getppid()
    cfg = ServerConfig.from_mapping(config)
    bind_process(worker=index)
    server = SchedulerServer(cfg, reuse_port=True).start()
    gc.freeze()  # start-up objects (modules, policies, predictors) are never scanned again
    conn.send({"index": index, "pid": os.getpid(), "port": server.port,
               "metrics_port": server.metrics_port, "health_port": server.health_port})
    try:
        while not stop.wait(0.5):
            if os.getppid() != parent:
                log.warning("supervisor_gone", worker=index)
                break
    finally:
        server.stop()


@dataclass(eq=False)
class _Worker:
    index: int
    process: Any
    conn: Connection
    started: float
    failures: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    #: When an exited worker is due to be restarted (monotonic seconds); None while it runs.
    restart_at: float | None = None


# ------------------------------------------------------------------ supervisor
class MultiProcessServer:
    """``with MultiProcessServer(ServerConfig(port=0, workers=2)) as srv: ... srv.port ...``"""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = 0
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._reserved: socket.socket | None = None
        self._own_dir = ""
        self._worker_config: dict[str, Any] = {}
        self._stopping = False

    @property
    def target(self) -> str:
        """Address a local client should dial."""
        return self.config.dial_target(self.port)

    @property
    def workers(self) -> list[dict[str, Any]]:
        """index, pid, port, metrics_port, health_port of each worker that is up."""
        return [dict(w.info) for w in self._workers if w.info and w.process.is_alive()]

    def start(self) -> MultiProcessServer:
        cfg = self.config
        configure_logging(cfg.log_level)
        self._reserved = reserve_port(cfg.host, cfg.port)
        self.port = self._reserved.getsockname()[1]
        health = reserve_port(cfg.host, cfg.health_port) if cfg.health_port else None
        directory = cfg.predictor_dir or tempfile.mkdtemp(prefix="slidingserve-predictors-")
        self._own_dir = "" if cfg.predictor_dir else directory
        self._worker_config = {**cfg.to_dict(), "port": self.port, "workers": 1, "predictor_dir": directory}
        try:
            for i in range(cfg.workers):
                self._workers.append(self._spawn(i))
            for w in self._workers:
                self._await_ready(w)
        except Exception:
            self.stop(0)
            raise
        finally:
            if health is not None:
                health.close()  # the workers hold it now
        log.info("server_started", address=cfg.address, port=self.port, workers=cfg.workers,
                 worker_pids=[w.info["pid"] for w in self._workers], predictor_dir=directory,
                 metrics_ports=[w.info["metrics_port"] for w in self._workers])
        return self

    def _spawn(self, index: int, failures: int = 0) -> _Worker:
        cfg = dict(self._worker_config)
        if cfg["metrics_port"] > 0:
            cfg["metrics_port"] += index  # one scrape target per worker (docs/operations.md)
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_worker_main, args=(cfg, index, child), name=f"slidingserve-worker-{index}",
                                 daemon=False)
        proc.start()
        child.close()
        return _Worker(index, proc, parent, time.monotonic(), failures)

    def _await_ready(self, w: _Worker, timeout: float = START_TIMEOUT_S) -> None:
        ready = wait([w.conn, w.process.sentinel], timeout)
        if w.conn in ready:
            with contextlib.suppress(EOFError):
                w.info = w.conn.recv()
                log.info("worker_started", **w.info)
                return
        raise RuntimeError(f"worker {w.index} did not start (exit code {w.process.exitcode}); see its log above")

    def supervise(self, timeout: float = 0.5, stop: threading.Event | None = None) -> None:
        """Wait up to ``timeout`` s for a worker to exit; restart exited workers (after a
        back-off when one keeps dying young).  Call it in a loop (:func:`serve_workers`);
        once ``stop`` is set nothing is restarted (Ctrl-C reaches the workers too)."""
        sentinels = [w.process.sentinel for w in self._workers]
        wait(sentinels, timeout)
        if stop is not None and stop.is_set():
            return
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if self._stopping or w.process.is_alive():
                continue
            if w.restart_at is None:
                young = now - w.started < STABLE_S
                w.failures = w.failures + 1 if young else 0
                delay = min(RESTART_MAX_S, 2.0 ** (w.failures - 1)) if young else 0.0
                w.restart_at = now + delay
                log.warning("worker_exited", index=w.index, pid=w.process.pid, exit_code=w.process.exitcode,
                            restart_in_s=delay)
            if now >= w.restart_at:
                self._workers[i] = fresh = self._spawn(i, w.failures)
                try:
                    self._await_ready(fresh)
                except RuntimeError as e:  # retried with back-off by the next calls
                    log.error("worker_restart_failed", index=i, error=str(e))

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every worker (each drains like a single server), wait, then SIGKILL."""
        self._stopping = True
        g = self.config.grace_s if grace is None else grace
        for w in self._workers:
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + g + 10.0
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5.0)
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        log.info("server_stopped", port=self.port, workers=len(self._workers))

    def __enter__(self) -> MultiProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_workers(config: ServerConfig, stop: threading.Event) -> None:
    """Run ``config.workers`` workers until ``stop`` is set (by the caller's signal handler)."""
    server = MultiProcessServer(config).start()
    try:
        while not stop.is_set():
            server.supervise(0.5, stop)
    finally:
        server.stop()


def serve(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully (``config.grace_s``): one server
    process, or with ``config.workers`` > 1 a supervisor of that many worker processes.
    ``scheduler_service.server.serve``, the CLI's ``slidingserve serve``."""
    from .app import serve as serve_one  # deferred: importing the supervisor loads no gRPC server
    from .app import stop_on_signals

    if config.workers <= 1:
        serve_one(config)
        return
    with stop_on_signals() as stop:
        serve_workers(config, stop)
