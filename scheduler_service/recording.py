"""A bounded, rotating recording of an engine's traffic, for ``slidingserve whatif``.

The recorder sees what the scheduler sees: every snapshot an engine sends (its queues) and
every iteration it reports (the batch and its measured time).  From the snapshots it follows
each request from its first appearance to its last and writes one line per request when it
leaves the queues: arrival, prompt length, the prefix-cache hit it arrived with, output
length, SLOs and class, and its outcome on the engine clock (first scheduling, first token,
last token, and how late its latest token was against formula (1)).  From the reports it
writes the iterations' batch features and measured times: what a cost model is fitted on.
No prompt text, token ids or request ids are recorded.

Token times are read at the snapshots' resolution: a token counts as out at the first
snapshot that shows it, and a request's last token when the first snapshot without the
request came (or, when the engine went idle first, one typical snapshot interval after its
last sighting).  Finished and aborted requests look alike from the queues; the output length
recorded is the tokens last seen plus the one the last iteration produced.

The decision path only appends to a bounded queue (:meth:`Recorder.offer`,
:meth:`Recorder.offer_iteration`); a daemon thread does the rest and drops (and counts)
what it cannot keep up with.  Files rotate at ``file_bytes``; the oldest of this process's
files are deleted once its files pass ``max_bytes``.  Several processes (the service's
workers) may record into one directory: each writes its own files.

Format (version :data:`FORMAT_VERSION`, JSON Lines; docs/operations.md, "Before you
switch"): each file starts with ``{"format": "slidingserve-recording", "version": 1, ...}``;
then ``engine`` lines (an engine's limits and the policy that served it, repeated at the top
of every file and whenever they change), ``request`` lines and ``iteration`` lines.
:func:`read_recording` reads a directory back, with a one-line :class:`RecordingError` for
what it cannot use.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from scheduler_service.core import Snapshot, registry
from scheduler_service.core.features import batch_features
from scheduler_service.core.params import param_text

__all__ = ["FORMAT", "FORMAT_VERSION", "NATIVE", "Recorder", "Recording", "RecordingError", "params_text", "policy_label",
           "read_recording"]

#: The policy recorded for an engine whose own scheduler served (the vLLM adapter's ``observe``).
NATIVE = "vllm"
FORMAT = "slidingserve-recording"
FORMAT_VERSION = 1
#: How often the recorder's thread writes what was offered (seconds).
POLL_S = 0.05
#: While a decision runs (:attr:`Recorder.deciding`) the thread waits in steps of DEFER_S, up
#: to MAX_DEFER_S per item (a service that is never idle still gets its traffic recorded).
DEFER_S, MAX_DEFER_S = 0.0002, 0.02
#: Columns of a request line, in order (see the module).
REQUEST_FIELDS = ("arrival", "prompt", "cached", "output", "ttft_slo", "tbt_slo", "priority", "sheddable",
                  "e2e_slo", "tpot_slo", "first_scheduled", "first_token", "last_token", "late_s", "finished")


T = TypeVar("T")


class RecordingError(ValueError):
    """A recording that cannot be used; the message is one line and says why."""


@dataclasses.dataclass(slots=True)
class _Live:
    """A request in an engine's queues, as followed so far."""

    arrival: float
    prompt: int
    cached: int
    ttft_slo: float
    tbt_slo: float
    priority: int
    sheddable: bool
    e2e_slo: float
    tpot_slo: float
    seen: float  # the last snapshot's time that showed it
    tokens: int = 0  # output tokens last seen
    first_scheduled: float = math.nan
    first_token: float = math.nan
    late_s: float = -math.inf  # formula (1): the latest token's lateness so far

    def advance(self, now: float, computed: int, tokens: int) -> None:
        if computed > self.cached and math.isnan(self.first_scheduled):
            self.first_scheduled = self.seen  # it ran in the iteration after the last sighting
        if tokens > self.tokens:
            if math.isnan(self.first_token):
                self.first_token = now
            # tokens self.tokens .. tokens-1 are out by now; the earliest due binds
            self.late_s = max(self.late_s, now - self.arrival - self.ttft_slo - self.tokens * self.tbt_slo)
            self.tokens = tokens
        self.seen = now

    def finished(self, at: float) -> dict[str, Any]:
        """The request line of a request that left the queues at ``at``."""
        out = self.tokens + 1 if self.tokens or not math.isnan(self.first_scheduled) else 0
        finished = out > 0 and not math.isnan(self.first_scheduled)
        first = self.first_token if self.tokens else (at if finished else math.nan)
        late = max(self.late_s, at - self.arrival - self.ttft_slo - self.tokens * self.tbt_slo) if finished else None
        vals = (self.arrival, self.prompt, self.cached, out, self.ttft_slo, self.tbt_slo, self.priority,
                self.sheddable, self.e2e_slo, self.tpot_slo, _num(self.first_scheduled), _num(first),
                at if finished else None, late, finished)
        return {"t": "request", **dict(zip(REQUEST_FIELDS, vals, strict=True))}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


@dataclasses.dataclass(slots=True)
class _Engine:
    info: dict[str, Any]
    live: dict[str, _Live] = dataclasses.field(default_factory=dict)
    last_now: float = math.nan
    gaps: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))

    def typical_gap(self) -> float:
        return float(np.median(self.gaps)) if self.gaps else 0.0


class Recorder:
    """Records engines' traffic into ``directory`` (see the module).

    ``offer`` and ``offer_iteration`` never block: they append to a queue of ``queue``
    items that a daemon thread drains; what does not fit is dropped and counted
    (``dropped``), and that leaves the GIL to decisions while :attr:`deciding` is set;
    ``inline`` records in the caller's thread instead (a simulated engine,
    which runs faster than the thread could keep up).  :meth:`close` drains the queue and writes every request still in the
    queues as unfinished."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = 256 << 20,
                 file_bytes: int = 16 << 20, queue: int = 4096, source: str = "", inline: bool = False) -> None:
        if max_bytes < file_bytes or file_bytes < 4096:
            raise ValueError(f"need 4096 <= file_bytes <= max_bytes, got {file_bytes} and {max_bytes}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.file_bytes, self.source, self.inline = max_bytes, file_bytes, source, inline
        self._q: collections.deque[tuple[Any, ...]] = collections.deque()
        #: Set by the caller while it decides: the thread then leaves it the GIL (its items
        #: wait, at most MAX_DEFER_S each).  A flag, not a count: with decisions in several
        #: threads it is approximate, which only costs some overlap.
        self.deciding = False
        self._queue = queue
        self.dropped = 0
        self.written = {"request": 0, "iteration": 0}
        self._engines: dict[str, _Engine] = {}
        self._files: list[Path] = []
        self._serial = 0
        self._fh: Any = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="slidingserve-recorder", daemon=True)
        self._thread.start()

    @classmethod
    def within(cls, directory: str | os.PathLike[str], max_mb: int, *, source: str, inline: bool = False) -> Recorder:
        """A recorder whose files take at most ``max_mb`` MiB (rotating at 16 MiB, or less)."""
        return cls(directory, max_bytes=max_mb << 20, file_bytes=min(16, max_mb) << 20, source=source, inline=inline)

    # ------------------------------------------------------------ hot path
    def while_deciding(self, decide: Callable[..., T], *args: Any) -> T:
        """``decide(*args)`` with :attr:`deciding` set: the thread leaves it the GIL."""
        self.deciding = True
        try:
            return decide(*args)
        finally:
            self.deciding = False

    def offer(self, snapshot: Snapshot, engine_id: str, policy: str, params: Mapping[str, str],
              deployment: str = "") -> None:
        """One snapshot an engine sent, and the policy (registry name, parameters as text)
        and deployment that decided it."""
        self._put(("snap", snapshot, engine_id, policy, params, deployment))

    def offer_iteration(self, engine_id: str, features: np.ndarray, scenario: int, latency_ms: float) -> None:
        """One iteration an engine reported: its batch features and measured time."""
        self._put(("iter", engine_id, features, scenario, latency_ms))

    def offer_batch(self, engine_id: str, c: np.ndarray, u: np.ndarray, latency_ms: float) -> None:
        """One iteration as its batch (tokens and KV context per request)."""
        self._put(("batch", engine_id, c, u, latency_ms))

    def _put(self, item: tuple[Any, ...]) -> None:
        if self.inline:
            self._handle(item)
            return
        if len(self._q) >= self._queue:
            self.dropped += 1
            return
        self._q.append(item)  # atomic; the thread looks every POLL_S, woken early only when half full
        if len(self._q) == self._queue // 2:
            with self._cv:
                self._cv.notify()

    # ------------------------------------------------------------ the thread
    def _drain(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(POLL_S)  # not woken per item: that would race the decision for the GIL
                if not self._q and self._closed:
                    return
            while self._q:
                item = self._q.popleft()
                deferred = 0.0
                while self.deciding and deferred < MAX_DEFER_S:  # the GIL is the decision's first
                    time.sleep(DEFER_S)
                    deferred += DEFER_S
                try:
                    self._handle(item)
                except Exception:  # a recording must never take the service down
                    self.dropped += 1
                time.sleep(0)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "flush":
            if self._fh is not None:
                self._fh.flush()
            item[1].set()
        elif kind == "snap":
            self._snapshot(*item[1:])
        elif kind == "iter":
            _, eid, x, s, ms = item
            line = {"t": "iteration", "engine": eid, "ms": round(float(ms), 4), "x": [round(float(v), 6) for v in x],
                    "s": int(s)}
            e = self._engines.get(eid)
            if e is not None and math.isfinite(e.last_now):
                line["at"] = round(e.last_now, 4)  # the engine's latest snapshot: within an iteration
            self._write(line)
        else:
            _, eid, c, u, ms = item
            x, s = batch_features(np.asarray(c, np.int64), np.asarray(u, np.int64))
            self._handle(("iter", eid, x, s, ms))

    def _snapshot(self, snap: Snapshot, eid: str, policy: str, params: Mapping[str, str], deployment: str) -> None:
        now = float(snap.now)
        info = {"engine": eid, "policy": policy, "params": dict(params), "deployment": deployment,
                "max_batch_tokens": int(snap.max_batch_tokens), "max_num_seqs": int(snap.max_num_seqs)}
        e = self._engines.get(eid)
        if e is None:
            e = self._engines[eid] = _Engine(info)
            self._write({"t": "engine", "at": now, **info})
        elif e.info != info:
            e.info = info
            self._write({"t": "engine", "at": now, **info})
        if not math.isnan(e.last_now) and now > e.last_now:
            e.gaps.append(now - e.last_now)
        live = e.live
        ids = snap.ids
        computed, output = snap.computed_tokens.tolist(), snap.output_tokens.tolist()
        present = set(ids)
        gone = [rid for rid in live if rid not in present]
        if gone:
            at = now
            gap = e.typical_gap()
            if gap and now - e.last_now > 3 * gap:  # the engine idled between: it ended earlier
                at = e.last_now + gap
            for rid in gone:
                self._write({**live.pop(rid).finished(at), "engine": eid})
        new = [i for i, rid in enumerate(ids) if rid not in live]
        if new:
            cols = {n: getattr(snap, n).tolist() for n in ("arrival", "prompt_tokens", "cached_tokens", "ttft_slo",
                                                          "tbt_slo", "priority", "sheddable", "e2e_slo", "tpot_slo")}
            for i in new:
                live[ids[i]] = _Live(cols["arrival"][i], cols["prompt_tokens"][i], cols["cached_tokens"][i],
                                     cols["ttft_slo"][i], cols["tbt_slo"][i], cols["priority"][i],
                                     cols["sheddable"][i], cols["e2e_slo"][i], cols["tpot_slo"][i], now)
        for i, rid in enumerate(ids):
            live[rid].advance(now, computed[i], output[i])
        e.last_now = now

    # ------------------------------------------------------------ files
    def _write(self, line: dict[str, Any]) -> None:
        if line.get("t") in self.written:
            self.written[line["t"]] += 1
        if self._fh is None or self._fh.tell() >= self.file_bytes:
            self._rotate()
        self._fh.write(json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n")

    def _rotate(self) -> None:
        if self._fh is not None:
            self._fh.close()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self._serial += 1
        path = self.dir / f"recording-{stamp}-{os.getpid()}-{self._serial:04d}.jsonl"
        self._files.append(path)
        self._fh = path.open("w", encoding="utf-8", buffering=1 << 16)
        self._fh.write(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "created": time.time(),
                                   "source": self.source}) + "\n")
        for e in self._engines.values():  # each file stands alone
            self._fh.write(json.dumps({"t": "engine", "at": e.last_now if math.isfinite(e.last_now) else 0.0,
                                       **e.info}) + "\n")
        while sum(p.stat().st_size for p in self._files[:-1] if p.exists()) + self.file_bytes > self.max_bytes:
            self._files.pop(0).unlink(missing_ok=True)
            if len(self._files) <= 1:
                break

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what was offered before is on disk (True), or ``timeout`` passed."""
        done = threading.Event()
        if self.inline:
            self._handle(("flush", done))
        else:
            self._q.append(("flush", done))  # not dropped, however full the queue
            with self._cv:
                self._cv.notify()
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, then every request still followed (``finished: false``)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for eid, e in self._engines.items():
            for r in e.live.values():
                line = r.finished(e.last_now)
                line.update(engine=eid, finished=False, last_token=None, late_s=None)
                self._write(line)
            e.live.clear()
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def stats(self) -> dict[str, Any]:
        return {"dropped": self.dropped, "queued": len(self._q), **self.written,
                "files": len(self._files)}


# ---------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True, slots=True)
class Recording:
    """One engine's recorded traffic (columns of equal length, arrivals sorted)."""

    engine: str
    #: the engine's limits and the policy that served it (the last ``engine`` line)
    info: dict[str, Any]
    #: policies seen serving this engine, with how many requests each
    policies: dict[str, int]
    requests: dict[str, np.ndarray]
    #: iterations: batch features (N, 7), scenarios (N,), measured ms (N,)
    features: np.ndarray
    scenarios: np.ndarray
    latency_ms: np.ndarray
    files: int
    #: when each iteration was reported, on the engine clock of the requests' times, within
    #: an iteration (N,; NaN where the line has none: recorded before the field existed)
    iteration_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.requests["arrival"])


def _lines(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
        try:
            head = json.loads(first)
        except json.JSONDecodeError:
            raise RecordingError(f"{path}: not a recording (its first line is not JSON)") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            raise RecordingError(f"{path}: not a {FORMAT} file")
        if head.get("version") != FORMAT_VERSION:
            raise RecordingError(f"{path}: recording format version {head.get('version')!r}; this slidingserve "
                                 f"reads version {FORMAT_VERSION}")
        for no, text in enumerate(fh, 2):
            if not text.endswith("\n"):
                return  # the line being written when the file was read (or cut): skipped
            try:
                yield no, json.loads(text)
            except json.JSONDecodeError:
                raise RecordingError(f"{path}:{no}: truncated or corrupt line") from None


def read_recording(directory: str | os.PathLike[str], engine: str = "", *, prefix: str = "") -> Recording:
    """The recording in ``directory`` of ``engine`` (default: the engine with the most
    requests, of those whose id starts with ``prefix``).  :class:`RecordingError` (one line) for a missing or empty directory, a file of
    another format or version, a corrupt line, or no finished request."""
    d = Path(directory)
    if not d.is_dir():
        raise RecordingError(f"{d}: no such directory")
    files = sorted(d.glob("recording-*.jsonl"))
    if not files:
        raise RecordingError(f"{d}: no recording files (recording-*.jsonl); record with `record: DIR` in "
                             "server.yaml or SLIDINGSERVE_RECORD=DIR on the engine")
    reqs: dict[str, list[tuple[Any, ...]]] = collections.defaultdict(list)
    its: dict[str, list[tuple[list[float], int, float, float]]] = collections.defaultdict(list)
    infos: dict[str, dict[str, Any]] = {}
    served: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for path in files:
        eng: dict[str, Any] = {}
        for no, line in _lines(path):
            t, eid = line.get("t"), str(line.get("engine", ""))
            try:
                if t == "engine":
                    infos[eid] = eng[eid] = line
                elif t == "request":
                    reqs[eid].append(tuple(line[k] for k in REQUEST_FIELDS))
                    served[eid][_label(eng.get(eid, {}))] += 1
                elif t == "iteration":
                    its[eid].append((line["x"], int(line["s"]), float(line["ms"]), float(line.get("at", math.nan))))
            except (KeyError, TypeError, ValueError):
                raise RecordingError(f"{path}:{no}: a {t} line without its fields") from None
    if prefix:
        reqs = collections.defaultdict(list, {k: v for k, v in reqs.items() if k.startswith(prefix)})
    if not reqs:
        raise RecordingError(f"{d}: the recording holds no finished request yet")
    if engine and engine not in reqs:
        raise RecordingError(f"{d}: no requests of engine {engine!r}; engines: {', '.join(sorted(reqs))}")
    eid = engine or max(reqs, key=lambda k: len(reqs[k]))
    rows = sorted(reqs[eid], key=lambda r: r[0])
    cols = {k: np.array([r[j] if r[j] is not None else np.nan for r in rows], dtype=np.float64)
            for j, k in enumerate(REQUEST_FIELDS)}
    it = its.get(eid, [])
    x = np.array([r[0] for r in it], dtype=np.float64).reshape(-1, 7)
    return Recording(eid, infos.get(eid, {}), dict(served[eid]), cols, x,
                     np.array([r[1] for r in it], dtype=np.int64), np.array([r[2] for r in it], dtype=np.float64),
                     len(files), np.array([r[3] for r in it], dtype=np.float64))


def _label(info: Mapping[str, Any]) -> str:
    return policy_label(str(info.get("policy", "")), info.get("params") or {})


def policy_label(policy: str, params: Mapping[str, str]) -> str:
    """``name:k=v:k2=v2`` (the what-if's spelling of a policy with parameters)."""
    return ":".join([policy, *(f"{k}={v}" for k, v in sorted(params.items()))])


@functools.lru_cache(maxsize=256)
def _defaults(name: str) -> dict[str, str]:
    return _all_params(registry.create(name))


def _all_params(policy: Any) -> dict[str, str]:
    p = getattr(policy, "params", None)
    if p is None or not dataclasses.is_dataclass(p):
        return {}
    return {f.name: param_text(getattr(p, f.name)) for f in dataclasses.fields(p)}


def params_text(policy: Any) -> dict[str, str]:
    """A policy object's parameters that differ from its defaults, as text (what the
    registry takes back)."""
    base = _defaults(policy.name)
    return {k: v for k, v in _all_params(policy).items() if base.get(k) != v}
