"""The processes of a live run: vLLM's OpenAI server (the CPU build) and ``slidingserve serve``.

Pinning on a small machine: vLLM's CPU worker binds its OpenMP threads to the cores in
``VLLM_CPU_OMP_THREADS_BIND`` (the last core here), so the forward pass has a core of its
own; the API server process, the scheduling service and the client are moved to the other
cores once they run.  Everything stays local: the model is a folder with a ``config.json``
and a tokenizer, weights are drawn at load (``--load-format dummy``), no hub is reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

__all__ = ["CpuUse", "EngineArgs", "ServiceProcess", "VllmProcess", "free_port", "pin", "scrape", "worker_cores"]

#: vLLM's OpenAI-compatible server, the module ``vllm serve`` runs (the CPU build's ``vllm``
#: command cannot start: docs/vllm.md).
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
SCHEDULER_CLS = "engine_adapter.vllm.RemoteSyncScheduler"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_cores() -> tuple[int, set[int]]:
    """(the core vLLM's worker gets, the cores left for everything else)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return cores[0], set(cores)
    return cores[-1], set(cores[:-1])


def pin(pid: int, cores: set[int]) -> None:
    """Move process ``pid`` (0: this one) to ``cores``; a no-op where that is not allowed."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, cores)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def _wait(what: str, ok: Callable[[], bool], timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}; its log ({log}) ends:\n"
                               + _tail(log))
        with contextlib.suppress(Exception):
            if ok():
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready within {timeout_s:g} s; its log ({log}) ends:\n" + _tail(log))


def _get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus endpoint on this machine: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(f"http://127.0.0.1:{port}/metrics")
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLIDINGSERVE_", "VLLM_"))}


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    # the engine core and its workers share the session: none may be left behind
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """The engine settings every configuration of a run shares."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    kv_cache_gib: int = 2
    prefix_caching: bool = False

    def argv(self) -> list[str]:
        return ["--load-format", "dummy", "--enforce-eager", "--dtype", "float32",
                "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]


class VllmProcess:
    """One ``vllm serve`` of the model folder: vLLM's own scheduler (``settings`` None) or
    the adapter, whose settings file (``SLIDINGSERVE_CONFIG``) the runner rewrites to switch
    policy and service without a restart."""

    def __init__(self, workdir: Path, model: str, engine: EngineArgs, *, name: str,
                 settings: Path | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.workdir, self.model, self.engine, self.name = workdir, model, engine, name
        self.settings = settings
        self.extra_env = extra_env or {}
        self.port = free_port()
        self.metrics_port = free_port() if settings is not None else None
        self.log = workdir / f"vllm-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def argv(self) -> list[str]:
        out = [sys.executable, "-m", ENTRY, "--model", self.model, "--served-model-name", "live",
               *self.engine.argv(), "--port", str(self.port), "--host", "127.0.0.1"]
        if self.settings is not None:
            out += ["--scheduler-cls", SCHEDULER_CLS]
        return out

    def env(self, worker_core: int) -> dict[str, str]:
        env = _clean_env()
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(self.engine.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(worker_core),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HOME": str(self.workdir / "hf-home"), "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache"),
            "PYTHONUNBUFFERED": "1",
        })
        if self.engine.prefix_caching:  # for POST /reset_prefix_cache between runs (loopback only)
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.settings is not None:
            env.update({"SLIDINGSERVE_CONFIG": str(self.settings), "SLIDINGSERVE_ENGINE_ID": f"live-{self.name}",
                        "SLIDINGSERVE_METRICS_PORT": str(self.metrics_port)})
        env.update(self.extra_env)
        return env

    def start(self, worker_core: int, other_cores: set[int], timeout_s: float = 900) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=self.env(worker_core), start_new_session=True)
        _wait(f"vllm serve ({self.name})", lambda: _get(f"http://127.0.0.1:{self.port}/health") is not None,
              timeout_s, self.proc, self.log)
        pin(self.proc.pid, other_cores)  # the API server; the engine core keeps the worker's core

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Empty vLLM's prefix cache (``POST /reset_prefix_cache``, a dev-mode route), so that a
        run does not find the prompts of the run before it on the same engine (the same
        requests, replayed for each configuration); retried while blocks are still held."""
        end = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", method="POST")
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read().decode()).get("success"):
                    return
            if time.monotonic() > end:
                raise RuntimeError(f"vllm serve ({self.name}) did not empty its prefix cache within {timeout_s:g} s")
            time.sleep(0.5)

    def adapter_info(self) -> dict[str, str]:
        """The adapter's ``slidingserve_adapter_info`` labels (address, policy, ...)."""
        assert self.metrics_port is not None
        for name, labels, _ in scrape(self.metrics_port):
            if name == "slidingserve_adapter_info":
                return labels
        return {}

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


def _threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` and of its descendants."""
    import psutil  # a dependency of vLLM

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            out += [t.id for t in p.threads()]
    return out


def _tree_cpu(pid: int, worker_core: int) -> tuple[float, float, dict[int, float]]:
    """CPU seconds (user + system) of process ``pid`` itself, of its descendants, and per
    thread of its descendants bound to ``worker_core`` alone (tid: seconds)."""
    import psutil

    try:
        root = psutil.Process(pid)
        kids = root.children(recursive=True)
        own = sum(root.cpu_times()[:2])
    except psutil.NoSuchProcess:
        return 0.0, 0.0, {}
    rest, bound = 0.0, {}
    for p in kids:
        with contextlib.suppress(psutil.NoSuchProcess):
            rest += sum(p.cpu_times()[:2])
            for t in p.threads():
                with contextlib.suppress(OSError):
                    if os.sched_getaffinity(t.id) == {worker_core}:
                        bound[t.id] = t.user_time + t.system_time
    return own, rest, bound


@dataclass
class CpuUse:
    """Where the CPU went during a run: busy seconds per core (the worker's, the others'),
    and the CPU seconds of vLLM's API server, of its engine core (and of the engine's
    threads bound to the worker's core: the forward pass and what it starts), of the
    scheduling service and of the client (this process).  :meth:`since` gives the run's share."""

    worker_core: int
    other_cores: set[int]
    pids: dict[str, int]
    cores: dict[str, float] = dataclass_field(default_factory=dict)
    procs: dict[str, float] = dataclass_field(default_factory=dict)
    bound: dict[int, float] = dataclass_field(default_factory=dict)
    at: float = 0.0

    def sample(self) -> CpuUse:
        import psutil

        self.at = time.monotonic()
        for i, t in enumerate(psutil.cpu_times(percpu=True)):
            if i != self.worker_core and i not in self.other_cores:
                continue
            key = "worker_core" if i == self.worker_core else "other_cores"
            self.cores[key] = self.cores.get(key, 0.0) + sum(t) - t.idle - getattr(t, "iowait", 0.0)
        self.procs["client"] = sum(psutil.Process().cpu_times()[:2])
        for name, pid in self.pids.items():
            own, rest, bound = _tree_cpu(pid, self.worker_core)
            if name == "vllm":
                self.procs["api_server"], self.procs["engine"], self.bound = own, rest, bound
            else:
                self.procs[name] = own + rest
        return self

    def since(self, start: CpuUse) -> dict[str, float]:
        """Busy shares of the cores and CPU seconds per process over ``[start, self]``."""
        wall = max(self.at - start.at, 1e-9)
        # Busy time is the sum of a core's counters less idle and iowait, and Linux's iowait
        # can run backwards: an idle core's difference can come out a hair below zero.
        busy = {k: max(v - start.cores.get(k, 0.0), 0.0) for k, v in self.cores.items()}
        out = {"wall_s": wall, "worker_core_busy": busy["worker_core"] / wall}
        n_other = max(len(self.other_cores - {self.worker_core}), 1)
        out["other_cores_busy"] = busy.get("other_cores", 0.0) / (wall * n_other)
        out["n_other_cores"] = float(n_other)
        out |= {f"{k}_s": v - start.procs.get(k, 0.0) for k, v in self.procs.items()}
        out["engine_on_worker_s"] = sum(v - start.bound[t] for t, v in self.bound.items() if t in start.bound)
        return out


class ServiceProcess:
    """``slidingserve serve`` on loopback, pinned off the worker's core."""

    def __init__(self, workdir: Path, cores: set[int], *, refit_every: int = 128) -> None:
        self.workdir, self.cores = workdir, cores
        self.port, self.metrics_port = free_port(), free_port()
        self.config = workdir / "service.yaml"
        self.config.write_text(f"host: 127.0.0.1\nport: {self.port}\nmetrics_port: {self.metrics_port}\n"
                               f"refit_every: {refit_every}\n")
        self.log = workdir / "service.log"
        self.proc: subprocess.Popen[bytes] | None = None
        #: the service's nice value (it starts at this process's)
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300) -> None:
        argv: Sequence[str] = [str(Path(sys.executable).parent / "slidingserve"), "serve", "--config",
                               str(self.config)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=_clean_env(), start_new_session=True)
        pin(self.proc.pid, self.cores)
        _wait("slidingserve serve", lambda: bool(scrape(self.metrics_port)), timeout_s, self.proc, self.log)

    def place(self, cores: set[int]) -> None:
        """Run every thread of the service (and of its worker processes) on ``cores``."""
        assert self.proc is not None
        if cores == self.cores:
            return
        for tid in _threads(self.proc.pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores)
        self.cores = cores

    def renice(self, nice: int | None) -> None:
        """Run the service at nice ``nice`` (absolute), or at the sweep's own priority for None."""
        assert self.proc is not None
        own = os.getpriority(os.PRIO_PROCESS, 0)
        if nice is None and self.nice == own:
            return
        want = own if nice is None else nice
        # Linux keeps a nice value per thread: every thread of the service and of its worker
        # processes (threads started later inherit it from the thread that starts them)
        for tid in _threads(self.proc.pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, want)
            except ProcessLookupError:
                continue
            except PermissionError as e:
                raise RuntimeError(f"cannot run slidingserve serve at nice {want} ({e}); a negative "
                                   "service_nice needs root") from None
        self.nice = want

    def _sum_count(self, histogram: str) -> tuple[float, float]:
        """(sum, count) of one of the service's histograms, over all its label values."""
        s = c = 0.0
        for name, _, v in scrape(self.metrics_port):
            if name == histogram + "_sum":
                s += v
            elif name == histogram + "_count":
                c += v
        return s, c

    def decisions(self) -> tuple[float, float]:
        """(sum of seconds, count) of the service's ``slidingserve_decision_seconds``."""
        return self._sum_count("slidingserve_decision_seconds")

    def predictor_error(self) -> tuple[float, float]:
        """(sum, count) of the service's ``slidingserve_predictor_abs_error_ms`` over every profile."""
        return self._sum_count("slidingserve_predictor_abs_error_ms")

    def overruns(self) -> dict[str, float]:
        """Reports measured above the prediction (``none``) and above it × the learned margin
        (``learned``), over every profile; ``reports``: all the service accepted."""
        out = {"none": 0.0, "learned": 0.0, "reports": 0.0}
        for name, labels, v in scrape(self.metrics_port):
            if name == "slidingserve_predictor_overruns_total":
                out[labels.get("margin", "?")] = out.get(labels.get("margin", "?"), 0.0) + v
            elif name == "slidingserve_predictor_abs_error_ms_count":
                out["reports"] += v
        return out

    def refits(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, labels, v in scrape(self.metrics_port):
            if name == "slidingserve_predictor_refits_total":
                out[labels.get("outcome", "?")] = out.get(labels.get("outcome", "?"), 0.0) + v
        return out

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
