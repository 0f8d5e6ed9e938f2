"""One simulated run: (policy, workload, profile, rate, seed, requests, transport, params) → summary.

What is expensive and the same for every run is cached per process, so that a worker pays for it
once, not once per run: the ground truth (trace and profile tables), the offline predictor fitted
from a seeded profiling sweep and, for ``transport="grpc"``, the embedded scheduling service.

Isolation between runs matters more than it looks: the predictor refits online from each run's
reports, so a run must not inherit what an earlier run taught it, or results would depend on which
worker ran which job in what order.  In-process runs get a fresh backend (and registry); gRPC runs
share one server per process, but each run reports under its own engine profile key, so the server
keeps a separate predictor per run, bootstrapped from the same offline fit.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from clients.workloads import CLASS_MIXES, Burst, ClassMix, SLOConfig, make_workload
from engine_adapter.core import AdapterCore, AdapterSettings, SchedulerBackend
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import EngineConfig, SimResult, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.sim.profiling import fit_profile_predictor
from scheduler_service.core import BatchLatencyPredictor

__all__ = ["MAIN_POLICIES", "OURS", "TRANSPORTS", "RunSpec", "install_predictors", "profile_predictor", "quiet_logs",
           "run"]

#: The policy the benchmarks compare the others with.
OURS = "slidingserve"
#: The four policies every comparison shows (baselines first, ours last).
MAIN_POLICIES = ("vllm-fcfs", "sarathi-edf", "qoserve", OURS)
TRANSPORTS = ("inproc", "grpc")
#: Size and seed of the offline profiling sweep each profile's predictor is fitted from.
PREDICTOR_SWEEP = 3000
PREDICTOR_SEED = 0
#: Most latency samples a run keeps for CDF plots (evenly spaced order statistics).
MAX_LATENCY_SAMPLES = 4000
#: A gRPC server serves this many runs, then a fresh one replaces it (bounded memory,
#: and below ServerConfig.max_profiles since every run has its own profile key).
_SERVER_RUNS = 48


def quiet_logs() -> None:
    """Warnings only: the predictor registry logs every online refit at info level,
    which would bury the progress bar.  Idempotent; called in every worker."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything that determines one run (picklable: it travels to workers)."""

    policy: str
    workload: str
    rate: float
    seed: int = 0
    n_requests: int = 500
    profile: str = DEFAULT_PROFILE
    transport: str = "inproc"
    #: Policy parameter overrides as sorted (key, value) pairs.
    params: tuple[tuple[str, str], ...] = ()
    burst: Burst | None = None
    #: Stop once more than this fraction of requests violated (goodput probes).
    stop_violation_fraction: float | None = None
    #: Keep TTFT/TBT samples (for CDF plots).
    keep_latencies: bool = False
    #: Display name (e.g. ``slidingserve[window=3]``); defaults to the policy.
    label: str = ""
    #: Per-iteration deadline of the scheduler call (matters for gRPC: a miss falls back).
    deadline_ms: float = 20.0  # AdapterSettings default
    #: The engine's wait bound (AdapterSettings.shed_after; 0 = off).
    shed_after: float = 0.0
    #: SLOs of the workload (None: the defaults of :class:`~clients.workloads.SLOConfig`).
    slo: SLOConfig | None = None
    #: A class mix of :data:`~clients.workloads.CLASS_MIXES` (None: one class).
    classes: str | None = None

    @property
    def name(self) -> str:
        return self.label or self.policy

    def with_rate(self, rate: float) -> RunSpec:
        return dataclasses.replace(self, rate=rate)


# ------------------------------------------------------------ per-process caches
_PREDICTORS: dict[str, BatchLatencyPredictor] = {}


def install_predictors(predictors: dict[str, str]) -> None:
    """Seed this process's predictor cache from JSON (a pool initializer): the parent
    fits once and workers skip the sweep."""
    quiet_logs()
    for key, text in predictors.items():
        _PREDICTORS.setdefault(key, BatchLatencyPredictor.from_json(text))


def profile_predictor(profile: str) -> BatchLatencyPredictor:
    """The offline predictor of ``profile`` (seeded sweep, cached per process)."""
    if profile not in _PREDICTORS:
        _PREDICTORS[profile] = fit_profile_predictor(profile, n=PREDICTOR_SWEEP, seed=PREDICTOR_SEED)
    return _PREDICTORS[profile]


class _EmbeddedServer:
    """The scheduling service on a loopback port of this process, bootstrapped with
    the profile's offline predictor."""

    _ids = itertools.count()

    def __init__(self, profile: str) -> None:
        self.profile = profile
        self._server: Any = None
        self._runs = 0

    def acquire(self) -> tuple[str, str]:
        """(target, a profile key no other run of this process uses)."""
        if self._server is None or self._runs >= _SERVER_RUNS:
            self.stop()
            self._server = self._start()
            self._runs = 0
        self._runs += 1
        return self._server.target, f"{self.profile}#{os.getpid()}.{next(self._ids)}"

    def _start(self) -> Any:
        # Here, not at the top: `slidingserve plan` and the other commands that load this
        # module through the CLI never start a server (tests/test_layers.py).
        from scheduler_service.server.app import SchedulerServer
        from scheduler_service.server.config import ServerConfig

        # The server reads its bootstrap predictor from a file; it is read at start.
        fd, path = tempfile.mkstemp(prefix="slidingserve-bench-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(profile_predictor(self.profile).to_json())
            cfg = ServerConfig(host="127.0.0.1", port=0, log_level="warning", metrics_port=0,
                               predictor_file=path, grace_s=0.5)
            server = SchedulerServer(cfg).start()
        finally:
            Path(path).unlink(missing_ok=True)
        quiet_logs()
        return server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
            self._server = None


_SERVERS: dict[str, _EmbeddedServer] = {}


@atexit.register
def _stop_servers() -> None:
    for s in _SERVERS.values():
        s.stop()


# ------------------------------------------------------------------------- run
def class_summary(mix: ClassMix, workload: Workload, result: SimResult) -> dict[str, Any]:
    """Per class: requests, met (SLO kept), attainment, rejected, and goodput (met requests
    per simulated second); plus the weighted goodput Σ weight × met / time."""
    t = max(result.sim_time_s, 1e-9)
    rows: dict[str, dict[str, Any]] = {}
    weighted = 0.0
    for c in mix.classes:
        sel = workload.priority == c.priority
        n = int(sel.sum())
        met = int((~result.violated[sel]).sum())
        rows[c.name] = {"priority": c.priority, "requests": n, "met": met,
                        "attainment": met / n if n else float("nan"),
                        "rejected": int(result.rejected[sel].sum()) if len(result.rejected) else 0,
                        "goodput_rps": met / t}
        weighted += c.weight * met / t
    return {"classes": rows, "weighted_goodput_rps": weighted}


def _order_stats(a: np.ndarray, k: int = MAX_LATENCY_SAMPLES) -> list[float]:
    """At most k evenly spaced order statistics of a (the CDF without the bulk)."""
    s = np.sort(a)
    if len(s) > k:
        s = s[np.linspace(0, len(s) - 1, k).round().astype(np.int64)]
    return [round(float(x), 6) for x in s]


def run(spec: RunSpec) -> dict[str, Any]:
    """Run the simulated engine once; the engine's summary plus the spec's fields."""
    quiet_logs()
    if spec.transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {spec.transport!r}; valid: {', '.join(TRANSPORTS)}")
    truth = load_ground_truth(spec.profile)
    predictor = profile_predictor(spec.profile)
    workload = make_workload(spec.workload, spec.n_requests, spec.rate, seed=spec.seed, burst=spec.burst,
                             slo=spec.slo, classes=spec.classes)
    profile = PROFILES[spec.profile]
    backend: SchedulerBackend
    settings = AdapterSettings(policy=spec.policy, params=dict(spec.params), profile=profile.key,
                               deadline_ms=spec.deadline_ms, shed_after=spec.shed_after)
    if spec.transport == "grpc":
        server = _SERVERS.setdefault(spec.profile, _EmbeddedServer(spec.profile))
        target, key = server.acquire()
        profile = dataclasses.replace(profile, key=key)  # snapshots name the run's own key
        settings = dataclasses.replace(settings, profile=key, engine_id=key)
        backend = GrpcBackend(target, settings)
    else:
        # In-process replays refit inline so that a (spec, seed) always gives the same result.
        settings = dataclasses.replace(settings, report_inline=True)
        backend = InProcessBackend(settings, predictor)
    adapter = AdapterCore(backend, settings, predictor)
    try:
        config = EngineConfig(stop_violation_fraction=spec.stop_violation_fraction, noise_seed=spec.seed)
        result = SimulatedEngine(workload, truth, profile, adapter, config).run()
    finally:
        adapter.close()
    out: dict[str, Any] = {
        "policy": spec.name,
        "base_policy": spec.policy,
        "params": dict(spec.params),
        **{k: getattr(spec, k) for k in ("workload", "profile", "transport", "deadline_ms", "shed_after")},
        "rate_rps": spec.rate,
        "seed": spec.seed,
        "burst": dataclasses.asdict(spec.burst) if spec.burst else None,
        "wall_s": result.wall_time_s,
        "sim_time_s": result.sim_time_s,
        **result.summary(),
    }
    out["slo_attainment"] = 1.0 - out["violation_rate"]
    out["fallback_decisions"] = sum(result.adapter.get("fallbacks", {}).values())
    if spec.classes is not None:
        out.update(class_summary(CLASS_MIXES[spec.classes], workload, result))
    if spec.keep_latencies:
        out["ttft_samples_s"] = _order_stats(result.ttft_s)
        out["tbt_samples_s"] = _order_stats(result.tbt_s)
    return out
