"""In-process decision time per policy on a loaded engine's snapshot.

    .venv/bin/python -m benchmarks.decision_latency [--decodes 256] [--queued 512] [--iters 300]

Prints p50/p99 decision time per policy and SlidingServe's breakdown by
component.  Several snapshots (seeds) are rotated so that no single queue
shape decides the figure.  Target (issue 2): slidingserve p50 <= 0.5 ms.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.snapshots import busy_snapshot
from scheduler_service.core import default_predictor, registry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--queued", type=int, default=512)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--policies", default=",".join(registry.names()))
    args = ap.parse_args()
    snaps = [busy_snapshot(args.decodes, args.queued, seed=s) for s in range(args.seeds)]
    pred = default_predictor()
    print(f"snapshot: {args.decodes} decodes + {args.queued} waiting/prefilling (ShareGPT lengths), "
          f"{args.seeds} seeds x {args.iters} decisions")
    print(f"{'policy':22s} {'p50 ms':>8s} {'p99 ms':>8s}  paths")
    for name in args.policies.split(","):
        pol = registry.create(name)
        for s in snaps:
            pol.plan(s, pred)  # warm-up
        times, paths, parts = [], {}, {}
        for i in range(args.iters):
            s = snaps[i % len(snaps)]
            t = time.perf_counter()
            plan = pol.plan(s, pred)
            times.append(time.perf_counter() - t)
            paths[plan.path] = paths.get(plan.path, 0) + 1
            for k, v in plan.breakdown_us.items():
                parts.setdefault(k, []).append(v)
        t = np.array(times) * 1e3
        path_s = ", ".join(f"{k} {v}" for k, v in sorted(paths.items()))
        print(f"{name:22s} {np.percentile(t, 50):8.3f} {np.percentile(t, 99):8.3f}  {path_s}")
        if name == "slidingserve":
            br = ", ".join(f"{k} {np.median(v):.0f} us" for k, v in parts.items())
            print(f"{'':22s} median breakdown: {br}")


if __name__ == "__main__":
    main()
