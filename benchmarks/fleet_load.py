"""Many engines, one service: N simulated engines share one scheduling service over gRPC.

    .venv/bin/python -m benchmarks.fleet_load [--engines 1,4,8,16] [--duration 30] [--speedup 1]
        [--rate 1.6] [--workload mixed-v1] [--policy slidingserve] [--workers 1] [--saturate]
        [--profile-server] [--out fleet.json]

Set-up, and why:

* The service is a real ``slidingserve serve [--workers N]`` subprocess on loopback, fresh for
  every phase (no phase inherits the refits or CPU time of the one before) and outside the
  benchmark's process (the engines' GIL can neither hide nor inflate its own).  Before the clock
  starts it refits once under a spare profile: a fresh process imports scikit-learn on its first
  refit (~1 s, mostly holding the GIL), a stall that would otherwise open every phase.
* Every engine is its own process (spawn): the simulated engine (real trace lengths,
  ground-truth GPU latencies) with the production adapter core (AdapterCore + GrpcBackend, one
  long-lived ScheduleStream, background reports).  All report under one engine profile, so the
  service pools their latencies into one predictor, as for a fleet of identical replicas.
* Real-time pacing: before each decision an engine sleeps until the iteration's simulated time
  has elapsed in wall time (÷ ``--speedup``), so it asks at a real GPU's rate (≈ 20–60
  iterations/s when loaded); ``--speedup 4`` is a GPU four times as fast, or four times as many
  engines.  ``lag`` is how late engines asked (their own CPU work and the round trip are wall
  time the simulated clock does not have).
* The same workloads (same seeds) are replayed with the policy in the engine's own process
  (InProcessBackend, unpaced, inline refits): a loaded service that answers late or falls back
  shows up as SLO attainment lost against it, not only as latency.

Figures per phase: the service's time from the ScheduleResponse (``server_us``: decode,
validate, plan, encode), the policy's ``decision_us``, the client's round trip, decisions/s,
fallback rate by reason, errors, the service's CPU (cores; one Python process is capped near 1
core by its GIL, gRPC's C threads aside) and SLO attainment fleet vs in-process.  Target at
N = 8: service p99 ≤ 5 ms, fallbacks ≤ 0.1 %, no errors.  ``service_cpu_ms_per_decision``
(reports and refits included; 1000 / it is the most decisions/s one core serves) and, with
``--profile-server``, the share of time the service's GIL was held say how close one process is
to its limit; ``engine_wall_split`` and ``engines_keep_pace`` whether the engines kept real time
(on a small machine they share the cores with the service, and they give out first).

``--saturate`` then doubles the speedup at the largest N until the target breaks, or until the
engines can no longer keep pace (then the service was not the limit).  ``--profile-server``
samples the service with py-spy (PyPI ``py-spy``; ``--gil``: only the thread holding the GIL)
and attributes its time to gRPC runtime, protobuf (de)serialisation, snapshot decode +
validation, policy, plan encode, reports and predictor refits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import MIXES, make_workload
from engine_adapter.core import AdapterCore, AdapterSettings, SchedulerBackend
from engine_adapter.faults import ServiceProcess
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.sim.pacing import WallClockPacer
from scheduler_service.client import EngineProfile, IterationReport, SchedulerClient
from scheduler_service.core import BatchLatencyPredictor, Snapshot, registry
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server.servicer import WORKER_PID_KEY

#: N = 8 must meet these (service p99, fallback fraction).
TARGET_P99_MS = 5.0
TARGET_FALLBACK = 0.001


# ------------------------------------------------------------------ engine side
@dataclass(frozen=True, slots=True)
class EngineJob:
    """Everything one engine process needs (picklable)."""

    index: int
    workload: str
    requests: int
    rate: float
    seed: int
    profile: str
    policy: str
    deadline_ms: float
    predictor_json: str
    #: "" = policy in-process (reference run, unpaced); else host:port of the service.
    target: str = ""
    #: Simulated seconds per wall second; 0 = unpaced.
    speedup: float = 1.0


def _channel_factory(target: str, sink: list[int]) -> Callable[[], Any]:
    """A channel that finds a restarted service quickly and records every reply's
    ``server_us`` (a client interceptor: the public way to see the raw response)."""
    class _TappedCall:
        def __init__(self, call: Any) -> None:
            self._call = call

        def __iter__(self) -> _TappedCall:
            return self

        def __next__(self) -> Any:
            resp = next(self._call)
            if resp.HasField("plan"):
                sink.append(int(resp.server_us))
            return resp

        def __getattr__(self, name: str) -> Any:
            return getattr(self._call, name)

    class _Tap(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
        def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return _TappedCall(continuation(details, request_iterator))

    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    return lambda: grpc.intercept_channel(grpc.insecure_channel(target, options=options), _Tap())


class PacedAdapter(AdapterCore):
    """AdapterCore whose ``decide`` first waits for the iteration's wall time (``speedup`` > 0)
    and records where the engine's wall time goes."""

    def __init__(self, backend: SchedulerBackend, settings: AdapterSettings, pred: BatchLatencyPredictor,
                 speedup: float) -> None:
        super().__init__(backend, settings, pred)
        self._pacer = WallClockPacer(speedup) if speedup > 0 else None
        #: Per decision: when decide() was called, when pacing let it go and when it returned (wall
        #: seconds), and the pacer's answer (> 0: seconds slept; < 0: how late it was asked).
        self.times: list[tuple[float, float, float, float]] = []
        #: Messages of the remote failures counted as "error" (AdapterCore keeps only the last).
        self.error_messages: collections.Counter[str] = collections.Counter()

    def decide(self, snapshot: Any) -> Any:
        called = time.perf_counter()
        left = self._pacer.wait(snapshot.now) if self._pacer is not None else 0.0
        t0 = time.perf_counter()
        d = super().decide(snapshot)
        self.times.append((called, t0, time.perf_counter(), left))
        if d.reason == "error":
            self.error_messages[self.last_error[:160]] += 1
        return d

    def figures(self) -> dict[str, Any]:
        """The adapter's counters; the lag (how late decisions were asked vs real time); the wall
        seconds asleep (pacing) and in decide() (round trip, plan check), the longest decide()
        and the longest stretch between two decisions outside it."""
        st = self.stats()
        called, t0, t1, left = np.array(self.times or [(0.0, 0.0, 0.0, 0.0)]).T
        lag = np.maximum(0.0, -left)
        return {
            **{k: st[k] for k in ("fallbacks", "last_error", "reports_sent", "reports_dropped")},
            "error_messages": dict(self.error_messages),
            "lag_p99_ms": float(np.percentile(lag, 99) * 1e3),
            "late_fraction": float(np.mean(lag > 0.005)),
            "sleep_s": float(np.maximum(0.0, left).sum()),
            "decide_s": float((t1 - t0).sum()),
            "max_decide_ms": float((t1 - t0).max()) * 1e3,
            "max_between_ms": float((called[1:] - t1[:-1]).max(initial=0.0)) * 1e3,
        }


def run_engine(job: EngineJob, counters: Any = None, on_ready: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one engine to the end of its workload; its figures (raw samples included)."""
    quiet_logs()
    pred = BatchLatencyPredictor.from_json(job.predictor_json)
    profile = PROFILES[job.profile]
    w = make_workload(job.workload, job.requests, job.rate, seed=job.seed)
    settings = AdapterSettings(policy=job.policy, profile=profile.key, deadline_ms=job.deadline_ms,
                               engine_id=f"fleet-{job.index}", report_inline=not job.target)
    samples: dict[str, list[int]] = {"rtt_us": [], "server_us": [], "policy_us": []}
    backend = _measured_backend(job, settings, samples) if job.target else InProcessBackend(settings, pred)
    adapter = PacedAdapter(backend, settings, pred, job.speedup if job.target else 0.0)
    engine = SimulatedEngine(w, load_ground_truth(job.profile), profile, adapter, EngineConfig(noise_seed=job.seed))
    if counters is not None:  # the progress line's: decisions, fallbacks, requests done
        def hook(eng: SimulatedEngine, _snap: Any, d: Any) -> None:
            counters[3 * job.index] += 1
            counters[3 * job.index + 1] += int(d.source != "remote")
            counters[3 * job.index + 2] = int(eng.done.sum())

        engine.on_iteration = hook
    if on_ready is not None:
        on_ready()
    cpu0 = time.process_time()
    try:
        res = engine.run()
    finally:
        adapter.flush(2.0)
        adapter.close()
    done = engine.done
    return {
        "requests": len(w),
        "completed": res.completed,
        "violated": int(res.violated.sum()),
        "tokens_conserved": bool(np.array_equal(engine.generated[done], w.output_tokens[done])
                                 and res.output_tokens == int(engine.generated.sum())),
        "iterations": res.iterations,
        "decisions": len(res.decision_us),
        "wall_s": res.wall_time_s,
        "cpu_s": time.process_time() - cpu0,
        **adapter.figures(),
        **{k: np.array(v, dtype=np.int64) for k, v in samples.items()},
    }


def _measured_backend(job: EngineJob, settings: AdapterSettings, samples: dict[str, list[int]]) -> GrpcBackend:
    """The remote backend, recording each decision's round trip, the service's time and the
    policy's time into ``samples``; its channel and stream already open (not part of any figure)."""
    rtt_us, policy_us = samples["rtt_us"], samples["policy_us"]

    class Measured(GrpcBackend):
        def schedule(self, snapshot: Snapshot, timeout_s: float) -> Any:
            t0 = time.perf_counter_ns()
            plan = super().schedule(snapshot, timeout_s)
            rtt_us.append((time.perf_counter_ns() - t0) // 1000)
            policy_us.append(plan.decision_us)
            return plan

    backend = Measured(job.target, settings, channel_factory=_channel_factory(job.target, samples["server_us"]))
    backend.schedule(Snapshot.from_columns(
        now=0.0, max_batch_tokens=64, max_num_seqs=4, ids=["warm"], arrival=[0.0], prompt_tokens=[8],
        computed_tokens=[0], output_tokens=[0], ttft_slo=[1.0], tbt_slo=[1.0], protected=[False],
        profile=settings.profile), 30.0)
    for v in samples.values():
        v.clear()
    return backend


def _engine_process(job: EngineJob, counters: Any, events: Any, start: Any) -> None:
    """Child entry: build, report ready, wait for the common start, run, send the result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up

    def ready() -> None:
        events.put(("ready", job.index, None))
        start.wait()

    try:
        events.put(("done", job.index, run_engine(job, counters, ready)))
    except BaseException:
        events.put(("failed", job.index, traceback.format_exc()))


def _reference(job: EngineJob) -> dict[str, Any]:
    r = run_engine(replace(job, target=""))
    return {k: r[k] for k in ("requests", "violated")}


# ------------------------------------------------------------------ the service
def worker_channel(target: str) -> tuple[grpc.Channel, str]:
    """A connection of its own (no shared subchannel: the kernel picks the worker it reaches)
    and the pid of the worker behind it (GetPredictor's trailer)."""
    ch = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    _, call = pb_grpc.SchedulerServiceStub(ch).GetPredictor.with_call(pb.GetPredictorRequest(), timeout=30)
    return ch, str(dict(call.trailing_metadata()).get(WORKER_PID_KEY, ""))


class Service(ServiceProcess):
    """``slidingserve serve`` in a subprocess on a loopback port, with the offline predictor
    of the engines' profile as its bootstrap (as in the in-process reference); started, every
    worker up and warmed."""

    def __init__(self, predictor_json: str, engines: int, workdir: Path, workers: int = 1) -> None:
        pfile = workdir / "predictor.json"
        pfile.write_text(predictor_json)
        # One worker thread per open stream (a ScheduleStream per engine, plus report streams).
        super().__init__(workdir, log_level="info", predictor_file=str(pfile), grace_s=0.5, workers=workers,
                         max_workers=max(32, 3 * engines + 8))
        self.workers = workers
        self.start(240.0)  # a cold kernel cache compiles first
        self.log = workdir / f"server-{self.starts}.log"
        self._wait_all_workers()
        #: The workers' pids, in the order they were warmed.
        self.worker_pids = self._first_refit()

    def _wait_all_workers(self, timeout: float = 180.0) -> None:
        """With several workers the port answers once the first is up; the supervisor logs
        ``server_started`` with ``workers`` once every one is."""
        end = time.monotonic() + timeout
        while self.workers > 1 and not all(s in self.log.read_text() for s in ('"workers": ', '"server_started"')):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"the {self.workers} workers did not start; see {self.log}")
            time.sleep(0.1)

    def _first_refit(self, timeout: float = 60.0) -> list[str]:
        """Make every worker refit once, under a profile no engine uses, before the clock starts;
        the workers' pids.

        The first refit of a fresh process imports scikit-learn (about 1 s, mostly holding the
        GIL), which would stall every decision of the first phase seconds once and then never
        again; a phase measures the steady state.  (The engines' profile keeps its bootstrap.)
        """
        rng = np.random.default_rng(0)
        reports = []
        for _ in range(400):
            c = rng.integers(1, 512, rng.integers(1, 32))
            u = rng.integers(0, 2048, len(c))
            reports.append(IterationReport(latency_ms=5.0 + 0.02 * float(c.sum()) + 1e-4 * float(u.sum()), c=c, u=u))
        warmed: list[str] = []
        end = time.monotonic() + timeout
        while len(warmed) < self.workers:  # one connection per worker (the kernel picks it)
            if time.monotonic() > end:
                raise SystemExit(f"warm-up reports reached only {len(warmed)} of {self.workers} workers")
            ch, pid = worker_channel(self.target)
            with SchedulerClient(self.target, timeout_s=30.0, channel=ch) as client:
                if pid in warmed:
                    continue
                profile = EngineProfile(model=f"fleet-load-warmup-{len(warmed)}")
                client.report([replace(r, profile=profile) for r in reports])
                while client.get_predictor(profile).refits < 1:
                    if time.monotonic() > end:
                        raise SystemExit("the service did not refit its warm-up profile")
                    time.sleep(0.1)
                warmed.append(pid)
        return warmed

    def pids(self) -> list[int]:
        """The service's processes: the supervisor and its workers (or the one server)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            with contextlib.suppress(OSError):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return out

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the service's processes have used so far."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def threads(self) -> int:
        return sum(len(os.listdir(f"/proc/{pid}/task")) for pid in self.pids() if Path(f"/proc/{pid}").exists())


# ------------------------------------------------------------------ py-spy attribution
#: (category, substrings of a frame); the first category any frame of a stack matches wins,
#: looking from the innermost frame outwards.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # a module imported on first use (sklearn at the first refit): a one-off, not steady state
    ("module import", ("importlib._bootstrap",)),
    ("protobuf (de)serialise", ("SerializeToString", "FromString", "ParseFromString", "_serialize_response",
                                "serialize (grpc/_common", "deserialize (grpc/_common")),
    ("snapshot decode + validate", ("snapshot_from_pb", "validate")),
    ("plan encode", ("plan_to_pb",)),
    ("predictor refit", ("refit", "_fit", "sklearn")),
    ("reports", ("ReportIterations", "report_from_pb")),
    ("metrics", ("prometheus_client",)),
    ("policy", ("scheduler_service/core",)),
    ("gRPC runtime (Python side)", ("grpc/",)),
)


def attribute(collapsed: str) -> dict[str, float]:
    """Fractions of GIL-holding samples per category from py-spy's raw (collapsed) output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            frames = stack.split(";")[::-1]
            cat = next((c for f in frames for c, keys in CATEGORIES if any(k in f for k in keys)), "other")
            counts[cat] += int(n)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 3) for k, v in counts.most_common()} | {"_samples": sum(counts.values())}


@contextlib.contextmanager
def profiled(service: Service, seconds: float, out: Path | None) -> Iterator[dict[str, Any]]:
    """Sample the service with py-spy while the body runs (when ``out`` is given)."""
    result: dict[str, Any] = {}
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if out is None or not Path(spy).exists():
        if out is not None:
            print("  (--profile-server: py-spy not found; install the PyPI package py-spy)", file=sys.stderr)
        yield result
        return
    rate, duration = 250, max(2, int(seconds))
    proc = subprocess.Popen([spy, "record", "--pid", str(service.proc.pid), "--gil", "--nonblocking",
                             *(["--subprocesses"] if service.workers > 1 else []),
                             "--rate", str(rate), "--format", "raw", "--output", str(out),
                             "--duration", str(duration)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield result
    finally:
        try:
            _, err = proc.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if out.exists():
            shares = attribute(out.read_text())
            # --gil samples only while some thread holds the GIL: samples / (rate × duration) is
            # the fraction of time the GIL was busy, the saturation gauge of one Python process.
            result["gil_held_fraction"] = round(shares.pop("_samples") / (rate * duration), 3)
            result["shares"] = shares
        else:
            print(f"  (py-spy produced nothing: {err.decode(errors='replace').strip()[-200:]})", file=sys.stderr)


# ------------------------------------------------------------------ one phase
@dataclass(frozen=True, slots=True)
class Phase:
    engines: int
    speedup: float
    workers: int = 1


def run_phase(phase: Phase, base: EngineJob, workdir: Path, spy_dir: Path | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    service = Service(base.predictor_json, phase.engines, workdir, phase.workers)
    counters = ctx.Array("q", 3 * phase.engines, lock=False)
    events = ctx.Queue()
    start = ctx.Event()
    jobs = [replace(base, index=i, seed=base.seed + i, target=service.target, speedup=phase.speedup)
            for i in range(phase.engines)]
    procs = [ctx.Process(target=_engine_process, args=(j, counters, events, start), daemon=True) for j in jobs]
    label = f"N={phase.engines:<2d} x{phase.speedup:g} workers={phase.workers}"
    results: dict[int, dict[str, Any]] = {}
    failures: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        _wait_ready(events, len(procs))
        expected_wall = (base.requests / base.rate) / phase.speedup
        spy_out = spy_dir / f"pyspy-N{phase.engines}-x{phase.speedup:g}.txt" if spy_dir else None
        cpu0, t0 = service.cpu_s(), time.perf_counter()
        with profiled(service, 0.8 * expected_wall, spy_out) as spy:
            start.set()
            _collect(events, counters, results, failures, len(procs),
                     label, t0, expected_wall, base.requests * phase.engines)
            wall = time.perf_counter() - t0
            cpu = service.cpu_s() - cpu0
            threads = service.threads()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        service.stop()
    out = _phase_figures(phase, [results[i] for i in sorted(results)], failures, wall, cpu, threads)
    if spy:
        out["server_profile_gil"] = spy
    return out


def _wait_ready(events: Any, n: int) -> None:
    """Wait until ``n`` engines have said they are ready; SystemExit when one failed."""
    for _ in range(n):
        kind, i, payload = events.get(timeout=120)
        if kind != "ready":  # failed before the start
            raise SystemExit(f"engine {i} failed to start:\n{payload}")


def _collect(events: Any, counters: Any, results: dict[int, dict[str, Any]], failures: dict[int, str], n: int,
             label: str, t0: float, expected_wall: float, requests: int) -> None:
    """Gather the ``n`` engines' results (or failures), with a progress line every 5 s;
    SystemExit when they take more than three times the expected wall time."""
    last = t0
    while len(results) + len(failures) < n:
        with contextlib.suppress(queue.Empty):
            kind, i, payload = events.get(timeout=1.0)
            (results if kind == "done" else failures)[i] = payload
        now = time.perf_counter()
        if now - last >= 5.0 or len(results) + len(failures) == n:
            last = now
            c = np.frombuffer(counters, dtype=np.int64).reshape(-1, 3).sum(axis=0)
            print(f"  {label}  {now - t0:5.0f}s (arrivals end at {expected_wall:.0f}s)  decisions {c[0]:,} "
                  f"({c[0] / (now - t0):,.0f}/s)  fallbacks {c[1]}  requests "
                  f"{c[2]}/{requests}", file=sys.stderr, flush=True)
        if now - t0 > 3 * expected_wall + 120:
            raise SystemExit(f"{label}: engines did not finish in time")


def _phase_figures(phase: Phase, rs: list[dict[str, Any]], failures: dict[int, str], wall: float, cpu: float,
                   threads: int) -> dict[str, Any]:
    """A phase's figures from its engines' results and the service's CPU time."""
    decisions = sum(r["decisions"] for r in rs)
    out: dict[str, Any] = {
        **asdict(phase),
        "wall_s": round(wall, 2),
        **_latency_figures(rs),
        **_fallback_figures(rs, failures, decisions),
        **_pace_figures(rs),
        "service_cpu_cores": round(cpu / wall, 2),
        # CPU per decision (reports and refits included): 1000 / this is the most decisions/s
        # one core can serve, an upper bound for one GIL-bound process.
        "service_cpu_ms_per_decision": round(1e3 * cpu / max(decisions, 1), 3),
        "service_threads": threads,
        "engine_cpu_cores": round(sum(r["cpu_s"] for r in rs) / wall, 2),
        **{k: sum(r[k] for r in rs) for k in ("requests", "completed", "violated")},
        "tokens_conserved": all(r["tokens_conserved"] for r in rs),
        **{k: sum(r[k] for r in rs) for k in ("reports_sent", "reports_dropped")},
        "loadavg_1m": os.getloadavg()[0],
    }
    out["slo_attainment"] = 1.0 - out["violated"] / max(out["requests"], 1)
    # Engines that ask late most of the time set the pace themselves (machine CPU): the
    # offered load then falls short of the nominal one and the service is not the limit.
    out["engines_keep_pace"] = bool(out["late_fraction"] <= 0.05)
    out["meets_target"] = bool(out["service_ms"]["p99"] <= TARGET_P99_MS
                               and out["fallback_rate"] <= TARGET_FALLBACK and out["errors"] == 0)
    return out


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def _latency_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Decisions and their rate; service, policy and round-trip times (ms)."""
    def pcts(key: str, *qs: str) -> dict[str, float]:
        a = np.concatenate([r[key] for r in rs]) / 1e3 if rs else np.zeros(0)
        return {q: float(np.percentile(a, {"p50": 50, "p99": 99, "max": 100}[q])) if len(a) else float("nan")
                for q in qs}

    return {
        "decisions": sum(r["decisions"] for r in rs),
        "decisions_per_s": round(sum(r["decisions"] / r["wall_s"] for r in rs), 1),
        "per_engine_iterations_per_s": round(_mean([r["iterations"] / r["wall_s"] for r in rs]), 1),
        "service_ms": pcts("server_us", "p50", "p99", "max"),
        "policy_ms": pcts("policy_us", "p50", "p99"),
        "round_trip_ms": pcts("rtt_us", "p50", "p99", "max"),
    }


def _fallback_figures(rs: list[dict[str, Any]], failures: dict[int, str], decisions: int) -> dict[str, Any]:
    """Fallbacks by reason and their rate, errors and the engines' last error messages."""
    fb = sum((collections.Counter(r["fallbacks"]) for r in rs), collections.Counter())
    messages = sum((collections.Counter(r["error_messages"]) for r in rs), collections.Counter())
    return {
        "fallbacks": dict(fb),
        "fallback_rate": sum(fb.values()) / max(decisions, 1),
        "errors": fb.get("error", 0) + len(failures),
        "engine_failures": failures,
        "last_errors": sorted({r["last_error"] for r in rs if r["last_error"]})[:3],
        "error_messages": dict(messages.most_common(5)),
    }


def _pace_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the engines kept real time: lag, late share, and where their wall time went:
    pacing sleep, decide() (mostly the round trip), and the rest (their own simulation work,
    reports, waiting for a CPU).  Little sleep means the engines, not the service, set the pace."""
    return {
        "lag_p99_ms": max((r["lag_p99_ms"] for r in rs), default=0.0),
        "late_fraction": _mean([r["late_fraction"] for r in rs]),
        **{f"engine_{k}": max((r[k] for r in rs), default=0.0) for k in ("max_decide_ms", "max_between_ms")},
        "engine_wall_split": {k: round(_mean([r[f"{k}_s"] / r["wall_s"] for r in rs]), 3)
                              for k in ("sleep", "decide")},
    }


# ------------------------------------------------------------------ report
HEADER = (f"{'N':>3} {'wk':>2} {'speed':>5} {'dec/s':>7} {'it/s/eng':>8} {'svc p50':>7} {'svc p99':>7} "
          f"{'pol p50':>7} {'rtt p50':>7} {'rtt p99':>7} {'fallback':>9} {'err':>4} {'lag p99':>7} "
          f"{'svc cpu':>7} {'SLO fleet':>9} {'SLO inproc':>10}  target")


def row(p: dict[str, Any]) -> str:
    fb = f"{100 * p['fallback_rate']:.2f}%"
    ref = p.get("slo_attainment_inproc")
    return (f"{p['engines']:>3} {p.get('workers', 1):>2} {p['speedup']:>5g} {p['decisions_per_s']:>7,.0f} "
            f"{p['per_engine_iterations_per_s']:>8.1f} {p['service_ms']['p50']:>7.2f} "
            f"{p['service_ms']['p99']:>7.2f} {p['policy_ms']['p50']:>7.2f} {p['round_trip_ms']['p50']:>7.2f} "
            f"{p['round_trip_ms']['p99']:>7.2f} {fb:>9} {p['errors']:>4} {p['lag_p99_ms']:>7.1f} "
            f"{p['service_cpu_cores']:>7.2f} {100 * p['slo_attainment']:>8.1f}% "
            f"{'' if ref is None else f'{100 * ref:.1f}%':>10}  {'ok' if p['meets_target'] else 'MISSED'}")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("engine counts must be >= 1")
    return vals


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.workload not in MIXES and not Path(args.workload).is_file():
        ap.error(f"unknown --workload {args.workload!r}; valid: {', '.join(MIXES)} or a CSV path")
    requests = max(1, round(args.rate * args.duration))
    base = EngineJob(index=0, workload=args.workload, requests=requests, rate=args.rate, seed=args.seed,
                     profile=args.profile, policy=args.policy, deadline_ms=args.deadline_ms,
                     predictor_json=profile_predictor(args.profile).to_json())
    print(f"fleet load: {args.workload} at {args.rate:g} rps per engine, {requests} requests each "
          f"(~{args.duration:g} simulated s), policy {args.policy}, deadline {args.deadline_ms:g} ms, "
          f"profile {args.profile}; service workers {','.join(map(str, args.workers))}; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    phases: list[dict[str, Any]] = []
    if args.out:
        Path(args.out).resolve().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fleet-load-") as tmp:
        # py-spy's raw stacks are kept beside --out (else in the temporary folder).
        spy_dir = (Path(args.out).resolve().parent if args.out else Path(tmp)) if args.profile_server else None

        def go(ph: Phase) -> dict[str, Any]:
            phases.append(run_phase(ph, base, Path(tmp), spy_dir))
            print(row(phases[-1]), file=sys.stderr)
            return phases[-1]

        for w in args.workers:
            for n in args.engines:
                go(Phase(n, args.speedup, w))
        saturation = _saturate(go, phases, args) if args.saturate else {}
        if not args.no_reference:
            _add_reference(base, phases)
    _print_summary(phases)
    if args.saturate:
        print(f"saturation: {saturation or 'not reached up to speedup ' + format(args.max_speedup, 'g')}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "config": {**vars(args), "requests_per_engine": requests},
            "target": {"service_p99_ms": TARGET_P99_MS, "fallback_rate": TARGET_FALLBACK},
            "phases": phases, "saturation": saturation, "cpus": os.cpu_count(),
            "base_job": asdict(base) | {"predictor_json": "<offline fit>"}}, indent=2))
        print(f"wrote {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=_ints, default=[1, 4, 8, 16], help="engine counts, e.g. 1,4,8,16")
    ap.add_argument("--duration", type=_positive, default=30.0,
                    help="simulated seconds of arrivals per engine (requests = rate × duration)")
    ap.add_argument("--speedup", type=_positive, default=1.0, help="simulated seconds per wall second")
    ap.add_argument("--rate", type=_positive, default=1.6, help="arrivals per second per engine")
    ap.add_argument("--workload", default="mixed-v1")
    ap.add_argument("--policy", default="slidingserve", choices=registry.names())
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=list(PROFILES),
                    help="GPU profile (default: the simulator's default)")
    ap.add_argument("--deadline-ms", type=_positive, default=20.0)
    ap.add_argument("--workers", type=_ints, default=[1],
                    help="service worker processes per phase, e.g. 1,2 (every engine count runs with each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--saturate", action="store_true",
                    help="then double the speedup at the largest N until the target breaks")
    ap.add_argument("--max-speedup", type=_positive, default=64.0)
    ap.add_argument("--profile-server", action="store_true", help="sample the service with py-spy --gil")
    ap.add_argument("--no-reference", action="store_true", help="skip the in-process SLO reference")
    ap.add_argument("--out", help="write all figures as JSON")
    return ap


def _saturate(go: Callable[[Phase], dict[str, Any]], phases: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    """Double the speedup at the largest N until the target breaks, or until the engines
    cannot keep pace; where it stopped and why (empty when ``--max-speedup`` came first)."""
    n, s, w = max(args.engines), args.speedup, max(args.workers)
    last_ok = next((p for p in phases[::-1] if p["engines"] == n and p["meets_target"]), None)
    while s * 2 <= args.max_speedup:
        s *= 2
        res = go(Phase(n, s, w))
        if not res["engines_keep_pace"] and res["meets_target"]:
            return {"engines": n, "speedup": s, "decisions_per_s": res["decisions_per_s"],
                    "limited_by": "the engines: they could not keep real-time pace on this "
                                  "machine, so the service was not the limit"}
        if not res["meets_target"]:
            return {"engines": n, "breaks_at_speedup": s, "decisions_per_s": res["decisions_per_s"],
                    "last_ok": None if last_ok is None else
                    {"speedup": last_ok["speedup"], "decisions_per_s": last_ok["decisions_per_s"]}}
        last_ok = res
    return {}


def _add_reference(base: EngineJob, phases: list[dict[str, Any]]) -> None:
    """Each phase's SLO attainment with the policy in the engines' own processes."""
    n_ref = max(p["engines"] for p in phases)
    print(f"in-process reference: {n_ref} engines, same workloads and seeds", file=sys.stderr)
    with mp.get_context("spawn").Pool(max(1, min(n_ref, os.cpu_count() or 1))) as pool:
        refs = pool.map(_reference, [replace(base, index=i, seed=base.seed + i) for i in range(n_ref)])
    for p in phases:
        sub = refs[: p["engines"]]
        p["slo_attainment_inproc"] = 1.0 - sum(r["violated"] for r in sub) / max(
            sum(r["requests"] for r in sub), 1)


def _print_summary(phases: list[dict[str, Any]]) -> None:
    """The table, then per phase the service's CPU per decision, the engines' pace, the
    service's GIL profile and any fallbacks or errors."""
    print("\n" + HEADER)
    for p in phases:
        print(row(p))
    print("(ms; svc = server_us from the response: decode + validate + policy + encode; pol = the policy alone;"
          " rtt = client round trip; lag = how late engines asked vs real time; svc cpu = cores used by the"
          " service process)")
    for p in phases:
        print(f"N={p['engines']} x{p['speedup']:g}: service CPU {p['service_cpu_ms_per_decision']:.2f} ms per "
              f"decision (≤ {1e3 / max(p['service_cpu_ms_per_decision'], 1e-3):,.0f} decisions/s per core); "
              f"engines' wall time: asleep {100 * p['engine_wall_split']['sleep']:.0f}%, in decide() "
              f"{100 * p['engine_wall_split']['decide']:.0f}%; longest decide() {p['engine_max_decide_ms']:.0f} ms"
              + ("" if p["engines_keep_pace"] else "; engines could NOT keep pace (late "
                 f"{100 * p['late_fraction']:.0f}% of decisions)"))
        prof = p.get("server_profile_gil")
        if prof and "shares" in prof:
            share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["shares"].items())
            print(f"  service GIL held {100 * prof['gil_held_fraction']:.0f}% of the time; by: {share}")
        if p["fallbacks"] or p["errors"]:
            print(f"N={p['engines']} x{p['speedup']:g}: fallbacks {p['fallbacks']}, engine failures "
                  f"{len(p['engine_failures'])}, last errors {p['last_errors']}"
                  + (f", errors {p['error_messages']}" if p["error_messages"] else ""))


if __name__ == "__main__":
    sys.exit(main())
