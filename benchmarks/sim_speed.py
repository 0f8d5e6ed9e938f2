"""Simulator speed: simulated engine iterations per wall second, in-process, per main policy.

Sweeps (goodput searches over policies, workloads and seeds) are only cheap
if one simulated iteration costs well under a millisecond of wall time; the
target is >= 2,000 iterations/s with ``slidingserve``.  The wall time
includes the policy's own decisions, the adapter's plan check and the
ground-truth latency model — everything a bench run pays.

Run: ``.venv/bin/python -m benchmarks.sim_speed [--requests N] [--rate R] [--workload W]``.
The default rate is below the default profile's goodput on mixed-v1 (about
3 req/s), so queues stay short-to-moderate, as in most probes of a search.
"""

from __future__ import annotations

import argparse
import sys

from clients.bench.runner import MAIN_POLICIES, RunSpec, quiet_logs, run

TARGET = 2000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mixed-v1")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(MAIN_POLICIES))
    args = ap.parse_args(argv)
    quiet_logs()
    # Warm-up: trace loading, predictor fit and first-call numpy costs are not simulator speed.
    run(RunSpec("vllm-fcfs", args.workload, args.rate, seed=args.seed, n_requests=20))
    print(f"{'policy':14s} {'iterations':>10s} {'wall s':>7s} {'iter/s':>8s} {'decision p50 us':>16s}")
    ok = True
    for pol in args.policies.split(","):
        s = run(RunSpec(pol, args.workload, args.rate, seed=args.seed, n_requests=args.requests))
        print(f"{pol:14s} {s['iterations']:10d} {s['wall_s']:7.2f} {s['iterations_per_wall_s']:8.0f} "
              f"{s['decision_us_p50']:16.0f}")
        if pol == "slidingserve":
            ok = s["iterations_per_wall_s"] >= TARGET
    print(f"target: >= {TARGET:.0f} iterations/s with slidingserve: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
