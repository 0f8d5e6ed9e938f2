"""Log lines stay whole when processes share one stderr (the supervisor and its workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITER = """
import sys
from scheduler_service.server.logs import bind_process, configure_logging
import structlog
configure_logging("info")
bind_process(worker=int(sys.argv[1]))
log = structlog.get_logger()
for i in range(2000):
    log.info("line", i=i, pad="x" * 300)
"""


def test_concurrent_processes_never_split_a_line() -> None:
    # unbuffered stderr is where print() would split a line into text and newline
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(k)], cwd=ROOT, env=env, stderr=w,
                              stdout=subprocess.DEVNULL) for k in range(3)]
    os.close(w)
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert all(p.wait(60) == 0 for p in procs)
    docs = [json.loads(line) for line in lines]  # raises on a line two processes wrote into
    assert sorted((d["worker"], d["i"]) for d in docs) == [(k, i) for k in range(3) for i in range(2000)]
