"""Adapter settings: environment parsing, clear errors, the hot-reloaded settings file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.vllm import RemoteSyncScheduler
from engine_adapter.vllm.settings import SettingsError, SettingsWatcher, VllmAdapterSettings

from .support import build_scheduler, make_request, scheduler_class


def test_env_parsing(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = VllmAdapterSettings.from_env({
        "SLIDINGSERVE_ADDRESS": "sched.internal:50051", "SLIDINGSERVE_POLICY": "sarathi",
        "SLIDINGSERVE_DEADLINE_MS": "7.5", "SLIDINGSERVE_PARAMS": "chunk=256, x = y",
        "SLIDINGSERVE_TLS_CA": str(ca), "SLIDINGSERVE_PROFILE_TP": "2",
        "SLIDINGSERVE_DEFAULT_TTFT_MS": "500", "SLIDINGSERVE_DEFAULT_TBT_MS": "40", "UNRELATED": "1",
    })
    assert (s.address, s.policy, s.deadline_ms, s.profile_tp) == ("sched.internal:50051", "sarathi", 7.5, 2)
    assert dict(s.params) == {"chunk": "256", "x": "y"} and s.tls
    assert VllmAdapterSettings.from_env({}) == VllmAdapterSettings()


@pytest.mark.parametrize("env,msg", [
    ({"SLIDINGSERVE_ADDRESS": "nohostport"}, "SLIDINGSERVE_ADDRESS"),
    ({"SLIDINGSERVE_ADDRESS": "h:99999"}, "SLIDINGSERVE_ADDRESS"),
    ({"SLIDINGSERVE_DEADLINE_MS": "fast"}, "SLIDINGSERVE_DEADLINE_MS must be a number"),
    ({"SLIDINGSERVE_DEADLINE_MS": "0"}, "SLIDINGSERVE_DEADLINE_MS"),
    ({"SLIDINGSERVE_PARAMS": "novalue"}, "SLIDINGSERVE_PARAMS"),
    ({"SLIDINGSERVE_PROFILE_TP": "1.5"}, "SLIDINGSERVE_PROFILE_TP must be an integer"),
    ({"SLIDINGSERVE_TLS_CERT": "/nonexistent"}, "TLS_KEY must be given together"),
    ({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TLS_CA": "/nonexistent"}, "no such file"),
    ({"SLIDINGSERVE_POLICY": "nope"}, "SLIDINGSERVE_POLICY"),
    ({"SLIDINGSERVE_CONFIG": "/nonexistent.yaml"}, "cannot read"),
])
def test_bad_values_have_clear_errors(env: dict[str, str], msg: str) -> None:
    with pytest.raises(SettingsError, match=msg):
        VllmAdapterSettings.from_env(env)


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    t = time.time() + 1
    os.utime(path, (t, t))  # a new mtime even on coarse file systems


def test_file_formats_and_reload(tmp_path: Path) -> None:
    for name, text in [("a.yaml", "policy: sarathi\nparams: {chunk_size: 128}\n"),
                       ("a.toml", "[slidingserve]\npolicy = 'sarathi'\nparams = {chunk_size = 128}\n"),
                       ("a.json", json.dumps({"policy": "sarathi", "params": {"chunk_size": 128}}))]:
        p = tmp_path / name
        p.write_text(text)
        s = VllmAdapterSettings.from_env({"SLIDINGSERVE_CONFIG": str(p), "SLIDINGSERVE_POLICY": "vllm-fcfs"})
        assert s.policy == "sarathi" and dict(s.params) == {"chunk_size": "128"}, name
    p = tmp_path / "live.yaml"
    p.write_text("deadline_ms: 5\n")
    w = SettingsWatcher(VllmAdapterSettings.from_env({"SLIDINGSERVE_CONFIG": str(p)}, apply_file=False), period_s=0)
    assert w.current.deadline_ms == 5
    assert w.poll() is None  # unchanged
    _touch(p, "deadline_ms: 9\npolicy: sarathi-edf\n")
    new = w.poll()
    assert new is not None and (new.deadline_ms, new.policy) == (9, "sarathi-edf")
    _touch(p, "deadline_ms: [oops\n")
    assert w.poll() is None and w.errors == 1 and w.current.policy == "sarathi-edf"  # last good kept
    _touch(p, "bogus_key: 1\n")
    assert w.poll() is None and w.errors == 2
    with pytest.raises(SettingsError, match="unknown keys"):
        VllmAdapterSettings().with_file(str(p))


def test_scheduler_hot_swaps_policy_without_restart(tmp_path: Path, mdir: str) -> None:
    p = tmp_path / "live.yaml"
    p.write_text("policy: vllm-fcfs\n")
    s: Any = build_scheduler(scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_CONFIG": str(p)}), mdir,
                             async_scheduling=False)
    s._ss_live.watcher.period_s = 0
    for _ in range(3):
        s.add_request(make_request(40, 50))
    s.schedule()
    assert s.slidingserve_stats()["policy"] == "vllm-fcfs"
    first_core = s._ss_live.core
    _touch(p, "policy: sarathi\nparams: {chunk_size: 64}\n")
    so = s.schedule()
    st = s.slidingserve_stats()
    assert st["policy"] == "sarathi" and st["settings_reloads"] == 1 and s._ss_live.core is not first_core
    assert so.total_num_scheduled_tokens <= 64
    _touch(p, "policy: [broken\n")
    s.schedule()
    assert s.slidingserve_stats()["policy"] == "sarathi" and s.slidingserve_stats()["settings_errors"] == 1
    s.slidingserve_close()


def test_hot_swap_keeps_what_the_in_process_predictor_learned(tmp_path: Path, mdir: str) -> None:
    """A settings reload builds a new core, but the in-process predictor registry is the
    engine's: the new policy (and a later in-process spell after a remote one) plans with
    what was learned of this engine, not with the bundled default again."""
    p = tmp_path / "live.yaml"
    p.write_text("policy: slidingserve\n")
    s: Any = build_scheduler(scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_CONFIG": str(p)}), mdir,
                             async_scheduling=False)
    s._ss_live.watcher.period_s = 0
    for _ in range(3):
        s.add_request(make_request(40, 50))
    s.schedule()
    reg = s._ss_live.predictors
    assert reg is not None and s._ss_live.core.backend._registry is reg
    first_core = s._ss_live.core
    _touch(p, "policy: sarathi-edf\n")
    s.schedule()
    assert s._ss_live.core is not first_core and s.slidingserve_stats()["policy"] == "sarathi-edf"
    assert s._ss_live.predictors is reg and s._ss_live.core.backend._registry is reg
    first_core.close()  # the retired core closes (in the background too): the registry stays open
    assert not reg._closed
    s.slidingserve_close()
    assert reg._closed and s._ss_live.predictors is None


def test_bad_file_at_start_fails_fast(tmp_path: Path, mdir: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text("{")
    with pytest.raises(SettingsError, match="does not parse"):
        build_scheduler(scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_CONFIG": str(p)}), mdir,
                        async_scheduling=False)


def test_package_import_does_not_need_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; import engine_adapter.vllm as v; "
            "v.VllmAdapterSettings.from_env({}); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
