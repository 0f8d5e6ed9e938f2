"""Cost of the vLLM adapter's ``schedule()`` vs vLLM's native ``schedule()``, same queue.

A steady state of ~256 running and ~800 waiting requests, 2048-token budget
(ARCHITECTURE §6): decodes finish at random lengths, freed slots admit waiting
prompts (chunked), new arrivals keep the waiting queue at 800.  The same seeded
process runs with vLLM's ``Scheduler`` and with ``RemoteSyncScheduler`` in-process
(vllm-fcfs, slidingserve) and over gRPC on loopback (embedded server); each
``schedule()`` call is timed, and the adapter's part is split into snapshot,
decision (policy or RPC) and the rest (plan check, KV fit, reorder, caps, restore).

Run: ``VLLM_TARGET_DEVICE=cpu python -m benchmarks.vllm_adapter_overhead [--steps 300]``
(needs the ``vllm`` extra).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np


def _pct(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_case(cls: Any, mdir: str, steps: int, seed: int, warmup: int) -> dict[str, list[float]]:
    from tests.vllm.support import build_scheduler, fake_output, make_request

    rng = np.random.default_rng(seed)
    s = build_scheduler(cls, mdir, async_scheduling=False, num_blocks=60_000, max_num_batched_tokens=2048,
                        max_num_seqs=256, max_model_len=4096)

    def new_request() -> Any:
        return make_request(int(rng.integers(32, 1024)), int(rng.integers(16, 400)),
                            extra_args={"slo_ttft_ms": float(rng.uniform(300, 3000)), "slo_tbt_ms": 80})

    for _ in range(1056):
        s.add_request(new_request())
    times: dict[str, list[float]] = {"total": [], "snapshot": [], "decide": [], "running": [], "waiting": []}
    snap_t: list[float] = []
    if hasattr(s, "_snapshot"):
        inner = s._snapshot

        def timed() -> Any:
            t = time.perf_counter()
            try:
                return inner()
            finally:
                snap_t.append(time.perf_counter() - t)
        s._snapshot = timed
    k = 0
    while len(times["total"]) < steps:
        while len(s.waiting) < 800:
            s.add_request(new_request())
        d0 = s._ss_counts["decide_us"] if hasattr(s, "_ss_counts") else 0
        n_snap = len(snap_t)
        t0 = time.perf_counter()
        so = s.schedule()
        dt = time.perf_counter() - t0
        s.update_from_output(so, fake_output(s, so))
        k += 1
        if k <= warmup:
            continue
        times["total"].append(dt * 1e3)
        times["running"].append(len(s.running))
        times["waiting"].append(len(s.waiting))
        if hasattr(s, "_ss_counts"):
            times["decide"].append((s._ss_counts["decide_us"] - d0) / 1e3)
            times["snapshot"].append(snap_t[-1] * 1e3 if len(snap_t) > n_snap else 0.0)
    if hasattr(s, "slidingserve_stats"):
        st = s.slidingserve_stats()
        times["_stats"] = [st["planned"], st["native"], st["deviating_iterations"]]
        s.slidingserve_close()
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_adapter.vllm import RemoteSyncScheduler
    from tests.grpc_support import make_server
    from tests.vllm.support import model_dir, scheduler_class

    mdir = model_dir(Path(tempfile.mkdtemp()))
    srv = make_server().start()
    try:
        cases = {
            "native": Scheduler,
            "inproc vllm-fcfs": scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_POLICY": "vllm-fcfs"}),
            "inproc slidingserve": scheduler_class(RemoteSyncScheduler, {"SLIDINGSERVE_POLICY": "slidingserve"}),
            "grpc slidingserve": scheduler_class(RemoteSyncScheduler, {
                "SLIDINGSERVE_ADDRESS": srv.target, "SLIDINGSERVE_POLICY": "slidingserve",
                "SLIDINGSERVE_DEADLINE_MS": "200"}),
            "grpc vllm-fcfs": scheduler_class(RemoteSyncScheduler, {
                "SLIDINGSERVE_ADDRESS": srv.target, "SLIDINGSERVE_POLICY": "vllm-fcfs",
                "SLIDINGSERVE_DEADLINE_MS": "200"}),
        }
        res = {name: run_case(cls, mdir, args.steps, args.seed, args.warmup) for name, cls in cases.items()}
    finally:
        srv.stop(grace=0)
    base50, base99 = _pct(res["native"]["total"])
    print(f"schedule() with ~256 running + ~800 waiting, 2048-token budget, {args.steps} calls each (ms)")
    print(f"{'case':22s} {'p50':>7s} {'p99':>7s} {'ratio50':>8s} {'ratio99':>8s} {'snap50':>7s} {'decide50':>9s} "
          f"{'rest50':>7s} {'running':>8s} {'waiting':>8s}  planned/native/deviating")
    for name, t in res.items():
        p50, p99 = _pct(t["total"])
        extra = ""
        if t["decide"]:
            rest = [a - b for a, b in zip(t["total"], t["decide"], strict=True)]
            extra = f"{_pct(t['snapshot'])[0]:7.3f} {_pct(t['decide'])[0]:9.3f} {_pct(rest)[0]:7.3f}"
        else:
            extra = f"{'':7s} {'':9s} {'':7s}"
        print(f"{name:22s} {p50:7.3f} {p99:7.3f} {p50 / base50:8.2f} {p99 / base99:8.2f} {extra} {np.mean(t['running']):8.0f} "
              f"{np.mean(t['waiting']):8.0f}  {t.get('_stats', '')}")


if __name__ == "__main__":
    main()
