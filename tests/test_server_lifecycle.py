"""Server lifecycle: graceful shutdown drains in-flight calls, metrics endpoint, config
files, and ``serve()`` stopping cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import ValidationError
from scheduler_service.server import ServerConfig
from tests.grpc_support import InjectedPolicy, inject, make_server, mixed_snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_graceful_shutdown_completes_in_flight_calls() -> None:
    srv = make_server(grace_s=5.0).start()
    inject(srv, InjectedPolicy(name="slow", delay_s=0.4))
    results: list[object] = []
    with SchedulerClient(srv.target, timeout_s=10.0) as cl:
        def call() -> None:
            try:
                results.append(cl.schedule(mixed_snapshot(0, 4, 4), policy="slow"))
            except SchedulerError as e:  # pragma: no cover - the failure being tested
                results.append(e)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.15)  # the call is now inside the policy
        t0 = time.monotonic()
        srv.stop()
        t.join(5)
        assert time.monotonic() - t0 < 3.0
        assert len(results) == 1 and not isinstance(results[0], SchedulerError), results
        with pytest.raises(SchedulerError) as exc:
            cl.schedule(mixed_snapshot(0, 4, 4), timeout_s=1.0)
        assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_metrics_endpoint_exposes_counters() -> None:
    with make_server(metrics_port=-1) as srv, SchedulerClient(srv.target, timeout_s=10.0) as cl:
        assert srv.metrics_port > 0
        cl.schedule(mixed_snapshot(0, 8, 8))
        with pytest.raises(SchedulerError):
            cl.schedule(mixed_snapshot(0, 4, 4), policy="nope")
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("slidingserve_decisions_total{", "slidingserve_decision_seconds_bucket{",
                 'le="0.0001"', "slidingserve_decision_errors_total{code=\"INVALID_ARGUMENT\"}",
                 "slidingserve_predictor_abs_error_ms", "slidingserve_reports_total",
                 "slidingserve_predictor_refits_total", "slidingserve_active_streams"):
        assert name in body, name
    assert 'policy="slidingserve"' in body


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_config_files(tmp_path: Path, suffix: str) -> None:
    text = {
        ".yaml": "port: 6000\ndefault_policy: sarathi\ngrace_s: 1\nlog_level: debug\n",
        ".toml": 'port = 6000\ndefault_policy = "sarathi"\ngrace_s = 1\nlog_level = "debug"\n',
        ".json": json.dumps({"port": 6000, "default_policy": "sarathi", "grace_s": 1, "log_level": "debug"}),
    }[suffix]
    p = tmp_path / f"server{suffix}"
    p.write_text(text)
    cfg = ServerConfig.from_file(p)
    assert (cfg.port, cfg.default_policy, cfg.grace_s, cfg.log_level) == (6000, "sarathi", 1.0, "debug")


def test_config_errors(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("port: 70000\nrefit_evry: 3\n")
    with pytest.raises(ValidationError) as exc:
        ServerConfig.from_file(p)
    assert [v.field for v in exc.value.violations] == ["refit_evry"]
    with pytest.raises(ValidationError) as exc:
        ServerConfig(port=70000, log_level="loud")
    assert {v.field for v in exc.value.violations} == {"port", "log_level"}
    with pytest.raises(ValidationError):
        ServerConfig(port="80")  # type: ignore[arg-type]


def test_unknown_default_policy_fails_start() -> None:
    with pytest.raises(ValidationError) as exc:
        make_server(default_policy="nope").start()
    assert exc.value.violations[0].field == "policy"


def test_serve_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    code = (
        "import sys, threading, time\n"
        "from scheduler_service.server import app\n"
        "orig = app.SchedulerServer.start\n"
        "def start(self):\n"
        "    r = orig(self); open(sys.argv[1], 'w').write(str(self.port)); return r\n"
        "app.SchedulerServer.start = start\n"
        "app.serve(app.ServerConfig(host='127.0.0.1', port=0, grace_s=1.0, log_level='info'))\n"
        "print('clean exit')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(port_file)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        with SchedulerClient(f"127.0.0.1:{port_file.read_text()}", timeout_s=10.0) as cl:
            assert cl.schedule(mixed_snapshot(0, 4, 4)).policy == "slidingserve"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "clean exit" in out
    assert '"event": "server_stopped"' in err


def test_max_message_size_is_enforced() -> None:
    with make_server(max_message_bytes=4096) as srv, SchedulerClient(srv.target, timeout_s=10.0) as cl:
        with pytest.raises(SchedulerError) as exc:
            cl.schedule(mixed_snapshot(0, 100, 100))
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert cl.schedule(mixed_snapshot(0, 2, 2)).policy == "slidingserve"
