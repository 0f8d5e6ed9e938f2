"""BatchConstructor worst case: 64 candidates, all risky, an 8192-token budget.

    .venv/bin/python -m benchmarks.constructor_worst_case [--candidates 64] [--budget 8192]

Every live prefill is an anchor and the knapsack capacity is the whole
budget, so this is the largest DP one decision can run (target: <= 2 ms).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from scheduler_service.core import Snapshot, default_predictor, registry
from scheduler_service.core.batch import BudgetCurve, CandidateQueue
from scheduler_service.core.constructor import construct_batch
from scheduler_service.core.sorter import mlps_order


def worst_case_snapshot(n: int, budget: int, seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    now = 10.0
    prompt = rng.integers(32, 2 * budget // n, n)
    # TTFT deadlines 0.1-0.65 s away: all below the predicted time of the full
    # greedy batch of 8192 tokens, yet every anchor fits its own capacity.
    return Snapshot.from_columns(
        now=now, max_batch_tokens=budget, max_num_seqs=1024, ids=[f"w{i}" for i in range(n)],
        arrival=np.full(n, now - 0.1) - rng.uniform(0, 0.01, n), prompt_tokens=prompt,
        computed_tokens=np.zeros(n, dtype=np.int64), output_tokens=np.zeros(n, dtype=np.int64),
        ttft_slo=rng.uniform(0.2, 0.75, n), tbt_slo=np.full(n, 0.1), protected=np.zeros(n, dtype=bool),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    pred = default_predictor()
    snaps = [worst_case_snapshot(args.candidates, args.budget, s) for s in range(5)]
    dp_times, plan_times, risky_counts = [], [], []
    pol = registry.create("slidingserve", {"max_candidates": args.candidates})
    for i in range(args.iters):
        snap = snaps[i % len(snaps)]
        pre = np.arange(len(snap))
        q = mlps_order(snap, pre, pred.prefill_throughput(args.budget), 1.0, 1e-3)
        cq = CandidateQueue.build(snap, pred, np.array([], dtype=np.int64), q, n_all_decodes=0)
        curve = BudgetCurve(cq.fill_curve_ms(), 0)
        t_full = float(curve.times[cq.first_cap])
        risky_counts.append(int((snap.slack * 1e3 < t_full).sum()))
        t = time.perf_counter()
        res = construct_batch(snap, pre, curve, 0, t_full, cq.iter_cap, 1024, args.candidates,
                              predictor=pred, decodes=np.array([], dtype=np.int64))
        dp_times.append(time.perf_counter() - t)
        assert res is not None
        t = time.perf_counter()
        plan = pol.plan(snap, pred)
        plan_times.append(time.perf_counter() - t)
        assert plan.path == "batch_constructor", plan.path
    dp = np.array(dp_times) * 1e3
    pl = np.array(plan_times) * 1e3
    print(f"{args.candidates} candidates, budget {args.budget}, risky per snapshot: "
          f"{min(risky_counts)}..{max(risky_counts)}")
    print(f"construct_batch     p50 {np.percentile(dp, 50):.3f} ms  p99 {np.percentile(dp, 99):.3f} ms")
    print(f"full slidingserve   p50 {np.percentile(pl, 50):.3f} ms  p99 {np.percentile(pl, 99):.3f} ms")


if __name__ == "__main__":
    main()
