"""Fault injection for the fleet fault tests and benchmarks (``tests/test_fleet_faults.py``,
``benchmarks/rolling_upgrade.py``): a real service process to kill and restart, a TCP relay
to cut, restore and slow the network, and a policy with a switchable fault.

Each fault is caused the way it happens in production wherever that is possible:

* :class:`ServiceProcess` — ``slidingserve serve`` in its own process on a fixed loopback
  port; :meth:`~ServiceProcess.kill` is SIGKILL (no graceful shutdown, connections reset by
  the kernel) and :meth:`~ServiceProcess.start` again comes back on the same port.
* :class:`TcpProxy` — a byte relay between engine and service: :meth:`~TcpProxy.cut`
  resets every connection and refuses new ones (a partition, a crashed load balancer),
  :meth:`~TcpProxy.restore` accepts again, ``delay_s`` holds every chunk back in both
  directions (a slow network or an overloaded host: the reply arrives late).
* :class:`FaultyPolicy` — the only stand-in: a service that answers with errors or with
  plans that do not fit the engine cannot be produced on demand otherwise.  It wraps the
  real policy and goes into a running server's policy cache, so decode, validation, the
  servicer's error handling and encoding all stay real.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_service.core import Allocation, BatchLatencyPredictor, Plan, Snapshot, registry

__all__ = ["FaultyPolicy", "ServiceProcess", "TcpProxy", "free_port"]

#: The folder holding the packages (the checkout, or site-packages when installed): the
#: service process runs from it.
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ a real service process
class ServiceProcess:
    """``slidingserve serve`` (the real CLI) in a subprocess on a fixed port."""

    def __init__(self, workdir: Path, port: int = 0, **config: Any) -> None:
        self.port = port or free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._workdir = workdir
        self._config = {"host": "127.0.0.1", "port": self.port, "log_level": "warning", "grace_s": 0.0,
                        **config}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 300.0) -> ServiceProcess:
        """Start (or start again, on the same port) and wait until health says SERVING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        cfg = self._workdir / "server.json"
        cfg.write_text(json.dumps(self._config))
        self.starts += 1
        with (self._workdir / f"server-{self.starts}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "clients.cli", "serve", "--config", str(cfg)], cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
            )
        self._wait_serving(timeout)
        return self

    def _wait_serving(self, timeout: float) -> None:
        assert self.proc is not None
        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    log = (self._workdir / f"server-{self.starts}.log").read_text()
                    raise RuntimeError(f"the service exited with {self.proc.returncode}:\n{log[-2000:]}")
                with contextlib.suppress(grpc.RpcError):
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.05)
        raise RuntimeError(f"the service did not become SERVING within {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL: the process dies at once, nothing is drained."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------ network faults
class TcpProxy:
    """Relays TCP connections from its own loopback port to ``upstream``.

    Every chunk read from one side is delivered to the other ``delay_s`` later (a queue and a
    writer per direction, so a delay adds latency without throttling throughput).
    """

    def __init__(self, upstream: str, port: int = 0) -> None:
        host, _, p = upstream.rpartition(":")
        self.upstream = (host, int(p))
        self.port = port
        self.delay_s = 0.0
        self.accepted = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._stop_accepting = threading.Event()
        self._acceptor: threading.Thread | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        ls.settimeout(0.05)  # so that cut() stops the accept loop promptly
        self.port = int(ls.getsockname()[1])
        self._listener = ls
        self._stop_accepting = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, args=(ls, self._stop_accepting),
                                          name="proxy-accept", daemon=True)
        self._acceptor.start()
        return self

    def _accept_loop(self, ls: socket.socket, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    client, _ = ls.accept()
                except TimeoutError:
                    continue
                client.settimeout(None)
                try:
                    server = socket.create_connection(self.upstream, timeout=2.0)
                except OSError:
                    client.close()
                    continue
                server.settimeout(None)
                for s in (client, server):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    self._conns |= {client, server}
                    self.accepted += 1
                for src, dst in ((client, server), (server, client)):
                    q: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()
                    threading.Thread(target=self._read, args=(src, q), name="proxy-read", daemon=True).start()
                    threading.Thread(target=self._deliver, args=(q, src, dst), name="proxy-write",
                                     daemon=True).start()
        finally:
            ls.close()

    def _read(self, src: socket.socket, q: queue.SimpleQueue[tuple[float, bytes] | None]) -> None:
        try:
            while data := src.recv(65536):
                q.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        finally:
            q.put(None)

    def _deliver(self, q: queue.SimpleQueue[tuple[float, bytes] | None], src: socket.socket,
                 dst: socket.socket) -> None:
        try:
            while (item := q.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)  # one side gone: the relay of this connection ends

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                if s in self._conns:
                    self._conns.discard(s)
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv
                    s.close()

    def cut(self) -> None:
        """Reset every relayed connection and refuse new ones until :meth:`restore`."""
        self._stop_accepting.set()
        if self._acceptor is not None:
            self._acceptor.join(5)
        with self._lock:
            conns = list(self._conns)
        self._drop(*conns)

    def restore(self) -> None:
        """Accept again, on the same port."""
        self.start()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ service-side faults
#: Modes of :class:`FaultyPolicy`.
MODES = ("ok", "error", "unknown_id", "over_budget")


class FaultyPolicy:
    """The real ``base`` policy with a fault switched by :attr:`mode` (any thread):

    * ``ok`` — the real plan;
    * ``error`` — raises, so the servicer answers INTERNAL;
    * ``unknown_id`` — the real plan plus a request the engine never sent;
    * ``over_budget`` — the first request gets ``max_batch_tokens`` more tokens (over the batch
      budget and over what it needs; the token_budget field stays consistent, so only the
      engine's plan check can catch it).
    """

    def __init__(self, name: str = "faulty", base: str = "slidingserve") -> None:
        self._inner = registry.create(base)
        self.name = name
        self.version = f"{self._inner.version}+faults"
        self.params = self._inner.params
        self.mode = "ok"
        #: Decisions served per mode.
        self.calls: collections.Counter[str] = collections.Counter()

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
        mode = self.mode
        if mode not in MODES:
            raise ValueError(f"unknown fault mode {mode!r}")
        self.calls[mode] += 1
        if mode == "error":
            raise RuntimeError("injected fault")
        plan = dataclasses.replace(self._inner.plan(snapshot, predictor), policy=self.name)
        allocs = list(plan.allocations)
        if mode == "unknown_id" or (mode == "over_budget" and not allocs):
            allocs.append(Allocation("not-a-request", 1))
        elif mode == "over_budget":
            allocs[0] = Allocation(allocs[0].id, allocs[0].tokens + snapshot.max_batch_tokens)
        return dataclasses.replace(plan, allocations=tuple(allocs), token_budget=sum(a.tokens for a in allocs))
