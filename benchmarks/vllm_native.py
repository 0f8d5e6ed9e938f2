"""vLLM's native ``schedule()`` on a comparable queue: the yardstick the speed benchmarks print.

    VLLM_TARGET_DEVICE=cpu .venv/bin/python -m benchmarks.vllm_native [--decodes 256] [--queued 512]

The real ``vllm.v1.core.sched.scheduler.Scheduler`` (CPU build, no model: see
``engine_adapter.vllm.testbed``) in a steady state of about ``decodes`` running and
``queued`` waiting requests, ShareGPT-like lengths, a 2048-token budget.  Each iteration
is ``schedule()`` (timed), a sampled token per finished chunk, ``update_from_output()``;
new arrivals keep the waiting queue at ``queued``.  The figure is what the in-process and
gRPC decision times are divided by, measured in the same run, so that a noisy machine
moves both sides of the ratio together.

:func:`native_schedule_ms` returns ``None`` when vLLM (the ``vllm`` extra) is not
installed, so the benchmarks that print it still run without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["native_schedule_ms"]


def native_schedule_ms(decodes: int = 256, queued: int = 512, iters: int = 200, warmup: int = 30,
                       seed: int = 0, max_batch_tokens: int = 2048) -> dict[str, float] | None:
    """p50/p99 (ms) of native ``schedule()``, with the mean running/waiting counts it saw."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        logging.getLogger("vllm").setLevel(logging.ERROR)
        from vllm.v1.core.sched.scheduler import Scheduler

        from engine_adapter.vllm.testbed import build_scheduler, fake_output, make_request, model_dir
    except ImportError:
        return None
    rng = np.random.default_rng(seed)
    mdir = model_dir(Path(tempfile.mkdtemp()))
    s = build_scheduler(Scheduler, mdir, async_scheduling=False, num_blocks=60_000,
                        max_num_batched_tokens=max_batch_tokens, max_num_seqs=decodes,
                        max_model_len=4096)

    def top_up() -> None:
        while len(s.waiting) < queued:
            s.add_request(make_request(int(rng.integers(32, 1024)), int(rng.integers(16, 400))))

    times: list[float] = []
    running: list[int] = []
    for k in range(warmup + iters):
        top_up()
        t0 = time.perf_counter()
        so = s.schedule()
        dt = time.perf_counter() - t0
        s.update_from_output(so, fake_output(s, so))
        if k >= warmup:
            times.append(dt * 1e3)
            running.append(len(s.running))
    t = np.asarray(times)
    return {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)),
            "running": float(np.mean(running)), "waiting": float(queued)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--queued", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    r = native_schedule_ms(args.decodes, args.queued, args.iters)
    if r is None:
        raise SystemExit("vLLM is not installed: `make setup-vllm` installs the vllm extra")
    print(f"vLLM native schedule(): p50 {r['p50']:.3f} ms, p99 {r['p99']:.3f} ms "
          f"(~{r['running']:.0f} running + {args.queued} waiting, {args.iters} calls)")


if __name__ == "__main__":
    main()
