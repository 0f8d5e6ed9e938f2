"""Rolling upgrade: engines keep serving through a default deployment change and a rolling restart.

Two service replicas (real ``slidingserve serve`` processes with a policy config, default
``v1``) serve N simulated engines (real trace lengths, ground-truth GPU, paced in wall time)
through one gRPC target naming both replicas (``ipv4:127.0.0.1:P1,127.0.0.1:P2``, client-side
round robin as the adapter configures it: engines' streams spread over both replicas, each
stream on one, as with a headless Kubernetes Service).  While the engines run, the operator:

1. changes the policy config's default ``v1 → v2`` (hot reload, no restart);
2. restarts replica A (SIGTERM: drain for ``grace_s``, then a new process on the same port,
   i.e. "the new image"), waits until it is SERVING;
3. restarts replica B the same way.

Reported per engine and in total: requests completed vs submitted (lost must be 0),
decisions served by v1/v2, fallback iterations by reason, and the longest run of
consecutive fallback iterations.  Run::

    python -m benchmarks.rolling_upgrade [--engines 4] [--requests 200] [--speedup 2]

A library as well as a command (docs/development.md): :func:`rolling_upgrade` returns the
figures, and ``tests/test_rolling_upgrade.py`` checks a smaller run of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.faults import ServiceProcess
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.sim.pacing import WallClockPacer

PROFILE = PROFILES[DEFAULT_PROFILE]
V1 = {"policy": "slidingserve", "params": {"window": 2}}
V2 = {"policy": "slidingserve", "params": {"window": 3, "margin": 1.15}}


@dataclasses.dataclass
class EngineRun:
    name: str
    workload: Workload
    engine: SimulatedEngine | None = None
    adapter: AdapterCore | None = None
    served: Counter[str] = dataclasses.field(default_factory=Counter)
    fallbacks: Counter[str] = dataclasses.field(default_factory=Counter)
    longest_fallback_run: int = 0
    iterations: int = 0
    error: str = ""
    #: served deployment of the last remote decision, by phase label
    phase_served: dict[str, Counter[str]] = dataclasses.field(default_factory=dict)

    @property
    def completed(self) -> int:
        return int(self.engine.done.sum()) if self.engine is not None else 0

    @property
    def lost(self) -> int:
        return len(self.workload) - self.completed


def _channel(target: str) -> Any:
    # find a restarted or the other replica within ~0.2 s, as the vLLM adapter configures it
    opts = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 200), ("grpc.lb_policy_name", "round_robin")]
    return lambda: grpc.insecure_channel(target, options=opts)


def _run_engine(run: EngineRun, target: str, speedup: float, phase: list[str], deadline_ms: float) -> None:
    s = AdapterSettings(policy="", profile=PROFILE.key, deadline_ms=deadline_ms, engine_id=run.name,
                        max_backoff_decisions=8)
    adapter = AdapterCore(GrpcBackend(target, s, channel_factory=_channel(target)), s,
                          profile_predictor(DEFAULT_PROFILE))
    engine = SimulatedEngine(run.workload, load_ground_truth(DEFAULT_PROFILE), PROFILE, adapter)
    run.engine, run.adapter = engine, adapter
    pacer = WallClockPacer(speedup)
    streak = 0

    def hook(eng: SimulatedEngine, snap: Any, decision: Any) -> None:
        nonlocal streak
        run.iterations += 1
        if decision is not None and decision.source == "remote":
            v = decision.plan.deployment or decision.plan.policy
            run.served[v] += 1
            run.phase_served.setdefault(phase[0], Counter())[v] += 1
            streak = 0
        elif decision is not None:
            run.fallbacks[decision.reason] += 1
            streak += 1
            run.longest_fallback_run = max(run.longest_fallback_run, streak)
        pacer.wait(snap.now)

    engine.on_iteration = hook
    try:
        engine.run()
    except Exception as e:  # reported, and counted as lost requests
        run.error = f"{type(e).__name__}: {e}"
    finally:
        adapter.flush(2.0)
        adapter.close()


def rolling_upgrade(workdir: Path, *, engines: int = 4, requests: int = 200, rate: float = 4.0,
                    speedup: float = 2.0, seed: int = 0, max_output: int = 128, deadline_ms: float = 200.0,
                    at: tuple[float, float, float] = (0.2, 0.4, 0.65), progress: bool = True) -> dict[str, Any]:
    """Run the scenario; ``at``: when (fraction of the expected wall time) the default deployment change
    and the two restarts start."""
    quiet_logs()
    profile_predictor(DEFAULT_PROFILE)  # fit once, before any timing
    policy_file = workdir / "policies.json"
    _write_config(policy_file, "v1")
    common: dict[str, Any] = {"policy_config": str(policy_file), "policy_config_poll_s": 0.2, "grace_s": 1.0}
    replicas = []
    for name in ("a", "b"):
        (workdir / name).mkdir(exist_ok=True)
        replicas.append(ServiceProcess(workdir / name, **common))
        replicas[-1].start()
    a, b = replicas
    target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    runs = []
    for i in range(engines):
        w = make_workload("sharegpt", requests, rate, seed=seed + i)
        w = dataclasses.replace(w, output_tokens=np.minimum(w.output_tokens, max_output))
        runs.append(EngineRun(f"engine-{i}", w))
    phase = ["v1"]
    wall = requests / rate / speedup  # arrivals span, in wall seconds
    threads = [threading.Thread(target=_run_engine, args=(r, target, speedup, phase, deadline_ms), daemon=True)
               for r in runs]
    t0 = time.monotonic()
    events: list[tuple[str, float]] = []

    def log(msg: str) -> None:
        events.append((msg, round(time.monotonic() - t0, 2)))
        if progress:
            print(f"  [{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    for t in threads:
        t.start()
    try:
        _operate(policy_file, a, b, phase, log, [t0 + f * wall for f in at])
        for t in threads:
            t.join(timeout=10 * wall + 60)
        log("all engines finished")
    finally:
        a.stop()
        b.stop()
    return {"engines": engines, "requests_per_engine": requests, "speedup": speedup, **_totals(runs),
            "events": events, "per_engine": [_engine_result(r) for r in runs]}


def _write_config(policy_file: Path, default: str) -> None:
    policy_file.write_text(json.dumps({"default": default, "deployments": {"v1": V1, "v2": V2}}))


def _operate(policy_file: Path, a: ServiceProcess, b: ServiceProcess, phase: list[str],
             log: Callable[[str], None], when: list[float]) -> None:
    """The operator: at ``when[0]`` the default v1 -> v2, at ``when[1]`` replica A restarted, then
    (not before ``when[2]``) replica B; ``phase[0]`` labels the engines' decisions meanwhile."""
    time.sleep(max(0.0, when[0] - time.monotonic()))
    _write_config(policy_file, "v2")
    phase[0] = "reload"
    log("policy config: default v1 -> v2")
    time.sleep(max(0.0, when[1] - time.monotonic()))
    for name, svc in (("A", a), ("B", b)):
        phase[0] = f"restart {name}"
        log(f"replica {name}: SIGTERM (drain)")
        svc.stop()
        svc.start()
        log(f"replica {name}: SERVING again")
        phase[0] = f"after {name}"
        if name == "A":
            time.sleep(max(0.0, when[2] - time.monotonic()))
    phase[0] = "upgraded"


def _engine_result(r: EngineRun) -> dict[str, Any]:
    return {
        "engine": r.name, "requests": len(r.workload), "completed": r.completed, "lost": r.lost,
        "iterations": r.iterations, "served": dict(r.served), "fallbacks": dict(r.fallbacks),
        "longest_fallback_run": r.longest_fallback_run, "error": r.error,
        "served_by_phase": {k: dict(v) for k, v in r.phase_served.items()},
    }


def _totals(runs: list[EngineRun]) -> dict[str, Any]:
    total_fb: Counter[str] = Counter()
    for r in runs:
        total_fb.update(r.fallbacks)
    return {
        "submitted": sum(len(r.workload) for r in runs), "completed": sum(r.completed for r in runs),
        "lost": sum(r.lost for r in runs), "iterations": sum(r.iterations for r in runs),
        "served": dict(sum((r.served for r in runs), Counter())), "fallbacks": dict(total_fb),
        "fallback_iterations": sum(total_fb.values()),
        "longest_fallback_run": max(r.longest_fallback_run for r in runs),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--requests", type=int, default=200, help="requests per engine")
    ap.add_argument("--rate", type=float, default=4.0, help="arrival rate per engine (req/s)")
    ap.add_argument("--speedup", type=float, default=2.0, help="simulated seconds per wall second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        res = rolling_upgrade(Path(d), engines=args.engines, requests=args.requests, rate=args.rate,
                              speedup=args.speedup, seed=args.seed)
    print(f"\nrolling upgrade: {res['engines']} engines x {res['requests_per_engine']} requests, "
          f"2 replicas, v1 -> v2 by config reload, then A and B restarted one after the other")
    print(f"{'engine':10s} {'done/sent':>11s} {'lost':>5s} {'iters':>6s} {'v1':>6s} {'v2':>6s} "
          f"{'fallbacks':>10s} {'longest':>8s}  reasons")
    for e in res["per_engine"]:
        print(f"{e['engine']:10s} {e['completed']:>5d}/{e['requests']:<5d} {e['lost']:5d} {e['iterations']:6d} "
              f"{e['served'].get('v1', 0):6d} {e['served'].get('v2', 0):6d} {sum(e['fallbacks'].values()):10d} "
              f"{e['longest_fallback_run']:8d}  {e['fallbacks']} {e['error']}")
    print(f"total: {res['completed']}/{res['submitted']} completed, lost {res['lost']}, "
          f"{res['fallback_iterations']} of {res['iterations']} iterations on fallback "
          f"({100 * res['fallback_iterations'] / max(1, res['iterations']):.2f}%), longest fallback run "
          f"{res['longest_fallback_run']} iterations; served {res['served']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
