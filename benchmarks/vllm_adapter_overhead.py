"""Cost of the vLLM adapter's ``schedule()`` vs vLLM's native ``schedule()``, same queue.

A steady state of ~256 running and ~800 waiting requests, 2048-token budget
(docs/vllm.md): decodes finish at random lengths, freed slots admit waiting
prompts (chunked), new arrivals keep the waiting queue at 800.  The same seeded
process runs with vLLM's ``Scheduler`` and with ``RemoteSyncScheduler`` in-process
(vllm-fcfs, slidingserve) and over gRPC on loopback (embedded server), with
pipelining (the default: the next decision is taken in the background while the
GPU step runs) and without.  The GPU step is a sleep of ``--step-ms`` between
``schedule()`` and ``update_from_output()`` (the engine thread waits for the GPU
workers there, holding no GIL).

The gRPC cases talk to a real ``slidingserve serve`` process on loopback (as in a
deployment: the service's threads do not compete for the engine's GIL).

Columns: ``schedule()`` p50/p99 and its ratio to native; ``engine+`` is the engine
thread's extra time per iteration vs native (``schedule()`` plus
``update_from_output()``, p50 differences; it includes vLLM doing different work for
a policy's different batches), ``update+`` the ``update_from_output()`` part of it;
``own`` is the adapter's own engine-thread time per iteration, measured inside the
adapter (both calls minus vLLM's own ``schedule()``/``update_from_output()``) — the
part that is *not* overlapped with the GPU step in a synchronous engine; ``decide``
the time to get the plan in ``schedule()``, ``wait`` the part of it spent waiting for
a background decision, ``ahead`` the hand-over to the next background decision.

``--async-scheduling`` runs vLLM's ``AsyncScheduler`` and the adapter's ``RemoteScheduler``
(vLLM's default on GPUs): vLLM calls ``schedule()`` for the next step while the GPU runs the
current one, so ``schedule()`` is hidden behind the GPU step unless the engine thread's work
per step outgrows it; the pipelined adapter takes the next snapshot at the end of
``schedule()``, on the engine thread (``ahead50``), since vLLM applies the running step's
output right after it.

``--shared-prefix N`` prepends the same N tokens (a system prompt) to every prompt, so
that with vLLM's prefix caching (on here) every waiting request has a cached prefix the
adapter looks up for its snapshot (``SLIDINGSERVE_PREFIX_LOOKUP``, docs/vllm.md, Prefix
caching); ``--cases`` runs only the cases whose names contain one of its comma-separated
words (``native`` always runs: it is the reference).

Run: ``VLLM_TARGET_DEVICE=cpu python -m benchmarks.vllm_adapter_overhead [--steps 300] [--step-ms 30]
[--shared-prefix 512] [--cases inproc] [--async-scheduling]`` (needs the ``vllm`` extra).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np

from engine_adapter.faults import ServiceProcess


def _pct(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_case(cls: Any, mdir: str, steps: int, seed: int, warmup: int, step_ms: float,
             shared_prefix: int = 0, async_scheduling: bool = False) -> dict[str, list[float]]:
    # vLLM (the optional ``vllm`` extra) loads here, after main() has quieted its logs
    from engine_adapter.vllm.testbed import build_scheduler, fake_output, make_request

    rng = np.random.default_rng(seed)
    s = build_scheduler(cls, mdir, async_scheduling=async_scheduling, num_blocks=60_000, max_num_batched_tokens=2048,
                        max_num_seqs=256, max_model_len=4096)
    with_prefix = _prefixed(shared_prefix, seed) if shared_prefix > 0 else None

    def new_request() -> Any:
        r = make_request(int(rng.integers(32, 1024)), int(rng.integers(16, 400)),
                         extra_args={"slo_ttft_ms": float(rng.uniform(300, 3000)), "slo_tbt_ms": 80})
        return with_prefix(r) if with_prefix is not None else r

    for _ in range(1056):
        s.add_request(new_request())
    times: dict[str, list[float]] = {"total": [], "update": [], "decide": [], "wait": [],
                                     "ahead": [], "own": [], "running": [], "waiting": []}
    k = 0
    while len(times["total"]) < steps:
        while len(s.waiting) < 800:
            s.add_request(new_request())
        c0 = dict(s._ss_counts) if hasattr(s, "_ss_counts") else {}
        t0 = time.perf_counter()
        so = s.schedule()
        dt = time.perf_counter() - t0
        out = fake_output(s, so)
        if step_ms > 0:
            time.sleep(step_ms / 1e3)
        t1 = time.perf_counter()
        s.update_from_output(so, out)
        du = time.perf_counter() - t1
        k += 1
        if k <= warmup:
            continue
        times["total"].append(dt * 1e3)
        times["update"].append(du * 1e3)
        times["running"].append(len(s.running))
        times["waiting"].append(len(s.waiting))
        if hasattr(s, "_ss_counts"):
            c1 = s._ss_counts
            times["decide"].append((c1["decide_us"] - c0.get("decide_us", 0)) / 1e3)
            times["wait"].append((c1["wait_us"] - c0.get("wait_us", 0)) / 1e3)
            times["ahead"].append((c1["ahead_us"] - c0.get("ahead_us", 0)) / 1e3)
            times["own"].append((c1["own_us"] - c0.get("own_us", 0)) / 1e3)
    if hasattr(s, "slidingserve_stats"):
        st = s.slidingserve_stats()
        times["_stats"] = [st["planned"], st["pipelined"], st["prefitted"], st["native"], st["deviating_iterations"]]
        s.slidingserve_close()
    return times


def _prefixed(n: int, seed: int) -> Any:
    """A function: a request → the same request with the same ``n`` tokens before its prompt."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from engine_adapter.vllm.testbed import BLOCK

    prefix = [int(t) for t in np.random.default_rng(seed + 1).integers(3, 990, n)]
    hasher = get_request_block_hasher(BLOCK, sha256)  # make_request has set vLLM's hash seed

    def with_prefix(r: Any) -> Any:
        return Request(request_id=r.request_id, prompt_token_ids=prefix + list(r.prompt_token_ids),
                       sampling_params=r.sampling_params, pooling_params=None, arrival_time=r.arrival_time,
                       block_hasher=hasher)
    return with_prefix


def _cases(target: str, tmp: Path, async_scheduling: bool = False) -> dict[str, Any]:
    """The scheduler classes timed: vLLM's, and the adapter's in process and over gRPC, each
    policy with pipelining on and off, recording, and observing (``async_scheduling``: vLLM's
    ``AsyncScheduler`` and the adapter's ``RemoteScheduler``)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_adapter.vllm import RemoteScheduler, RemoteSyncScheduler
    from engine_adapter.vllm.testbed import scheduler_class

    native, ours = (AsyncScheduler, RemoteScheduler) if async_scheduling else (Scheduler, RemoteSyncScheduler)

    grpc = {"SLIDINGSERVE_ADDRESS": target, "SLIDINGSERVE_DEADLINE_MS": "200"}
    cases: dict[str, Any] = {"native": native}
    for where, where_env in (("inproc", {}), ("grpc", grpc)):
        for policy in ("slidingserve", "vllm-fcfs"):
            for pipe in ("on", "off"):
                env = {**where_env, "SLIDINGSERVE_DEPLOYMENT": policy, "SLIDINGSERVE_PIPELINE": pipe}
                cases[f"{where} {policy} pipe={pipe}"] = scheduler_class(ours, env)
    # the traffic recording (SLIDINGSERVE_RECORD), deciding and only watching (SLIDINGSERVE_OBSERVE)
    rec = {"SLIDINGSERVE_DEPLOYMENT": "slidingserve", "SLIDINGSERVE_RECORD": str(tmp / "recording")}
    cases["inproc slidingserve pipe=on record"] = scheduler_class(ours, rec)
    cases["observe record"] = scheduler_class(ours, {**rec, "SLIDINGSERVE_OBSERVE": "true"})
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=30.0, help="simulated GPU step (sleep) per iteration")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens of a common prefix (a system prompt) before every prompt; 0 = none")
    ap.add_argument("--cases", default="", help="comma-separated words: run only the cases naming one "
                    "(native always runs)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="vLLM's AsyncScheduler and the adapter's RemoteScheduler (vLLM's default on GPUs)")
    args = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # vLLM is heavy and optional (the ``vllm`` extra): it loads here, once its logs are quiet
    from engine_adapter.vllm.testbed import model_dir

    tmp = Path(tempfile.mkdtemp())
    mdir = model_dir(tmp)
    srv = ServiceProcess(tmp).start()
    try:
        cases = _cases(srv.target, tmp, args.async_scheduling)
        words = [w.strip() for w in args.cases.split(",") if w.strip()]
        if words:
            cases = {k: v for k, v in cases.items() if k == "native" or any(w in k for w in words)}
        res: dict[str, dict[str, list[float]]] = {}
        for name, cls in cases.items():
            print(f"  running {name} ...", flush=True)
            res[name] = run_case(cls, mdir, args.steps, args.seed, args.warmup, args.step_ms, args.shared_prefix,
                                 args.async_scheduling)
    finally:
        srv.stop()
    base50, base99 = _pct(res["native"]["total"])
    engine0 = _pct([a + b for a, b in zip(res["native"]["total"], res["native"]["update"], strict=True)])[0]
    update0 = _pct(res["native"]["update"])[0]
    print(f"schedule() with ~256 running + ~800 waiting, 2048-token budget, GPU step {args.step_ms:g} ms, "
          f"shared prefix {args.shared_prefix} tokens, {'async' if args.async_scheduling else 'sync'} scheduling, "
          f"{args.steps} calls each (ms)")
    print(f"{'case':32s} {'p50':>7s} {'p99':>7s} {'ratio50':>8s} {'ratio99':>8s} {'engine+':>8s} {'update+':>8s} {'own50':>7s} {'own99':>7s} {'decide50':>9s} "
          f"{'wait50':>7s} {'ahead50':>8s} {'running':>8s} {'waiting':>8s}  planned/pipelined/prefitted/native/deviating")
    for name, t in res.items():
        p50, p99 = _pct(t["total"])
        eng = _pct([a + b for a, b in zip(t["total"], t["update"], strict=True)])[0] - engine0
        if t["decide"]:
            o50, o99 = _pct(t["own"])
            extra = (f"{o50:7.3f} {o99:7.3f} {_pct(t['decide'])[0]:9.3f} {_pct(t['wait'])[0]:7.3f} "
                     f"{_pct(t['ahead'])[0]:8.3f}")
        else:
            extra = f"{'':7s} {'':7s} {'':9s} {'':7s} {'':8s}"
        upd = _pct(t["update"])[0] - update0
        print(f"{name:32s} {p50:7.3f} {p99:7.3f} {p50 / base50:8.2f} {p99 / base99:8.2f} {eng:8.3f} {upd:8.3f} {extra} "
              f"{np.mean(t['running']):8.0f} {np.mean(t['waiting']):8.0f}  {t.get('_stats', '')}")


if __name__ == "__main__":
    main()
