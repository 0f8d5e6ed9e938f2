"""What the traffic recording (server.yaml ``record``) costs the decision path, and its size.

    .venv/bin/python -m benchmarks.recording_overhead [--snapshots 1500] [--rounds 3]

The snapshots are an engine's own, in order: the simulated engine serving mixed-v1 at 4
req/s, past vLLM's capacity (its queues grow and shrink, requests arrive, decode and
leave), captured in process.  Two services run in child processes, one recording and one not; a client sends
each snapshot to both over one ScheduleStream each, alternating which goes first, so that
both see the same sequence under the same machine load.  Printed per round: the p50 and p99
of the end-to-end call and of the policy's decision time (``Plan.decision_us``, which the
recorder's thread would slow by holding the GIL), recording over not;
then the recording's bytes per request and per iteration (with the reports, sent to the
recording service too) and what an hour of this engine's traffic would take on disk.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_service.client import IterationReport, SchedulerClient
from scheduler_service.core import Snapshot

ROOT = Path(__file__).resolve().parents[1]


def engine_snapshots(n: int, rate: float = 4.0, seed: int = 1) -> tuple[list[Snapshot], list[Any]]:
    """The first ``n`` snapshots (and the iterations that followed them) of the simulated
    engine on mixed-v1 at ``rate`` req/s."""
    from clients.bench.runner import profile_predictor, quiet_logs
    from clients.workloads import make_workload
    from engine_adapter.core import AdapterCore, AdapterSettings
    from engine_adapter.inprocess import InProcessBackend
    from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
    from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth

    quiet_logs()
    snaps: list[Snapshot] = []
    samples: list[Any] = []
    settings = AdapterSettings(policy="slidingserve", profile=PROFILES[DEFAULT_PROFILE].key, report_inline=True)
    pred = profile_predictor(DEFAULT_PROFILE)
    inner = InProcessBackend(settings, pred)

    class Capture:
        def schedule(self, snapshot: Snapshot, timeout_s: float) -> Any:
            snaps.append(snapshot)
            return inner.schedule(snapshot, timeout_s)

        def report(self, batch: Any) -> None:
            samples.extend(batch)
            inner.report(batch)

        def close(self) -> None:
            inner.close()

    core = AdapterCore(Capture(), settings, pred)  # type: ignore[arg-type]
    w = make_workload("mixed-v1", 2000, rate, seed=seed)
    SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILES[DEFAULT_PROFILE], core,
                    EngineConfig(noise_seed=seed, max_sim_time_s=n * 0.2)).run()
    core.close()
    return snaps[:n], samples[:n]


def _serve(record: str) -> tuple[str, subprocess.Popen[bytes]]:
    port_file = Path(tempfile.mkdtemp()) / "port"
    code = ("import sys; from pathlib import Path; from scheduler_service.server import SchedulerServer, ServerConfig\n"
            f"cfg = ServerConfig(host='127.0.0.1', port=0, log_level='warning', record={record!r})\n"
            f"with SchedulerServer(cfg) as s:\n    Path({str(port_file)!r}).write_text(str(s.port)); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    end = time.monotonic() + 180
    while not (port_file.exists() and port_file.read_text()):
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit("a benchmark server did not start")
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text()}", proc


def _round(clients: dict[str, Any], snaps: list[Snapshot], samples: list[Any]) -> dict[str, dict[str, np.ndarray]]:
    streams = {k: c.stream() for k, c in clients.items()}
    out: dict[str, dict[str, list[float]]] = {k: {"e2e": [], "decision": []} for k in clients}
    order = list(clients)
    for i, s in enumerate(snaps):
        for k in (order if i % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            plan = streams[k].schedule(s, policy="slidingserve")
            out[k]["e2e"].append(time.perf_counter() - t)
            out[k]["decision"].append(plan.decision_us * 1e-6)
    for st in streams.values():
        st.close()
    reports = [IterationReport(latency_ms=float(x.latency_ms), c=x.c, u=x.u) for x in samples]
    for c in clients.values():
        c.report(reports)
    return {k: {m: np.array(v) for m, v in d.items()} for k, d in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recording_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--snapshots", type=int, default=1500, help="consecutive engine snapshots per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    snaps, samples = engine_snapshots(args.snapshots)
    sizes = [len(s) for s in snaps]
    print(f"{len(snaps)} consecutive snapshots of the simulated engine (mixed-v1, 4 req/s): "
          f"{min(sizes)}-{max(sizes)} requests, median {int(np.median(sizes))}; load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="recording-bench-") as tmp:
        rec_dir = Path(tmp) / "rec"
        servers = {"off": _serve(""), "on": _serve(str(rec_dir))}
        clients = {k: SchedulerClient(t, timeout_s=10, engine_id="bench") for k, (t, _) in servers.items()}
        try:
            print("| round | e2e p50 on/off | e2e p99 on/off | decision p50 on/off | decision p99 on/off |")
            print("|---|---|---|---|---|")
            for r in range(args.rounds):
                got = _round(clients, snaps, samples)
                ratio = {f"{m} {q}": float(np.percentile(got["on"][m], q) / np.percentile(got["off"][m], q))
                         for m in ("e2e", "decision") for q in (50, 99)}
                print(f"| {r + 1} | " + " | ".join(f"{v:.3f}" for v in ratio.values()) + " |")
        finally:
            for c in clients.values():
                c.close()
            for _, proc in servers.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(30)
        size = sum(f.stat().st_size for f in rec_dir.glob("*.jsonl"))
        lines = [ln for f in rec_dir.glob("*.jsonl") for ln in f.read_text().splitlines()]
        req = [len(ln) + 1 for ln in lines if '"t":"request"' in ln]
        it = [len(ln) + 1 for ln in lines if '"t":"iteration"' in ln]
    sim_s = float(snaps[-1].now - snaps[0].now)
    per_hour = (sum(req) + sum(it)) / args.rounds / max(sim_s, 1e-9) * 3600
    print(f"recording: {size / 1e6:.2f} MB on disk after {args.rounds} rounds; {np.mean(req):.0f} bytes per request, "
          f"{np.mean(it):.0f} per iteration; this engine's traffic ({sim_s:.0f} s of it per round) "
          f"is about {per_hour / 1e6:.0f} MB an hour (record_max_mb bounds it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
