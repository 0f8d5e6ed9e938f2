"""The sweep of a live benchmark: rates x seeds x configurations, seeds interleaved.

A configuration is ``vllm`` (vLLM's own scheduler, its own server) or ``MODE:POLICY`` with
``MODE`` ``inproc`` (the policy inside the engine process) or ``remote`` (through
``slidingserve serve`` over gRPC), optionally ``MODE:POLICY:k=v,k2=v2`` with policy
parameters.  All adapter configurations share one ``vllm serve``: the runner rewrites its
settings file (address, policy, parameters) and checks on the adapter's metrics endpoint
that the engine took them.  Every run appends one JSON line to ``runs.jsonl`` in the output
folder; a run already there is not repeated, so an interrupted sweep resumes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .client import LoopLag, run_requests
from .judge import run_judge, write_dataset
from .measure import RequestResult, Slo, summarize
from .procs import CpuUse, EngineArgs, ServiceProcess, VllmProcess, pin, scrape, worker_cores
from .workload import LiveRequest, WorkloadSpec, make_requests

if TYPE_CHECKING:
    from scheduler_service.client import PredictorInfo
    from scheduler_service.core import BatchLatencyPredictor

__all__ = ["Config", "LiveSpec", "check_resumable", "find_capacity", "frontend_path", "resolve_rates", "run_sweep"]

NATIVE = "vllm"
#: vLLM's own scheduler run a second time on the same arrivals (the A/A noise floor of every
#: comparison: :func:`.report.aa_table`)
NATIVE_AGAIN = "vllm-again"
#: vLLM's own scheduler on the adapter's engine, the adapter only recording (``SLIDINGSERVE_OBSERVE``)
OBSERVE = "observe"
MODES = ("inproc", "remote")
#: The objectives a configuration's requests can carry (``objective=`` in its text, not a
#: policy parameter): ``formula1`` (the TTFT and TBT defaults, formula (1)) or ``tpot`` (each
#: request also sends ``slo_tpot_ms`` = the TBT objective in ``vllm_xargs``: the scheduler
#: plans for the mean time per output token, as ``vllm bench serve --goodput`` judges).
OBJECTIVES = ("formula1", "tpot")
#: ``service_nice=N`` in a remote configuration's text (not a policy parameter): the service
#: process runs at nice N for that configuration's runs (absolute, -20..19; the sweep's own
#: priority otherwise).  It tests whether remote plans lose to in-process ones because the
#: service shares a core with the client and the API server (negative values need root).
SERVICE_NICE = "service_nice"
#: ``service_cores=worker`` in a remote configuration's text: the service's threads run on
#: vLLM's worker core (where, in process, the policy runs: on the engine core's main
#: thread and the decision thread it starts, both bound there with the forward pass);
#: ``others`` (the default) on the cores the API server and the client share.  It tests
#: whether remote loses to in process because of where its CPU time lands.
SERVICE_CORES = "service_cores"
#: ``shed_after=X`` in a configuration's text (not a policy parameter): the engine's wait
#: bound, ``SLIDINGSERVE_SHED_AFTER`` (docs/operations.md, "Bounded waits"; 0 = off).
SHED_AFTER = "shed_after"


@dataclass(frozen=True, slots=True)
class Config:
    label: str
    mode: str  # "native", "inproc" or "remote"
    policy: str = ""
    params: tuple[tuple[str, str], ...] = ()
    objective: str = "formula1"
    #: the service's nice value for this configuration's runs (None: the sweep's own)
    service_nice: int | None = None
    #: where the service's threads run for this configuration's runs: "others" or "worker"
    service_cores: str = "others"
    #: the engine's wait bound (``shed_after=X``; 0 = off)
    shed_after: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Config:
        text = text.strip()
        if text in (NATIVE, NATIVE_AGAIN):
            return cls(text, "native")
        if text == OBSERVE:  # the policy its settings name (vLLM schedules every iteration itself)
            return cls(text, OBSERVE, "vllm-fcfs")
        mode, _, rest = text.partition(":")
        policy, _, params = rest.partition(":")
        if mode not in MODES or not policy:
            raise ValueError(f"configuration {text!r}: expected 'vllm', '{NATIVE_AGAIN}' or MODE:POLICY[:k=v,...] "
                             f"with MODE in {', '.join(MODES)}")
        kv = []
        for item in filter(None, params.split(",")):
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise ValueError(f"configuration {text!r}: parameter {item!r} is not k=v")
            kv.append((k.strip(), v.strip()))
        objective = dict(kv).get("objective", "formula1")
        if objective not in OBJECTIVES:
            raise ValueError(f"configuration {text!r}: objective must be one of {', '.join(OBJECTIVES)}, "
                             f"got {objective!r}")
        nice = _service_nice(text, mode, dict(kv).get(SERVICE_NICE))
        cores = _service_cores(text, mode, dict(kv).get(SERVICE_CORES))
        shed_after = _shed_after(text, dict(kv).get(SHED_AFTER, "0"))
        kv = [(k, v) for k, v in kv if k not in ("objective", SERVICE_NICE, SERVICE_CORES, SHED_AFTER)]
        from scheduler_service.core import registry

        registry.create(policy, dict(kv))  # fails here, with the policy's own message, on a bad name or value
        return cls(text, mode, policy, tuple(kv), objective, nice, cores, shed_after)

    def xargs(self, slo: Slo) -> dict[str, Any] | None:
        """What each request of this configuration carries in ``vllm_xargs``."""
        return {"slo_tpot_ms": slo.tbt_ms} if self.objective == "tpot" else None

    def settings(self, service_address: str, slo: Slo, record: str = "") -> dict[str, Any]:
        """The adapter's settings file for this configuration (``record``: the directory of
        the run's traffic recording, "" for none)."""
        return {"address": service_address if self.mode == "remote" else "inproc", "policy": self.policy,
                "params": dict(self.params), "default_ttft_ms": slo.ttft_ms, "default_tbt_ms": slo.tbt_ms,
                "shed_after": self.shed_after, "record": record, "observe": self.mode == OBSERVE}


def _shed_after(text: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0 <= x <= 1000:
        raise ValueError(f"configuration {text!r}: {SHED_AFTER} must be a number from 0 to 1000 (times the TTFT "
                         f"SLO), got {value!r}")
    return x


def _service_nice(text: str, mode: str, value: str | None) -> int | None:
    if value is None:
        return None
    if mode != "remote":
        raise ValueError(f"configuration {text!r}: {SERVICE_NICE} applies to remote configurations only")
    try:
        nice = int(value)
    except ValueError:
        nice = 99
    if not -20 <= nice <= 19:
        raise ValueError(f"configuration {text!r}: {SERVICE_NICE} must be an integer from -20 to 19, got {value!r}")
    return nice


def _service_cores(text: str, mode: str, value: str | None) -> str:
    if value is None:
        return "others"
    if mode != "remote":
        raise ValueError(f"configuration {text!r}: {SERVICE_CORES} applies to remote configurations only")
    if value not in ("others", "worker"):
        raise ValueError(f"configuration {text!r}: {SERVICE_CORES} must be 'others' or 'worker', got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class LiveSpec:
    configs: tuple[Config, ...]
    rates: tuple[float, ...]
    seeds: tuple[int, ...]
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineArgs = field(default_factory=EngineArgs)
    slo: Slo = field(default_factory=Slo)
    model: dict[str, Any] = field(default_factory=dict)
    #: the adapter's plan deadline; remote plans later than this fall back to vLLM's scheduler
    deadline_ms: float = 20.0
    #: seeds whose runs are replayed once more by vLLM's own benchmark client (:mod:`.judge`)
    judge_seeds: tuple[int, ...] = ()
    #: a run starts once processes outside the benchmark keep at most this many cores busy
    max_foreign: float = 0.3
    #: how long a run waits for that (seconds) before the sweep stops
    quiet_wait_s: float = 600.0
    #: run on a busy machine all the same (the runs are flagged ``shared``)
    allow_shared: bool = False
    #: rates as multiples of the day's capacity (used where ``rates`` is empty): the sweep
    #: first finds vLLM's capacity (:func:`find_capacity`) unless ``capacity_rps`` gives it
    loads: tuple[float, ...] = ()
    capacity_rps: float | None = None
    #: the capacity probes' arrivals (a seed the sweep does not use)
    capacity_seed: int = 1000
    #: the adapter's engine records each run's traffic (``recordings/<config>/<rate>-<seed>``,
    #: for ``slidingserve whatif``)
    record: bool = False

    def at_capacity(self, capacity: float) -> LiveSpec:
        """This sweep with its rates set from ``loads`` at ``capacity`` req/s."""
        return replace(self, capacity_rps=capacity, rates=tuple(round(capacity * m, 2) for m in self.loads))

    def order(self) -> list[tuple[float, int, Config]]:
        """Every run: rate by rate, seed by seed, the configurations rotated per seed so that
        none always runs first."""
        out = []
        n = len(self.configs)
        for rate in self.rates:
            for j, seed in enumerate(self.seeds):
                out += [(rate, seed, self.configs[(j + i) % n]) for i in range(n)]
        return out


def _done(path: Path) -> set[tuple[str, float, int]]:
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.add((r["config"], float(r["rate"]), int(r["seed"])))
    return out


def _counters(v: VllmProcess) -> dict[str, float]:
    """The adapter's planned / native iterations and fallbacks by reason, as totals."""
    assert v.metrics_port is not None
    out: dict[str, float] = {}
    for name, labels, val in scrape(v.metrics_port):
        if name in ("slidingserve_adapter_planned_total", "slidingserve_adapter_native_total",
                    "slidingserve_adapter_iterations_total", "slidingserve_adapter_own_seconds_total",
                    "slidingserve_adapter_pipelined_total", "slidingserve_adapter_resyncs_total"):
            out[name.removeprefix("slidingserve_adapter_").removesuffix("_total")] = val
        elif name == "slidingserve_adapter_fallbacks_total":
            out["fallback_" + labels.get("reason", "?")] = val
        elif name == "slidingserve_adapter_decision_seconds_bucket":
            out["decision_le_" + labels.get("le", "?")] = val
        elif name in ("slidingserve_adapter_decision_seconds_sum", "slidingserve_adapter_decision_seconds_count"):
            out[name.removeprefix("slidingserve_adapter_")] = val
    return out


def _decision_path(ad: dict[str, float]) -> None:
    """Replace the run's decision-time histogram in ``ad`` (the adapter's counters over the
    run) by its mean (ms) and the shares of answers over 10 ms and over 20 ms."""
    n = ad.pop("decision_seconds_count", 0.0)
    total = ad.pop("decision_seconds_sum", 0.0)
    le = {k.removeprefix("decision_le_"): ad.pop(k) for k in [k for k in ad if k.startswith("decision_le_")]}
    if n > 0:
        ad["decision_ms_mean"] = 1e3 * total / n
        for cut, key in (("0.01", "decision_over_10ms"), ("0.02", "decision_over_20ms")):
            if cut in le:
                ad[key] = (n - le[cut]) / n


#: vLLM's own request timings (its API server's /metrics), histograms in seconds: what the
#: server saw, to set beside what the client saw.
_VLLM_TIMINGS = {"vllm:time_to_first_token_seconds": "ttft", "vllm:request_queue_time_seconds": "queue",
                 "vllm:request_prefill_time_seconds": "prefill", "vllm:inter_token_latency_seconds": "itl",
                 "vllm:e2e_request_latency_seconds": "e2e"}


def _vllm_timings(v: VllmProcess) -> dict[str, float]:
    """Sum and count of each of vLLM's request timing histograms, so far."""
    out: dict[str, float] = {}
    for name, _, val in scrape(v.port):
        for suffix in ("_sum", "_count"):
            base = name.removesuffix(suffix)
            if name.endswith(suffix) and base in _VLLM_TIMINGS:
                out[_VLLM_TIMINGS[base] + suffix] = out.get(_VLLM_TIMINGS[base] + suffix, 0.0) + val
        if name in _PREFIX_CACHE:  # prompt tokens looked up in / found in vLLM's prefix cache
            out[_PREFIX_CACHE[name]] = out.get(_PREFIX_CACHE[name], 0.0) + val
    return out


_PREFIX_CACHE = {"vllm:prefix_cache_queries_total": "prefix_queries", "vllm:prefix_cache_hits_total": "prefix_hits"}


def _timing_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean of each timing over one run (ms)."""
    out = {}
    for key in _VLLM_TIMINGS.values():
        n = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
        if n > 0:
            out[key + "_mean_ms"] = 1e3 * (after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)) / n
    q = after.get("prefix_queries", 0.0) - before.get("prefix_queries", 0.0)
    if q > 0:  # the share of looked-up prompt tokens vLLM's prefix cache held over the run
        out["prefix_hit_rate"] = (after.get("prefix_hits", 0.0) - before.get("prefix_hits", 0.0)) / q
    return out


def _client_side(results: Sequence[RequestResult]) -> dict[str, float]:
    """The client's mean TTFT over every request of a run (warm-up ones included, as in
    vLLM's own histograms) and how late its event loop sent requests (mean, max; ms)."""
    ttfts = [1e3 * r.ttft_s for r in results if r.token_times]
    late = [1e3 * (r.sent - r.due) for r in results if not math.isnan(r.due)]
    out = {"ttft_mean_ms": sum(ttfts) / len(ttfts)} if ttfts else {}
    if late:
        out |= {"send_late_mean_ms": sum(late) / len(late), "send_late_max_ms": max(late)}
    return out


def _prime(server: VllmProcess) -> None:
    """A few short requests before the first run: the engine's first steps (and, with the
    adapter, the policy's first build: its compiled kernels load then) take seconds that
    would otherwise land on the first run's requests."""
    reqs = [LiveRequest(i, 0.1 * i, tuple(range(3, 35)), 4, True) for i in range(4)]
    bad = [r.error for r in run_requests(server.base_url, "live", reqs, timeout_s=600) if not r.complete]
    if bad:
        raise RuntimeError(f"vllm serve ({server.name}) did not answer its first requests: {bad[0]}")


class _Bench:
    def __init__(self, spec: LiveSpec, out: Path, model_dir: str, log: Callable[[str], None]) -> None:
        self.spec, self.out, self.model_dir, self.log = spec, out, model_dir, log
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.settings = self.work / "adapter.json"
        self.worker, self.others = worker_cores()
        self.native: VllmProcess | None = None
        self.adapter: VllmProcess | None = None
        self.service: ServiceProcess | None = None

    def start(self) -> None:
        model_dir = self.model_dir
        modes = {c.mode for c in self.spec.configs}
        if "remote" in modes:
            self.service = ServiceProcess(self.work, self.others)
            self.log("starting slidingserve serve")
            self.service.start()
        first = next((c for c in self.spec.configs if c.mode != "native"), None)
        if first is not None:  # (start-up's traffic, the warm-up, recorded apart from the runs')
            self.write_settings(first, str(self.out / "recordings" / "_start") if self.spec.record else "")
            self.adapter = VllmProcess(self.work, model_dir, self.spec.engine, name="adapter", settings=self.settings,
                                       extra_env={"SLIDINGSERVE_DEADLINE_MS": f"{self.spec.deadline_ms:g}"})
            self.log(f"starting vllm serve with the adapter (worker on core {self.worker}; 1-3 minutes)")
            self.adapter.start(self.worker, self.others)
        if "native" in modes:
            self.native = VllmProcess(self.work, model_dir, self.spec.engine, name="native")
            self.log(f"starting vllm serve with vLLM's own scheduler (worker on core {self.worker}; 1-3 minutes)")
            self.native.start(self.worker, self.others)
        pin(0, self.others)  # the client
        for server in (self.adapter, self.native):
            if server is not None:
                _prime(server)

    def write_settings(self, c: Config, record: str = "") -> None:
        addr = self.service.address if self.service is not None else ""
        tmp = self.settings.with_suffix(".tmp")
        tmp.write_text(json.dumps(c.settings(addr, self.spec.slo, record)))
        tmp.replace(self.settings)

    def _predictor_info(self) -> PredictorInfo | None:
        """The service's record of this engine's predictor (None without a service, or
        before the engine reported)."""
        if self.service is None or self.adapter is None or self.service.proc is None:
            return None
        from scheduler_service.client import SchedulerClient

        key = self.adapter.adapter_info().get("profile", "")
        with SchedulerClient(self.service.address) as client:
            info = client.get_predictor(profile=key or None, timeout_s=10)
        return info if info.reports_accepted else None

    def served_predictor(self) -> BatchLatencyPredictor | None:
        """The service's current predictor of this engine."""
        info = self._predictor_info()
        return info.predictor if info is not None else None

    def save_predictor(self) -> None:
        """The service's predictor of this engine, fitted on the remote runs' iteration
        reports: ``engine_predictor.json`` (the engine's cost model; :mod:`.sim` replays
        the sweep on it)."""
        info = self._predictor_info()
        if info is not None:
            (self.out / "engine_predictor.json").write_text(json.dumps(info.to_dict(), indent=2))
            self.log(f"wrote {self.out / 'engine_predictor.json'} (profile {info.profile_key}, "
                     f"{info.reports_accepted} reports, {info.published} of {info.refits} refits published)")

    def stop(self) -> None:
        for p in (self.native, self.adapter, self.service):
            if p is not None:
                p.stop()

    def run(self, rate: float, seed: int, c: Config) -> dict[str, Any]:
        server = self._configure(c, recording_path(self.out, c.label, rate, seed) if self.spec.record else None)
        before = _counters(server) if c.mode != "native" else {}
        marks = self._service_marks()
        quiet = self.wait_quiet(server)
        reqs = make_requests(self.spec.workload, rate, seed)
        if self.spec.engine.prefix_caching:  # every configuration starts from an empty cache
            server.reset_prefix_cache()
        timings0 = _vllm_timings(server)
        cpu0 = self._cpu(server)
        lag = LoopLag()
        results = run_requests(server.base_url, "live", reqs, xargs=c.xargs(self.spec.slo), lag=lag)
        cpu = self._cpu(server).since(cpu0)
        measured = [r for r in results if not reqs[r.index].warmup]
        summary = summarize(measured, self.spec.slo)
        rec: dict[str, Any] = {"config": c.label, "mode": c.mode, "policy": c.policy or NATIVE, "rate": rate,
                               "seed": seed, **summary.to_dict(), "time": time.time(),
                               # the machine's 1-minute load at the end: other work on shared cores shows here
                               "loadavg": os.getloadavg()[0],
                               # cores kept busy by processes outside the benchmark: before the run
                               # (what the quiet check saw) and over it
                               "foreign_before": quiet, "foreign_during": foreign_share(cpu),
                               "shared": max(quiet, foreign_share(cpu)) > self.spec.max_foreign,
                               # what vLLM's server saw of the same requests (warm-up ones included)
                               "vllm_timings": _timing_means(timings0, _vllm_timings(server)),
                               "client": _client_side(results) | lag.summary(),
                               # where the CPU went: the cores' busy shares, each process's seconds
                               "cpu": cpu}
        if self.spec.engine.prefix_caching:
            rec["prefix_cache_reset"] = True  # sweeps from before the reset ran on a warm cache
        self._save_frontend(c, rate, seed, results, lag, rec)
        if c.mode != "native":
            self._adapter_record(server, c, before, rec)
        self._service_record(c, marks, rec)
        if seed in self.spec.judge_seeds:
            rec["judge"] = self.judge(server, [r for r in reqs if not r.warmup], c, rate, seed)
        return rec

    def _configure(self, c: Config, record: Path | None = None) -> VllmProcess:
        """The server that runs ``c``, set up for it (the adapter's settings, with the run's
        recording directory; the service's priority and cores)."""
        server = self.native if c.mode == "native" else self.adapter
        assert server is not None
        if c.mode != "native":
            self.write_settings(c, str(record) if record is not None else "")
            time.sleep(1.2)  # the adapter checks its settings file once a second
        if self.service is not None:
            self.service.renice(c.service_nice)
            self.service.place({self.worker} if c.service_cores == "worker" else self.others)
        return server

    def _service_marks(self) -> dict[str, Any]:
        """The service's counters before a run, which its record is the difference from."""
        if self.service is None:
            return {"decisions": (0.0, 0.0), "error": (0.0, 0.0), "overruns": {}, "refits": {}}
        return {"decisions": self.service.decisions(), "error": self.service.predictor_error(),
                "overruns": self.service.overruns(), "refits": self.service.refits()}

    def _adapter_record(self, server: VllmProcess, c: Config, before: dict[str, float],
                        rec: dict[str, Any]) -> None:
        """The adapter's counters over the run, after checking it ran ``c``'s settings."""
        info = server.adapter_info()
        if info.get("policy") != c.policy or (info.get("address") == "inproc") != (c.mode in ("inproc", OBSERVE)):
            raise RuntimeError(f"the adapter did not take the settings of {c.label}: its metrics say {info}")
        after = _counters(server)
        rec["adapter"] = ad = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        # the adapter's engine-thread time per iteration: snapshots, waiting for the plan, execution
        ad["own_ms_per_iter"] = 1e3 * ad.pop("own_seconds", 0.0) / ad["iterations"] if ad.get("iterations") else None
        _decision_path(ad)
        rec["params"] = dict(c.params)

    def _service_record(self, c: Config, marks: dict[str, Any], rec: dict[str, Any]) -> None:
        """The service's predictor error and refits over the run; for a remote run also its
        time per decision, the overrun shares and the served predictor's margin."""
        if self.service is None:
            return
        err0, refits0 = marks["error"], marks["refits"]
        s, n = self.service.predictor_error()
        rec["service_mae_ms"] = (s - err0[0]) / (n - err0[1]) if n > err0[1] else None
        rec["service_reports"] = n - err0[1]
        rec["service_refits"] = refits = self.service.refits()
        rec["service_refits_run"] = {k: v - refits0.get(k, 0.0) for k, v in refits.items() if v > refits0.get(k, 0.0)}
        if c.mode != "remote":  # the service plans only for remote runs
            return
        dec0, over0 = marks["decisions"], marks["overruns"]
        s, n = self.service.decisions()
        # the service's own time per decision (decode, validate, plan, encode), beside the
        # adapter's time per iteration: the rest of a remote decision is transport and waiting
        rec["service_decision_ms"] = 1e3 * (s - dec0[0]) / (n - dec0[1]) if n > dec0[1] else None
        rec["service_nice"] = self.service.nice
        rec["service_cores"] = c.service_cores
        over = self.service.overruns()
        dn = over["reports"] - over0.get("reports", 0.0)
        # the share of this run's iterations that ran over the promise plans were built on
        rec["overrun_share"] = {k: (over[k] - over0.get(k, 0.0)) / dn for k in ("none", "learned")} if dn else None
        served = self.served_predictor()
        rec["service_margin"] = served.margin if served is not None else None

    def wait_quiet(self, server: VllmProcess) -> float:
        """Wait until processes outside the benchmark keep at most ``spec.max_foreign``
        cores busy (checked over 3 s, every 10 s, up to ``spec.quiet_wait_s``); the last
        load seen.  RuntimeError when the machine stays busy, unless ``spec.allow_shared``
        (then the run goes ahead and its record says it shared the machine)."""
        deadline = time.monotonic() + self.spec.quiet_wait_s
        said = False
        while True:
            start = self._cpu(server)
            time.sleep(3.0)
            load = foreign_share(self._cpu(server).since(start))
            if load <= self.spec.max_foreign or self.spec.allow_shared or time.monotonic() >= deadline:
                break
            if not said:
                self.log(f"waiting for a quiet machine: other processes keep {load:.2f} cores busy "
                         f"(at most {self.spec.max_foreign:g}; up to {self.spec.quiet_wait_s:.0f} s)")
                said = True
            time.sleep(7.0)
        if load > self.spec.max_foreign and not self.spec.allow_shared:
            raise RuntimeError(f"the machine is not quiet: processes outside the benchmark keep {load:.2f} cores "
                               f"busy (at most {self.spec.max_foreign:g} allowed) after {self.spec.quiet_wait_s:.0f} "
                               "s of waiting; stop them, or give --allow-shared to run anyway (runs are flagged)")
        return round(load, 3)

    def _cpu(self, server: VllmProcess) -> CpuUse:
        pids = {"vllm": server.proc.pid} if server.proc is not None else {}
        for other in (self.native, self.adapter):  # the idle server is the benchmark's too
            if other is not None and other is not server and other.proc is not None:
                pids["other_vllm"] = other.proc.pid
        if self.service is not None and self.service.proc is not None:
            pids["service"] = self.service.proc.pid
        return CpuUse(self.worker, self.others, pids).sample()

    def _save_frontend(self, c: Config, rate: float, seed: int, results: Sequence[RequestResult], lag: LoopLag,
                       rec: dict[str, Any]) -> None:
        """What the client added to this run's timings, for the simulated replay
        (:func:`.sim.Frontend.load`): when each request was sent relative to when it was
        due, the event loop's lag over the run, and the client's TTFT minus vLLM's (means)."""
        t = rec["client"].get("ttft_mean_ms"), rec["vllm_timings"].get("ttft_mean_ms")
        doc = {"late_s": [round(r.sent - r.due, 5) if not math.isnan(r.due) else 0.0 for r in results],
               "lag": [(round(a, 4), round(b, 4)) for a, b in lag.samples],
               "frontend_ms": t[0] - t[1] if None not in t else None}
        path = frontend_path(self.out, c.label, rate, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))

    def judge(self, server: VllmProcess, reqs: Sequence[LiveRequest], c: Config, rate: float,
              seed: int) -> dict[str, Any]:
        """The same measured requests, at the same arrival times, replayed by vLLM's own
        benchmark client right after our run (so the policy and predictor are warm)."""
        name = f"judge-{c.label.replace(':', '_').replace(',', '_')}-{rate:g}-{seed}"
        data = self.work / f"{name}.jsonl"
        t0 = reqs[0].at_s
        write_dataset(data, [(len(r.prompt), r.output_len) for r in reqs], [r.at_s - t0 for r in reqs])
        res = run_judge(sys.executable, server.base_url, "live", data, None, len(reqs), seed, self.spec.slo.ttft_ms,
                        self.spec.slo.tbt_ms, self.work / "judge", f"{name}.json", tokenizer=self.model_dir)
        return dict(res)


def foreign_share(cpu: dict[str, float]) -> float:
    """Cores kept busy by processes outside the benchmark over a :meth:`CpuUse.since`
    window: every core's busy time less the CPU time of the benchmark's own processes (the
    client, vLLM's processes, the service), per second of wall time."""
    wall = cpu.get("wall_s", 0.0)
    if wall <= 0:
        return 0.0
    n_other = max(cpu.get("n_other_cores", 1.0), 1.0)
    busy = (cpu.get("worker_core_busy", 0.0) + cpu.get("other_cores_busy", 0.0) * n_other) * wall
    own = sum(v for k, v in cpu.items() if k.endswith("_s") and k not in ("wall_s", "engine_on_worker_s"))
    return max(busy - own, 0.0) / wall


def recording_path(out: Path, label: str, rate: float, seed: int) -> Path:
    """Where the adapter's engine records the traffic of one run (``--record``)."""
    return out / "recordings" / _file_name(label) / f"{rate:g}-{seed}"


def frontend_path(out: Path, label: str, rate: float, seed: int) -> Path:
    """Where a run's client-side delays are kept (``out/frontend/``)."""
    return out / "frontend" / f"{_file_name(label)}-{rate:g}-{seed}.json"


def _file_name(label: str) -> str:
    """A configuration's label as a file name (``inproc:slidingserve`` → ``inproc_slidingserve``)."""
    return "".join(ch if ch.isalnum() or ch in "-_=." else "_" for ch in label)


#: The capacity search's bar: the share of requests vLLM's own scheduler meets under TTFT+TPOT.
CAPACITY_BAR = 0.9


def find_capacity(probe: Callable[[float], float], start: float = 2.0, max_probes: int = 6,
                  tolerance: float = 0.1, floor: float = 0.05) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate at which ``probe(rate)`` (a share of requests met) reaches
    :data:`CAPACITY_BAR`, and the probes as (rate, share).  Doubles or halves from ``start``
    until a met and a missed rate bracket the bar, then bisects until they lie within
    ``tolerance`` of each other, in at most ``max_probes`` probes.  A met rate at or above a
    missed one is noise and does not count.  RuntimeError when even ``floor`` req/s misses."""
    probes: list[tuple[float, float]] = []
    rate = start
    while len(probes) < max_probes:
        probes.append((rate, probe(rate)))
        fail = min((r for r, a in probes if a < CAPACITY_BAR), default=math.inf)
        ok = max((r for r, a in probes if a >= CAPACITY_BAR and r < fail), default=0.0)
        if ok and fail < math.inf and fail <= ok * (1 + tolerance):
            break
        if not ok:
            if rate <= floor:
                break
            rate = max(round(rate / 2, 2), floor)
        else:
            rate = round(2 * ok if fail == math.inf else (ok + fail) / 2, 2)
        if any(r == rate for r, _ in probes):
            break
    fail = min((r for r, a in probes if a < CAPACITY_BAR), default=math.inf)
    ok = max((r for r, a in probes if a >= CAPACITY_BAR and r < fail), default=0.0)
    if not ok:
        raise RuntimeError(f"vLLM's own scheduler met fewer than {CAPACITY_BAR:.0%} of requests under TTFT+TPOT even "
                           f"at {min(r for r, _ in probes):g} req/s; give --rates, or looser --ttft-ms/--tbt-ms")
    return ok, probes


def resolve_rates(spec: LiveSpec, out: Path) -> LiveSpec:
    """``spec`` with its rates: as given, from ``spec.capacity_rps``, or from the capacity an
    earlier search saved in ``out/capacity.json``.  ValueError when none of them is known."""
    if spec.rates:
        return spec
    if spec.capacity_rps is not None:
        return spec.at_capacity(spec.capacity_rps)
    path = out / "capacity.json"
    if not path.exists():
        raise ValueError(f"no rates: give --rates or --capacity, or run the sweep (it saves {path})")
    return spec.at_capacity(float(json.loads(path.read_text())["capacity_rps"]))


def _search_capacity(bench: _Bench, spec: LiveSpec, out: Path, log: Callable[[str], None]) -> float:
    """vLLM's capacity this day (its own scheduler, ``spec.capacity_seed``'s arrivals), saved
    with its probes in ``out/capacity.json``."""
    native = next(c for c in spec.configs if c.label == NATIVE)
    records: list[dict[str, Any]] = []

    def probe(rate: float) -> float:
        rec = bench.run(rate, spec.capacity_seed, native)
        records.append(rec)
        log(f"capacity probe {len(records)}: {rate:g} req/s, vLLM met {rec['attain_tpot']:.0%} under TTFT+TPOT "
            f"({rec['attain_f1']:.0%} under formula (1)), TTFT max {rec['ttft_max_ms'] / 1e3:.2f} s")
        return float(rec["attain_tpot"])

    log(f"finding vLLM's capacity today: the highest rate meeting {CAPACITY_BAR:.0%} under TTFT+TPOT "
        f"(seed {spec.capacity_seed}, {spec.workload.requests} requests a probe)")
    cap, _ = find_capacity(probe)
    (out / "capacity.json").write_text(json.dumps(
        {"capacity_rps": cap, "bar": CAPACITY_BAR, "definition": "TTFT+TPOT", "seed": spec.capacity_seed,
         "time": time.time(), "probes": records}, indent=2))
    log(f"vLLM's capacity today: {cap:g} req/s; the sweep's rates: "
        + ", ".join(f"{m:g}x = {round(cap * m, 2):g}" for m in spec.loads))
    return cap


def _todo(spec: LiveSpec, runs: Path) -> list[tuple[float, int, Config]]:
    done = _done(runs)
    return [(r, s, c) for r, s, c in spec.order() if (c.label, r, s) not in done]


def run_sweep(spec: LiveSpec, out: Path, model_dir: str, *, log: Callable[[str], None] = print,
              progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Run every (rate, seed, configuration) not yet in ``out/runs.jsonl``; its path.  With
    ``spec.loads`` and no known capacity, vLLM's capacity is searched for first."""
    runs = out / "runs.jsonl"
    check_resumable(out, spec)
    out.mkdir(parents=True, exist_ok=True)
    search = False
    try:
        spec = resolve_rates(spec, out)
    except ValueError:
        if NATIVE not in [c.label for c in spec.configs]:
            raise RuntimeError("the capacity search runs vLLM's own scheduler: add vllm to --configs, "
                               "or give --rates or --capacity") from None
        search = True
    if not search and not _todo(spec, runs):
        log(f"every run is already in {runs}")
        return runs
    bench = _Bench(spec, out, model_dir, log)
    try:
        bench.start()
        if search:
            spec = bench.spec = spec.at_capacity(_search_capacity(bench, spec, out, log))
        (out / "spec.json").write_text(json.dumps(_spec_dict(spec), indent=2))
        todo = _todo(spec, runs)
        for i, (rate, seed, c) in enumerate(todo):
            rec = bench.run(rate, seed, c)
            if spec.capacity_rps:
                rec["capacity_rps"] = spec.capacity_rps
                rec["load"] = round(rate / spec.capacity_rps, 3)
            with open(runs, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            if progress is not None:
                at = f" ({rec['load']:g}x)" if "load" in rec else ""
                progress(i + 1, len(todo), f"{c.label} {rate:g} rps{at} seed {seed}: formula (1) "
                         f"{rec['attain_f1']:.1%}, TTFT+TPOT {rec['attain_tpot']:.1%}, "
                         f"TTFT max {rec['ttft_max_ms'] / 1e3:.2f} s")
        bench.save_predictor()
    finally:
        bench.stop()
    return runs


#: What a run measured depends on: a sweep resumes into a folder only with the same.
_MEASURED_WITH = ("workload", "engine", "slo", "model", "deadline_ms")


def check_resumable(out: Path, spec: LiveSpec) -> None:
    """Raise ValueError when ``out`` holds runs measured with other settings (rates, seeds
    and configurations may differ: a sweep can be extended)."""
    path = out / "spec.json"
    if not (out / "runs.jsonl").exists() or not path.exists():
        return
    old, new = json.loads(path.read_text()), json.loads(json.dumps(_spec_dict(spec)))
    # a folder from before a workload field existed was measured with its default
    old["workload"] = {**asdict(WorkloadSpec()), **old.get("workload", {})}
    diff = [k for k in _MEASURED_WITH if old.get(k) != new.get(k)]
    if diff:
        raise ValueError(f"{out} holds runs measured with other settings ({', '.join(diff)} differ); "
                         "give another --out")


def _spec_dict(spec: LiveSpec) -> dict[str, Any]:
    return {"configs": [c.label for c in spec.configs], "rates": list(spec.rates), "seeds": list(spec.seeds),
            "loads": list(spec.loads), "capacity_rps": spec.capacity_rps,
            "workload": asdict(spec.workload), "engine": asdict(spec.engine), "slo": asdict(spec.slo),
            "model": spec.model, "deadline_ms": spec.deadline_ms, "judge_seeds": list(spec.judge_seeds)}


def load_runs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


