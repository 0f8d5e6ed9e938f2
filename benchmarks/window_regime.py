"""Where does the SlidingChunker's look-ahead (window k) matter?

The bench's ``window`` experiment compares k = 1..4 on the default SLOs, where
they tie.  This script runs fixed-rate replays (same arrivals per seed for
every k) in regimes that should favour looking ahead — many decodes under a
tight TBT, long prompts, both — and prints the violation rate per k and seed
and how often k changes the decision.  The regimes change the SLOs on purpose
(it is a sensitivity study, not a goodput claim); the bench's figures always
use the defaults.

Run: ``.venv/bin/python -m benchmarks.window_regime [--requests N] [--seeds S] [--jobs J]``.
"""

from __future__ import annotations

import argparse
import dataclasses
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from clients.bench.runner import RunSpec, quiet_logs, run
from clients.workloads import SLOConfig

WINDOWS = (1, 2, 3, 4)
#: (label, workload, rate rps, SLOs): the default regime at its goodput, then tighter TBT
#: with many concurrent decodes, long prompts, and both.
REGIMES: tuple[tuple[str, str, float, SLOConfig], ...] = (
    ("default SLOs, mixed-v1", "mixed-v1", 2.0, SLOConfig()),
    ("TBT 25 ms, mixed-v1", "mixed-v1", 1.6, SLOConfig(tbt_s=0.025)),
    ("long prompts (arXiv), default SLOs", "arxiv", 2.8, SLOConfig()),
    ("TBT 30 ms, arXiv", "arxiv", 2.2, SLOConfig(tbt_s=0.03)),
    ("TBT 25 ms, TTFT 0.15 s + 0.1 ms/token, mixed-v1", "mixed-v1", 1.5,
     SLOConfig(tbt_s=0.025, ttft_base_s=0.15, ttft_per_token_s=0.0001)),
)


def _one(spec: RunSpec) -> dict[str, Any]:
    quiet_logs()
    return run(spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    specs = [
        RunSpec("slidingserve", wl, rate, seed=seed, n_requests=args.requests, slo=slo,
                params=(("window", str(k)),), label=f"{label}|{k}")
        for label, wl, rate, slo in REGIMES for k in WINDOWS for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(args.jobs) as ex:
        results = list(ex.map(_one, specs))
    by: dict[str, dict[int, list[float]]] = {}
    for spec, r in zip(specs, results, strict=True):
        label, k = spec.label.rsplit("|", 1)
        by.setdefault(label, {}).setdefault(int(k), []).append(r["violation_rate"])
    print(f"violation rate per window k (mean over {args.seeds} seeds; per seed in brackets), "
          f"{args.requests} requests per run")
    for label, wl, rate, slo in REGIMES:
        row = by[label]
        cells = "  ".join(f"k={k}: {np.mean(v):6.1%} [{' '.join(f'{x:.1%}' for x in v)}]" for k, v in row.items())
        d = dataclasses.asdict(slo)
        print(f"{label} ({wl} at {rate:g} rps; TTFT {d['ttft_base_s']:g} s + {d['ttft_per_token_s'] * 1e3:g} ms/token,"
              f" TBT {d['tbt_s'] * 1e3:g} ms)\n    {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
