"""The live benchmark's view of the remote decision path (issue 22: remote within 5% of in
process): a configuration's ``service_nice``, the service's own time per decision and the
adapter's time per iteration in the report, and the renice of a real process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from clients.live.procs import CpuUse, ServiceProcess, _threads
from clients.live.report import timing_table
from clients.live.runner import Config, _decision_path, _timing_means


def test_service_nice_is_a_remote_configuration_setting_not_a_policy_parameter() -> None:
    c = Config.parse("remote:slidingserve:service_nice=-10,window=3")
    assert (c.service_nice, dict(c.params)) == (-10, {"window": "3"})
    assert "service_nice" not in c.settings("h:1", _slo())["params"]
    assert Config.parse("remote:slidingserve").service_nice is None
    with pytest.raises(ValueError, match="service_nice applies to remote configurations only"):
        Config.parse("inproc:slidingserve:service_nice=-5")
    for bad in ("-21", "20", "x", "1.5"):
        with pytest.raises(ValueError, match=f"service_nice must be an integer from -20 to 19, got '{bad}'"):
            Config.parse(f"remote:slidingserve:service_nice={bad}")


def _slo() -> Any:
    from clients.live.measure import Slo

    return Slo()


def test_renice_reaches_every_thread_of_the_service_and_its_workers(tmp_path: Path) -> None:
    """A real process with a child and extra threads (as ``slidingserve serve`` with worker
    processes and gRPC threads): every thread takes the nice value; None brings them back."""
    code = ("import os, subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "subprocess.Popen([sys.executable, '-c', 'import threading, time; "
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)'])\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while len(_threads(proc.pid)) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        tids = _threads(proc.pid)
        assert len(tids) >= 4, tids  # two processes, two threads each
        own = os.getpriority(os.PRIO_PROCESS, 0)
        s = ServiceProcess(tmp_path, {0})
        s.proc = proc  # type: ignore[assignment]
        target = min(own + 5, 19)
        s.renice(target)
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {target} and s.nice == target
        if own == 0 and os.geteuid() != 0:  # back to the sweep's priority needs root when lower
            return
        s.renice(None)
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {own} and s.nice == own
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


def test_the_timing_table_shows_the_adapter_and_the_service_time() -> None:
    def run(config: str, mode: str, own: float | None, service: float | None) -> dict[str, Any]:
        r: dict[str, Any] = {"config": config, "mode": mode, "rate": 2.0, "seed": 1,
                             "client": {"ttft_mean_ms": 300.0, "send_late_mean_ms": 1.0, "send_late_max_ms": 2.0},
                             "vllm_timings": {"ttft_mean_ms": 200.0, "queue_mean_ms": 20.0, "prefill_mean_ms": 100.0,
                                              "itl_mean_ms": 15.0}}
        if own is not None:
            r["adapter"] = {"iterations": 100.0, "own_ms_per_iter": own}
            if service is not None:
                r["adapter"] |= {"decision_ms_mean": 2.5, "decision_over_20ms": 0.03}
        if service is not None:
            r["service_decision_ms"] = service
        return r

    text = timing_table([run("inproc:slidingserve", "inproc", 1.5, None),
                         run("remote:slidingserve", "remote", 0.75, 1.25)])
    assert "| inproc:slidingserve | 2 | 300 | 200 | 20 | 100 | 15 | 1 / 2 | 1.50 | — / — | — |" in text
    assert "| remote:slidingserve | 2 | 300 | 200 | 20 | 100 | 15 | 1 / 2 | 0.75 | 2.50 / 3.0% | 1.25 |" in text


def test_a_runs_decision_histogram_becomes_its_mean_and_tail_shares() -> None:
    """The adapter's counters over a run, as scraped: 100 answers, 0.25 s in all, 90 within
    10 ms and 97 within 20 ms."""
    ad = {"iterations": 120.0, "decision_seconds_count": 100.0, "decision_seconds_sum": 0.25,
          "decision_le_0.005": 50.0, "decision_le_0.01": 90.0, "decision_le_0.02": 97.0, "decision_le_+Inf": 100.0}
    _decision_path(ad)
    assert ad == {"iterations": 120.0, "decision_ms_mean": 2.5, "decision_over_10ms": pytest.approx(0.10),
                  "decision_over_20ms": pytest.approx(0.03)}
    quiet = {"iterations": 0.0, "decision_seconds_count": 0.0, "decision_seconds_sum": 0.0, "decision_le_0.01": 0.0}
    _decision_path(quiet)
    assert quiet == {"iterations": 0.0}  # no answers: no mean, no shares


def test_a_runs_prefix_cache_hit_rate_is_read_from_vllms_counters() -> None:
    """vLLM's ``prefix_cache_queries``/``hits`` counters over a run: the share of looked-up
    prompt tokens the cache held (the shared-prefix sweeps need it to be trusted)."""
    before = {"prefix_queries": 1000.0, "prefix_hits": 100.0, "ttft_sum": 1.0, "ttft_count": 10.0}
    after = {"prefix_queries": 5000.0, "prefix_hits": 3100.0, "ttft_sum": 3.0, "ttft_count": 20.0}
    out = _timing_means(before, after)
    assert out["prefix_hit_rate"] == pytest.approx(0.75) and out["ttft_mean_ms"] == pytest.approx(200.0)
    assert "prefix_hit_rate" not in _timing_means(before, before)  # no lookups: no rate


def test_service_cores_is_a_remote_configuration_setting_not_a_policy_parameter() -> None:
    c = Config.parse("remote:slidingserve:service_cores=worker,window=3")
    assert (c.service_cores, dict(c.params)) == ("worker", {"window": "3"})
    assert "service_cores" not in c.settings("h:1", _slo())["params"]
    assert Config.parse("remote:slidingserve").service_cores == "others"
    with pytest.raises(ValueError, match="service_cores applies to remote configurations only"):
        Config.parse("inproc:slidingserve:service_cores=worker")
    with pytest.raises(ValueError, match="service_cores must be 'others' or 'worker', got 'all'"):
        Config.parse("remote:slidingserve:service_cores=all")


def _busy_tree() -> subprocess.Popen[bytes]:
    """A process with a spinning thread and a spinning child (as the service with gRPC threads
    and worker processes, or vLLM's API server and its engine core)."""
    spin = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"
    code = ("import subprocess, sys, threading, time\n"
            f"threading.Thread(target=exec, args=({spin!r},), daemon=True).start()\n"
            f"subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
            "time.sleep(60)\n")
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        p.kill()
    proc.kill()
    proc.wait()


def test_place_moves_every_thread_of_the_service_and_its_workers(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    proc = _busy_tree()
    try:
        end = time.monotonic() + 30
        while len(_threads(proc.pid)) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        s = ServiceProcess(tmp_path, set(cores))
        s.proc = proc  # type: ignore[assignment]
        s.place({cores[-1]})
        assert {frozenset(os.sched_getaffinity(t)) for t in _threads(proc.pid)} == {frozenset({cores[-1]})}
        assert s.cores == {cores[-1]}
    finally:
        _kill(proc)


def test_cpu_use_accounts_each_process_tree_and_the_cores() -> None:
    """A real spinning tree as "vllm" (its root's thread: the API server; its child: the engine
    core), bound to one core: the run's record splits its CPU seconds that way."""
    cores = sorted(os.sched_getaffinity(0))
    worker = cores[-1]
    proc = _busy_tree()
    try:
        time.sleep(0.5)
        for t in _threads(proc.pid):
            os.sched_setaffinity(t, {worker})
        start = CpuUse(worker, set(cores[:-1]) or {worker}, {"vllm": proc.pid}).sample()
        time.sleep(1.5)
        use = CpuUse(worker, set(cores[:-1]) or {worker}, {"vllm": proc.pid}).sample().since(start)
    finally:
        _kill(proc)
    assert 1.3 < use["wall_s"] < 5
    # two spinning threads share the one core: about half the run each
    assert 0.2 * use["wall_s"] < use["api_server_s"] < 1.1 * use["wall_s"]
    assert 0.2 * use["wall_s"] < use["engine_s"] < 1.1 * use["wall_s"]
    assert use["engine_on_worker_s"] == pytest.approx(use["engine_s"], rel=0.2)
    assert use["worker_core_busy"] > 0.8 and 0.0 <= use["other_cores_busy"] <= 1.0
    assert use["client_s"] >= 0.0


def test_a_core_whose_counters_run_backwards_reads_idle_not_negative() -> None:
    """Busy time is a core's counters less idle and iowait, and Linux's iowait can decrease:
    an idle core's busy share must come out 0, not a hair below it (a run's record once
    read -6e-13)."""
    start = CpuUse(1, {0}, {}, cores={"worker_core": 10.0, "other_cores": 5.000000000001}, at=100.0)
    end = CpuUse(1, {0}, {}, cores={"worker_core": 11.5, "other_cores": 5.0}, at=102.0)
    use = end.since(start)
    assert use["other_cores_busy"] == 0.0
    assert use["worker_core_busy"] == pytest.approx(0.75)


def test_the_timing_table_says_where_the_cpu_went() -> None:
    base = {"rate": 3.0, "vllm_timings": {"ttft_mean_ms": 200.0}}
    runs = [{**base, "config": "inproc:slidingserve", "seed": 1,
             "cpu": {"worker_core_busy": 0.9, "other_cores_busy": 0.7, "api_server_s": 20.0, "engine_s": 40.0,
                     "engine_on_worker_s": 39.0, "client_s": 15.0}},
            {**base, "config": "remote:slidingserve", "seed": 1,
             "cpu": {"worker_core_busy": 0.8, "other_cores_busy": 0.95, "api_server_s": 21.0, "engine_s": 41.0,
                     "engine_on_worker_s": 38.0, "service_s": 6.5, "client_s": 16.0}}]
    text = timing_table(runs)
    assert "| inproc:slidingserve | 3 | 90% | 70% | 20.0 s | 40.0 s (39.0 s) | — | 15.0 s |" in text
    assert "| remote:slidingserve | 3 | 80% | 95% | 21.0 s | 41.0 s (38.0 s) | 6.5 s | 16.0 s |" in text
    assert "Where the CPU went" not in timing_table([{**base, "config": "vllm", "seed": 1}])
