"""pytest plugin for ``tools/vllm_tests.sh``: vLLM's scheduler tests build their schedulers
through ``tests.v1.core.utils.create_scheduler``, which picks ``Scheduler`` or
``AsyncScheduler`` from its module globals; we point those names at our classes.

Tests listed in ``tools/vllm_suite_expected.txt`` (one node id per line, ``#`` reason)
are marked xfail (non-strict) with their reason: they test behaviour that a plan-driven
scheduler deliberately does not share, or use vLLM internals outside the FCFS path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

EXPECTED = Path(__file__).with_name("vllm_suite_expected.txt")


def _expected() -> dict[str, str]:
    out: dict[str, str] = {}
    if EXPECTED.exists():
        for line in EXPECTED.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            name, _, why = line.partition("#")
            if name.strip():
                out[name.strip()] = why.strip() or "known difference"
    return out


def pytest_configure(config: Any) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for m in ("cpu_test: vLLM CPU test", "skip_global_cleanup: vLLM marker"):
        config.addinivalue_line("markers", m)
    if os.environ.get("SLIDINGSERVE_SUITE_NATIVE"):
        return  # baseline run: vLLM's own classes (tells environment failures from ours)
    import tests.v1.core.utils as utils

    from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler

    utils.Scheduler = RemoteSyncScheduler  # type: ignore[attr-defined]
    utils.AsyncScheduler = RemoteScheduler  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    exp = _expected()
    for item in items:
        why = exp.get(item.nodeid) or exp.get(item.nodeid.split("[")[0])
        if why:
            item.add_marker(pytest.mark.xfail(reason=why, strict=False))
