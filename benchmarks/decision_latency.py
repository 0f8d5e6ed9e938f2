"""In-process decision time per policy on a loaded engine's snapshot (compiled kernels).

    .venv/bin/python -m benchmarks.decision_latency [--decodes 256] [--queued 512] [--iters 300]
                                                    [--no-native] [--explain] [--encode] [--python]

Compiles (or loads from numba's disk cache) the kernels first, as the service does at
start-up, then times every policy; with ``--python`` also the same kernels run as plain
Python (what runs without numba), decision by decision in turn (compiled, then Python, on
the same snapshot; the slow Python decisions then cost the compiled ones after them a few
percent of cache).  Prints p50/p99 per backend, their ratio, SlidingServe's
breakdown by component, and vLLM's native ``schedule()`` on a comparable queue when
vLLM is installed (``benchmarks/vllm_native.py``).  Several snapshots (seeds) are
rotated so that no single queue shape decides the figure.  Targets (issue 13):
slidingserve p50 <= 0.25 ms, p99 <= 1 ms.

``--explain`` also times each decision with its reasons classified (``plan_explained``,
the reasons read as arrays, as the service does; issue 24), in turn with the plain
decision on the same snapshot (the order alternating), and prints the overhead at p50
(target: at most 5% for slidingserve) both as the difference of the two medians and
paired (the median of the pairs' differences in each order, averaged: see
:func:`paired_overhead`), and the
times with the reasons not read (an explaining policy has classified them as it assembled
the plan; only a replayed plan's wait for their first read) and with every one read as a
``Reason`` object.

``--encode`` also times what the service does with a plan: ``encode_plan`` to the wire
message and its serialisation, for the plain plan, for the explained one in the compact
form only (what ``reasons: every`` sends in every plan) and with the PlanReason messages
too (a sampled or asked plan), its reasons already classified, so that the figures are
the encoding alone; and the whole service path (decide, encode, serialise) without
reasons, with the compact ones (``reasons: every``: ``plan_explained``, classified while
encoding) and with both forms, and the overhead of each at p50 (target for ``every``: at
most 5%).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.snapshots import busy_snapshot
from scheduler_service.core import Snapshot, default_predictor, kernels, registry
from scheduler_service.core.reasons import plan_explained
from scheduler_service.wire.convert import encode_plan


def _wire_ms(plan: Any, ids: Any, full: bool = True) -> float:
    """``encode_plan`` and the serialisation of its message (ms)."""
    t = time.perf_counter()
    encode_plan(plan, ids, full=full).SerializeToString()
    return (time.perf_counter() - t) * 1e3


def _service_ms(pol: Any, s: Snapshot, pred: Any, reasons: str) -> float:
    """Decide, encode, serialise (ms): ``reasons`` "" none, "compact" the compact form
    (``reasons: every``), "full" both forms (a sampled or asked plan)."""
    t = time.perf_counter()
    if reasons:
        encode_plan(plan_explained(pol, s, pred), s.ids, full=reasons == "full").SerializeToString()
    else:
        encode_plan(pol.plan(s, pred), s.ids).SerializeToString()
    return (time.perf_counter() - t) * 1e3


def _time_policy(name: str, snaps: list[Snapshot], iters: int, backends: list[str],
                 explained: bool = False, encode: bool = False) -> dict[str, Any]:
    """Per backend: decision times (ms), paths taken, breakdown samples (us); with
    ``explained`` also the times of the decision with reasons (``"tc"``: ``plan_explained``
    and the reasons classified, no object per reason, what the service does; in turn
    with the plain decision, the order alternating), (``"te"``: the reasons not yet read;
    ``"tr"``: every reason read as a ``Reason``); with ``encode`` the wire times (``"w"``:
    the plain plan, ``"wc"`` / ``"wr"``: the explained one, classified, compact only /
    both forms; ``"s"``, ``"sc"``: decide + encode + serialise without reasons and with
    the compact ones, in turn; ``"sr"``: with both forms; ``"kb"``, ``"kbc"``, ``"kbr"``:
    their message sizes)."""
    pred = default_predictor()
    pol = registry.create(name)
    out: dict[str, Any] = {b: {"t": [], "tc": [], "te": [], "tr": [], "w": [], "wc": [], "wr": [], "s": [],
                               "sc": [], "sr": [], "kb": [], "kbc": [], "kbr": [], "paths": {}, "parts": {}}
                           for b in backends}
    for b in backends:
        with kernels.using(b):
            for s in snaps:
                list(plan_explained(pol, s, pred).reasons)  # warm the snapshot's memos and the allocator
    for i in range(iters):
        s = snaps[i % len(snaps)]
        turn = 1 if i % 2 else -1  # which of a pair goes first
        for b in backends:
            with kernels.using(b):
                r = out[b]
                for k in ("t", "tc")[::turn] if explained else ("t",):
                    t = time.perf_counter()
                    if k == "t":
                        plan = pol.plan(s, pred)
                    else:
                        len(plan_explained(pol, s, pred).reasons)  # classified
                    r[k].append((time.perf_counter() - t) * 1e3)
                if explained:
                    t = time.perf_counter()
                    told = plan_explained(pol, s, pred)
                    t1 = time.perf_counter()
                    list(told.reasons)
                    r["te"].append((t1 - t) * 1e3)
                    r["tr"].append((time.perf_counter() - t) * 1e3)
                if encode:
                    r["w"].append(_wire_ms(plan, s.ids))
                    r["wc"].append(_wire_ms(told, s.ids, full=False))
                    r["wr"].append(_wire_ms(told, s.ids))
                    for k, how in (("s", ""), ("sc", "compact"))[::turn]:
                        r[k].append(_service_ms(pol, s, pred, how))
                    r["sr"].append(_service_ms(pol, s, pred, "full"))
                    if i < len(snaps):
                        for k, p, full in (("kb", plan, True), ("kbc", told, False), ("kbr", told, True)):
                            r[k].append(len(encode_plan(p, s.ids, full=full).SerializeToString()) / 1024)
            r = out[b]
            r["paths"][plan.path] = r["paths"].get(plan.path, 0) + 1
            for k, v in plan.breakdown_us.items():
                r["parts"].setdefault(k, []).append(v)
    return out


def _native(decodes: int, queued: int) -> str:
    try:
        from benchmarks.vllm_native import native_schedule_ms
    except ImportError:
        return "vLLM native schedule(): benchmarks/vllm_native.py not available"
    r = native_schedule_ms(decodes, queued)
    if r is None:
        return "vLLM native schedule(): vLLM not installed (the vllm extra)"
    return (f"vLLM native schedule() in the same run: p50 {r['p50']:.3f} ms, p99 {r['p99']:.3f} ms "
            f"(~{r['running']:.0f} running + {queued} waiting)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--queued", type=int, default=512)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--policies", default=",".join(registry.names()))
    ap.add_argument("--no-native", action="store_true", help="skip vLLM's native schedule()")
    ap.add_argument("--explain", action="store_true", help="also time decisions with their reasons")
    ap.add_argument("--python", action="store_true",
                    help="also time the kernels run as plain Python (SLIDINGSERVE_KERNELS=numpy, what runs without "
                         "numba), in turn with the compiled ones")
    ap.add_argument("--encode", action="store_true",
                    help="also time the wire encoding with and without reasons (implies --explain)")
    args = ap.parse_args()
    args.explain = args.explain or args.encode
    default = kernels.backend()
    with kernels.using("numba") as compiled:
        warm = kernels.warm_up()
    # (the plain-Python path in the same loop slows the compiled one after it: off unless asked)
    backends = ["numpy"] if compiled != "numba" else ["numba", "numpy"] if args.python else ["numba"]
    print(f"kernels: {default} by default ({kernels.ENV}=numba|numpy); warm-up {warm:.2f} s; "
          f"timing {' and '.join(backends)}")
    snaps = [busy_snapshot(args.decodes, args.queued, seed=s) for s in range(args.seeds)]
    print(f"snapshot: {args.decodes} decodes + {args.queued} waiting/prefilling (ShareGPT lengths), "
          f"{args.seeds} seeds x {args.iters} decisions per backend")
    head = "".join(f" {b + ' p50':>10s} {b + ' p99':>10s}" for b in backends)
    print(f"{'policy':22s}{head} {'numpy/numba p50':>16s}  paths")
    sliding = None
    explained: list[str] = []
    wire: list[str] = []
    for name in args.policies.split(","):
        res = _time_policy(name, snaps, args.iters, backends, args.explain, args.encode)
        if args.explain:
            explained.append(_overhead(name, res, backends))
        if args.encode:
            wire.append(_wire(name, res, backends))
        q = {b: (np.percentile(res[b]["t"], 50), np.percentile(res[b]["t"], 99)) for b in backends}
        cols = "".join(f" {q[b][0]:10.3f} {q[b][1]:10.3f}" for b in backends)
        ratio = f"{q['numpy'][0] / q['numba'][0]:15.1f}x" if len(backends) == 2 else f"{'-':>16s}"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(res[backends[0]]["paths"].items()))
        print(f"{name:22s}{cols} {ratio}  {paths}")
        if name == "slidingserve":
            sliding = res
    if sliding is not None:
        for b in backends:
            br = ", ".join(f"{k} {np.median(v):.0f} us" for k, v in sliding[b]["parts"].items())
            print(f"slidingserve median breakdown ({b}): {br}")
    if explained:
        print("p50 decision -> with its reasons classified (plan_explained, read as arrays; in turn with the "
              "decision), overhead at p50; and with them not read, and every one read as a Reason:")
        print("\n".join(explained))
    if wire:
        print("p50 encode_plan + serialise, plain -> compact reasons -> both forms (reasons classified), mean message "
              "size; and decide + encode + serialise (what the service does) without reasons -> compact "
              "(reasons: every) -> both forms (a sampled plan), overhead at p50:")
        print("\n".join(wire))
    if not args.no_native:
        print(_native(args.decodes, args.queued))


def paired_overhead(off: list[float], on: list[float]) -> float:
    """The overhead of ``on`` over ``off`` timed in pairs (the same snapshot, one right
    after the other, the order alternating: ``on`` first in the even pairs), in percent
    of the median of ``off``: the median of the pairs' differences taken in each order
    apart, then averaged.  A noisy machine moves both members of a pair together; the
    first of a pair also pays for the cold caches the work before it left (tens of us
    here), so the differences fall in two groups, one per order, and the median of all
    of them lands anywhere between the two: averaging the two orders' medians cancels
    that cost."""
    d = np.subtract(on, off)
    mid = float(np.median(d)) if len(d) < 2 else (float(np.median(d[0::2])) + float(np.median(d[1::2]))) / 2
    return 100 * mid / float(np.median(off))


def _overhead(name: str, res: dict[str, Any], backends: list[str]) -> str:
    cols = []
    for b in backends:
        off, cls, on, read = (float(np.percentile(res[b][k], 50)) for k in ("t", "tc", "te", "tr"))
        cols.append(f"{b} {off:.3f} -> classified {cls:.3f} ms ({100 * (cls - off) / off:+.1f}%, paired "
                    f"{paired_overhead(res[b]['t'], res[b]['tc']):+.1f}%); not read {on:.3f} ms, every reason read "
                    f"{read:.3f} ms")
    return f"  {name:22s}" + "; ".join(cols)


def _wire(name: str, res: dict[str, Any], backends: list[str]) -> str:
    cols = []
    for b in backends:
        w, wc, wr, s, sc, sr = (float(np.percentile(res[b][k], 50)) for k in ("w", "wc", "wr", "s", "sc", "sr"))
        kb, kbc, kbr = (float(np.mean(res[b][k])) for k in ("kb", "kbc", "kbr"))
        cols.append(f"{b} encode {w:.3f} -> {wc:.3f} -> {wr:.3f} ms ({kb:.1f} -> {kbc:.1f} -> {kbr:.1f} KB); "
                    f"service path {s:.3f} -> {sc:.3f} ms ({100 * (sc - s) / s:+.1f}%, paired "
                    f"{paired_overhead(res[b]['s'], res[b]['sc']):+.1f}%) -> {sr:.3f} ms ({100 * (sr - s) / s:+.1f}%)")
    return f"  {name:22s}" + "; ".join(cols)


if __name__ == "__main__":
    main()
