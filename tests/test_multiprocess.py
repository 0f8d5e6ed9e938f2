"""The multi-process service (``slidingserve serve --workers 2``) as operators run it: a real
supervisor and real worker processes on one loopback port, spoken to over real gRPC.

* both workers answer, each channel (one TCP connection) staying on its worker;
* a refit published on one worker is served by the other within ``predictor_sync_s``;
* a killed worker is restarted while the other keeps answering; SIGTERM drains all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import default_predictor
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server.servicer import WORKER_PID_KEY
from scheduler_service.wire.convert import profile_to_pb
from tests.grpc_support import mixed_snapshot
from tests.test_server_predictor import WINDOW, A, reports, truth_f

ROOT = Path(__file__).resolve().parents[1]
#: The client's reconnect options (scheduler_service/client.py), so that recovery is timed as an engine's.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
             ("grpc.max_reconnect_backoff_ms", 1000)]
pytestmark = pytest.mark.timeout(240)


@dataclass
class Service:
    proc: subprocess.Popen[str]
    port: int = 0
    pids: list[int] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)
    #: Lines that are not JSON log events (a worker's traceback), for failure messages.
    other: list[str] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def read(self) -> None:
        """Collect the JSON log lines of the supervisor and its workers (one stderr)."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                doc = json.loads(line)
            except ValueError:
                self.other.append(line.rstrip())
                continue
            with self._cv:
                self.lines.append(doc)
                self._cv.notify_all()

    def await_event(self, event: str, timeout: float = 150.0, after: int = 0, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for doc in self.lines[after:]:
                    if doc.get("event") == event and all(doc.get(k) == v for k, v in match.items()):
                        return doc
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, \
                    f"no {event} in the log: {self.lines[-5:]}\n" + "\n".join(self.other[-30:])
                self._cv.wait(min(left, 0.5))


@pytest.fixture()
def service(tmp_path: Path) -> Iterator[Service]:
    config = tmp_path / "server.yaml"
    config.write_text(json.dumps({"refit_every": WINDOW, "refit_window": WINDOW, "refit_min_samples": 30,
                                  "predictor_sync_s": 0.1, "grace_s": 1.0, "max_workers": 8}))
    cmd = [sys.executable, "-m", "clients.cli", "serve", "--workers", "2", "--host", "127.0.0.1",
           "--port", "0", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    svc = Service(proc)
    threading.Thread(target=svc.read, daemon=True).start()
    try:
        started = svc.await_event("server_started", workers=2)  # the supervisor's (workers log theirs)
        svc.port, svc.pids = started["port"], list(started["worker_pids"])
        yield svc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def _channel(target: str) -> grpc.Channel:
    """A channel with its own TCP connection (gRPC would share one between channels of a
    process), so that each lands on the worker the kernel picks for it."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _worker_of(ch: grpc.Channel) -> int:
    _, call = pb_grpc.SchedulerServiceStub(ch).GetPredictor.with_call(
        pb.GetPredictorRequest(engine_profile=profile_to_pb(A)), timeout=10)
    return int(dict(call.trailing_metadata())[WORKER_PID_KEY])


def _one_channel_per_worker(svc: Service, want: int = 2, tries: int = 64) -> dict[int, grpc.Channel]:
    found: dict[int, grpc.Channel] = {}
    for _ in range(tries):
        ch = _channel(svc.target)
        pid = _worker_of(ch)
        if pid in found:
            ch.close()
        else:
            found[pid] = ch
        if len(found) == want:
            return found
    raise AssertionError(f"{tries} connections reached only workers {sorted(found)}")


def test_two_workers_share_the_port_and_both_plan(service: Service) -> None:
    assert len(service.pids) == 2 and len(set(service.pids)) == 2
    channels = _one_channel_per_worker(service)
    assert set(channels) == set(service.pids)
    snap = mixed_snapshot(1)
    for pid, ch in channels.items():
        with SchedulerClient(service.target, timeout_s=10.0, channel=ch) as cl:
            plan = cl.schedule(snap)
            assert plan.allocations and plan.predictor_version == default_predictor().version
            with cl.stream() as st:  # a stream stays on its connection's worker
                assert st.schedule(snap).decision_key() == plan.decision_key()
            assert _worker_of(ch) == pid
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    # every worker's log lines say which worker, also those written on gRPC handler threads
    started = [d for d in service.lines if d.get("event") == "server_started" and "workers" not in d]
    assert sorted(d["worker"] for d in started) == [0, 1]
    joined = service.await_event("engine_joined", timeout=10)
    assert joined["worker"] in (0, 1)


def test_a_refit_on_one_worker_is_served_by_the_other(service: Service) -> None:
    channels = _one_channel_per_worker(service)
    (pid_a, ch_a), (pid_b, ch_b) = channels.items()
    boot = default_predictor().version
    with SchedulerClient(service.target, timeout_s=10.0, channel=ch_a) as a:
        assert a.report(reports(1, WINDOW, truth_f, A)).accepted == WINDOW
        new = _await(lambda: a.get_predictor(A).version, lambda v: v != boot, "refit on worker A")
    snap = mixed_snapshot(2, profile=A.key)
    with SchedulerClient(service.target, timeout_s=10.0, channel=ch_b) as b:
        version = _await(lambda: b.schedule(snap).predictor_version, lambda v: v == new, "worker B serving it")
        assert version == new and b.get_predictor(A).version == new
        assert _worker_of(ch_b) == pid_b != pid_a
    service.await_event("predictor_installed", timeout=5, version=new)


def test_a_killed_worker_is_restarted_while_the_other_answers(service: Service) -> None:
    victim, survivor = service.pids
    mark = len(service.lines)
    os.kill(victim, signal.SIGKILL)
    snap = mixed_snapshot(3)
    answered, reset = 0, []
    deadline = time.monotonic() + 120
    restarted = None
    while restarted is None:
        ch = _channel(service.target)  # new connections: only live workers accept them
        with SchedulerClient(service.target, timeout_s=10.0, channel=ch) as cl:
            try:
                assert cl.schedule(snap).allocations
                answered += 1
            except SchedulerError as e:
                # a connection the dying worker's socket had queued but not yet accepted is
                # reset by the kernel when the process dies; only that moment may fail
                assert e.code == grpc.StatusCode.UNAVAILABLE and not answered, e
                reset.append(str(e))
        restarted = next((d for d in service.lines[mark:] if d.get("event") == "worker_started"), None)
        assert time.monotonic() < deadline, "the killed worker was not restarted"
        time.sleep(0.05)
    assert answered >= 1 and len(reset) <= 2 and restarted["pid"] not in (victim, survivor)
    exited = service.await_event("worker_exited", after=mark, pid=victim)
    assert exited["exit_code"] == -signal.SIGKILL
    channels = _one_channel_per_worker(service)
    assert set(channels) == {survivor, restarted["pid"]}


def test_a_stream_survives_the_death_of_its_worker(service: Service) -> None:
    """The engine's path (docs/operations.md): the call on the dead worker's connection fails
    once, the stream reopens, the channel reconnects, and decisions resume on a live worker."""
    channels = _one_channel_per_worker(service)
    victim = next(iter(channels))
    for ch in channels.values():
        ch.close()
    ch = grpc.insecure_channel(service.target, options=[
        ("grpc.use_local_subchannel_pool", 1), *RECONNECT])
    while _worker_of(ch) != victim:  # a connection on the worker about to die
        ch.close()
        ch = grpc.insecure_channel(service.target, options=[("grpc.use_local_subchannel_pool", 1), *RECONNECT])
    snap = mixed_snapshot(4)
    with SchedulerClient(service.target, timeout_s=5.0, channel=ch) as cl, cl.stream() as st:
        assert st.schedule(snap).allocations
        os.kill(victim, signal.SIGKILL)
        failed, t0 = 0, time.monotonic()
        while True:
            try:
                plan = st.schedule(snap)
                break
            except SchedulerError as e:
                assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
                failed += 1
                assert time.monotonic() - t0 < 30, "the stream did not come back"
                time.sleep(0.05)
        assert plan.allocations and failed >= 1
        assert _worker_of(ch) != victim  # now on a live worker (the survivor or the restarted one)


def test_sigterm_drains_every_worker(service: Service) -> None:
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(60) == 0
    for pid in service.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _await(get: Any, ok: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = get()
        if ok(v):
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what} (last: {v!r})"
        time.sleep(0.1)
