"""The supported vLLM versions: an unsupported one stops the scheduler at start-up with one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm

from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
from engine_adapter.vllm.compat import (
    ALLOW_ENV,
    SUPPORTED_VLLM_VERSIONS,
    VllmVersionError,
    check_vllm_version,
)

from .support import build_scheduler, scheduler_class

ROOT = Path(__file__).resolve().parents[2]


def test_the_tested_versions_are_supported() -> None:
    assert vllm.__version__ in SUPPORTED_VLLM_VERSIONS  # the pinned wheel this suite runs on
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")  # make e2e: 0.32.0 (CPU build)
    assert check_vllm_version("0.32.0+cpu", {}) and check_vllm_version("0.33.0", {})
    for bad in ("0.31.2", "0.33.1", "0.34.0", "0.33.0rc1", "dev"):
        with pytest.raises(VllmVersionError):
            check_vllm_version(bad, {})


@pytest.mark.parametrize("base,async_", [(RemoteSyncScheduler, False), (RemoteScheduler, True)],
                         ids=["sync", "async"])
def test_unsupported_version_fails_at_start_with_one_line(base: type, async_: bool, mdir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's real scheduler classes, only the version string changed."""
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(VllmVersionError) as e:
        build_scheduler(scheduler_class(base, {}), mdir, async_scheduling=async_)
    msg = str(e.value)
    assert "\n" not in msg
    assert "found vLLM 0.31.0" in msg and "supports vLLM 0.32.0, 0.33.0" in msg and f"{ALLOW_ENV}=1" in msg


def test_override_runs_an_unsupported_version_with_a_warning(mdir: str, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.34.5")
    caplog.set_level(logging.WARNING, logger="engine_adapter")
    s = build_scheduler(scheduler_class(RemoteSyncScheduler, {ALLOW_ENV: "1"}), mdir, async_scheduling=False)
    try:
        assert s.slidingserve_stats()["iterations"] == 0
    finally:
        s.slidingserve_close()
    assert any("vLLM 0.34.5 is not a supported version" in r.getMessage() for r in caplog.records)


def test_import_on_an_unsupported_version_fails_before_vllm_internals() -> None:
    """``--scheduler-cls`` imports the module in the engine core: it refuses to load, and the
    traceback vLLM prints ends with the one-line reason."""
    code = ("import vllm; vllm.__version__ = '0.99.1'\n"
            "import engine_adapter.vllm.scheduler\n")
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("engine_adapter.vllm.compat.VllmVersionError: engine_adapter.vllm supports vLLM 0.32.0, "
                    f"0.33.0, found vLLM 0.99.1; install a supported version or set {ALLOW_ENV}=1 to run anyway")
