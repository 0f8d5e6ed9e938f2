"""The adapter seen from outside the engine process: its Prometheus endpoint and its log handler."""

from __future__ import annotations

import logging
import re
import socket
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.vllm import RemoteSyncScheduler, SettingsError
from engine_adapter.vllm.observe import attach_log_handler

from .support import Driver, FakeClock, build_scheduler, make_request, scheduler_class, workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_endpoint_serves_the_stats(mdir: str) -> None:
    port = _free_port()
    env = {"SLIDINGSERVE_DEPLOYMENT": "vllm-fcfs", "SLIDINGSERVE_METRICS_PORT": str(port),
           "SLIDINGSERVE_METRICS_HOST": "127.0.0.1", "SLIDINGSERVE_ENGINE_ID": "unit"}
    clock = FakeClock()
    s = build_scheduler(scheduler_class(RemoteSyncScheduler, env, clock), mdir, async_scheduling=False)
    try:
        for p, o in workload(30, 3):
            s.add_request(make_request(p, o))
        Driver(s, clock, async_scheduling=False).run()
        st = s.slidingserve_stats()
        m = _scrape(port)
    finally:
        s.slidingserve_close()
    p = "slidingserve_adapter_"
    assert st["planned"] > 0 and st["reports"] > 0
    assert m[(p + "iterations_total", ())] == st["iterations"]
    assert m[(p + "planned_total", ())] == st["planned"]
    assert m[(p + "native_total", ())] == st["native"]
    assert m[(p + "reports_total", ())] == st["reports"]
    assert m[(p + "deviating_iterations_total", ())] == st["deviating_iterations"] == 0
    assert m[(p + "prefitted_total", ())] == st["prefitted"] > 0 and st["prefitted"] <= st["pipelined"]
    assert m[(p + "report_errors_total", (("stage", "collect"),))] == st["report_errors"]
    for reason, n in st["fallbacks"].items():
        assert m[(p + "fallbacks_total", (("reason", reason),))] == n
    assert m[(p + "own_seconds_total", ())] == pytest.approx(st["own_us"] / 1e6)
    assert m[(p + "own_seconds_per_iteration", ())] == pytest.approx(st["mean_own_us"] / 1e6)
    assert m[(p + "remote_decisions_total", ())] == st["core"]["remote_decisions"] > 0
    # every answer the policy gave is in the decision-time histogram, which adds up
    n = m[(p + "decision_seconds_count", ())]
    assert n == m[(p + "decision_seconds_bucket", (("le", "+Inf"),))] == sum(st["core"]["decision_counts"])
    assert n >= st["core"]["remote_decisions"]
    assert m[(p + "decision_seconds_sum", ())] == pytest.approx(st["core"]["decision_seconds"]) and \
        0 < st["core"]["decision_seconds"] < n
    les = [float(k[1][0][1]) for k in m if k[0] == p + "decision_seconds_bucket" and k[1][0][1] != "+Inf"]
    cums = [m[(p + "decision_seconds_bucket", (("le", str(le)),))] for le in sorted(les)]
    assert cums == sorted(cums) and cums[-1] <= n
    info = [dict(k[1]) for k in m if k[0] == p + "info"]  # as docs/vllm.md names it
    assert info == [{"address": "inproc", "engine_id": "unit", "policy": "vllm-fcfs",
                     "profile": st["profile"], "scheduler": "RemoteSyncSchedulerUnderTest",
                     "vllm_version": info[0]["vllm_version"]}]
    # closed with the scheduler
    with pytest.raises(urllib.error.URLError):
        _scrape(port)


def test_metrics_port_in_use_fails_at_start(mdir: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"SLIDINGSERVE_METRICS_PORT": str(port), "SLIDINGSERVE_METRICS_HOST": "127.0.0.1"}
        with pytest.raises(SettingsError, match=f"SLIDINGSERVE_METRICS_PORT: cannot listen on 127.0.0.1:{port}"):
            build_scheduler(scheduler_class(RemoteSyncScheduler, env), mdir, async_scheduling=False)


@pytest.mark.parametrize("value", ["-1", "65536", "http"])
def test_bad_metrics_port(value: str) -> None:
    from engine_adapter.vllm import VllmAdapterSettings

    with pytest.raises(SettingsError, match="SLIDINGSERVE_METRICS_PORT"):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_METRICS_PORT": value})


def test_log_handler_is_vllms_when_nothing_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM configures only its own logger; the adapter's logger gets vLLM's handlers (same
    stream and format) unless logging was configured by someone."""
    root = logging.getLogger()
    name = "engine_adapter_test_observe"
    logger = logging.getLogger(name)
    vllm_handler = logging.StreamHandler()
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [vllm_handler])
    # pytest captures through the root logger's handlers: a configured root is left alone
    assert root.handlers and not attach_log_handler(name) and not logger.handlers
    monkeypatch.setattr(root, "handlers", [])
    try:
        assert attach_log_handler(name)
        assert logger.handlers == [vllm_handler] and logger.getEffectiveLevel() <= logging.INFO
        assert not attach_log_handler(name)  # once
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)


def test_log_handler_without_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's logging not configured: stderr in vLLM's layout, only when asked (``fallback``)."""
    name = "engine_adapter_test_observe2"
    logger = logging.getLogger(name)
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    try:
        assert not attach_log_handler(name, fallback=False) and not logger.handlers
        assert attach_log_handler(name)
        (h,) = logger.handlers
        assert isinstance(h, logging.StreamHandler) and h.stream is sys.stderr
        rec = logging.LogRecord(name, logging.INFO, "/x/scheduler.py", 7, "slidingserve: hello", None, None)
        assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[scheduler\.py:7\] slidingserve: hello",
                            h.format(rec))
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)


_BLOCKED_PROMETHEUS = """if True:
    import importlib.abc, sys
    # vLLM loads prometheus_client itself: its modules first, then every later import fails
    import vllm.v1.core.sched.async_scheduler, vllm.v1.core.sched.scheduler, vllm.v1.engine, vllm.v1.request
    from engine_adapter.vllm.testbed import build_scheduler, fake_output, make_request, scheduler_class
    for m in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
        del sys.modules[m]

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "prometheus_client":
                raise ImportError("blocked: " + name)

    sys.meta_path.insert(0, Block())
    assert "engine_adapter.vllm.scheduler" not in sys.modules
    from engine_adapter.vllm import RemoteSyncScheduler
    env = {{"SLIDINGSERVE_DEPLOYMENT": "slidingserve", "SLIDINGSERVE_METRICS_PORT": sys.argv[1],
           "SLIDINGSERVE_METRICS_HOST": "127.0.0.1"}}
    s = build_scheduler(scheduler_class(RemoteSyncScheduler, env), {mdir!r}, async_scheduling=False)
    for _ in range(3):
        s.add_request(make_request(40, 3))
    for _ in range(5):
        so = s.schedule()
        s.update_from_output(so, fake_output(s, so))
    st = s.slidingserve_stats()
    s.slidingserve_close()
    print("planned", st["planned"])
"""


def test_without_the_endpoint_the_scheduler_never_imports_prometheus(mdir: str) -> None:
    """vLLM loads prometheus_client itself, so a fresh process first imports vLLM's modules,
    then makes every later import of prometheus_client fail: the adapter imports, and a
    scheduler with the metrics endpoint off builds, plans and reports; with it on it needs
    the import."""
    import subprocess

    code = _BLOCKED_PROMETHEUS.format(mdir=mdir)
    off = subprocess.run([sys.executable, "-c", code, "0"], capture_output=True, text=True, timeout=300)
    tail = off.stdout.split()[-2:]
    assert off.returncode == 0 and tail[0] == "planned" and int(tail[1]) > 0, off.stdout + off.stderr[-3000:]
    on = subprocess.run([sys.executable, "-c", code, str(_free_port())], capture_output=True, text=True,
                        timeout=300)
    assert on.returncode != 0 and "blocked: prometheus_client" in on.stderr, on.stderr[-3000:]
