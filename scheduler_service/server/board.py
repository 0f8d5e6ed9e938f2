"""Refitted predictors shared by the workers of one port (:mod:`.workers`): a directory
of JSON files, one per engine profile, that every worker publishes to and polls.

A worker's :class:`~.app.SchedulerServer` publishes each local refit here and installs
the newer publications of the others (eventual consistency, last writer wins; a plan
names the predictor version it used, so any plan can still be replayed exactly).  Its
own module, below both the server and the supervisor: the server uses it, the supervisor
(:mod:`.workers`) only names its directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import structlog

from scheduler_service.core import BatchLatencyPredictor
from scheduler_service.predictors import PredictorRegistry

__all__ = ["PredictorBoard"]

log = structlog.get_logger("slidingserve.server")


class PredictorBoard:
    """The refitted predictors of all workers: ``<dir>/<sha256(key)[:32]>.json`` holding
    ``{key, tenant, stamp_ns, pid, predictor}``.  Files are written to a temporary name and
    renamed, so a reader sees a whole publication or the previous one, never a torn one."""

    def __init__(self, directory: str | Path, registry: PredictorRegistry, poll_s: float = 0.5) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._registry = registry
        self._poll_s = poll_s
        self._stamps: dict[str, int] = {}  # key -> stamp of the publication served here
        self._seen: dict[str, tuple[int, int]] = {}  # file name -> (mtime_ns, size) read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="predictor-board", daemon=True)

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def publish(self, key: str, predictor: BatchLatencyPredictor) -> None:
        """Called by the registry after a local refit was published (``on_publish``)."""
        st = self._registry.state(key)
        stamp = time.time_ns()
        doc = {"key": key, "tenant": st.tenant if st else "", "stamp_ns": stamp, "pid": os.getpid(),
               "predictor": json.loads(predictor.to_json(indent=None))}
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        with self._lock:
            self._stamps[key] = stamp
            os.replace(tmp, path)

    def poll(self) -> int:
        """Install every publication newer than the one served here; returns how many."""
        installed = 0
        for entry in os.scandir(self.directory):
            if not entry.name.endswith(".json"):
                continue
            st = entry.stat()
            if self._seen.get(entry.name) == (st.st_mtime_ns, st.st_size):
                continue
            self._seen[entry.name] = (st.st_mtime_ns, st.st_size)
            installed += self._install(Path(entry.path))
        return installed

    def _install(self, path: Path) -> int:
        try:
            doc = json.loads(path.read_text())
            key, stamp = str(doc["key"]), int(doc["stamp_ns"])
            predictor = BatchLatencyPredictor.from_json(json.dumps(doc["predictor"]))
        except (OSError, ValueError, KeyError, TypeError) as e:  # replaced meanwhile, or not ours
            log.warning("predictor_board_unreadable", file=path.name, error=str(e)[:200])
            return 0
        with self._lock:
            if stamp <= self._stamps.get(key, -1):
                return 0
            self._stamps[key] = stamp
        if not self._registry.install(key, predictor, tenant=str(doc.get("tenant", ""))):
            return 0
        log.info("predictor_installed", profile=key, version=predictor.version, from_pid=doc.get("pid"))
        return 1

    def start(self) -> PredictorBoard:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except OSError as e:  # the directory went away (shutdown): keep serving
                log.warning("predictor_board_unreadable", error=str(e)[:200])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
