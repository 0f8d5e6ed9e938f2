"""Scheduling over real loopback gRPC: unary vs stream, columnar vs row encoding.

    .venv/bin/python -m benchmarks.grpc_latency [--iters 500] [--seeds 3] [--in-process]

The snapshot is a loaded engine's: 256 decodes + 512 waiting/prefilling requests with
ShareGPT lengths (``benchmarks.snapshots.busy_snapshot``, seeded).  The server runs in a
separate process by default (as in production, the engine and the service do not share a
GIL); ``--in-process`` embeds it instead.  Figures:

* encode (core Snapshot → protobuf bytes) and decode (bytes → validated core Snapshot)
  per encoding, plus the message size — the choice of wire encoding;
* end-to-end p50/p99 of ``SchedulerClient.schedule`` (unary) and of one long-lived
  ``ScheduleStream``, each including client encode and plan decode, with policy
  slidingserve; ``server`` is the server-side time from the response (decode, validate,
  plan, encode), so ``e2e - server`` is the transport and client cost.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks.snapshots import busy_snapshot
from scheduler_service.client import SchedulerClient
from scheduler_service.core import Snapshot, default_predictor, registry
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server import SchedulerServer, ServerConfig
from scheduler_service.wire.convert import snapshot_from_pb, snapshot_to_pb

ROOT = Path(__file__).resolve().parent.parent


def pct(xs: list[float]) -> tuple[float, float]:
    a = np.array(xs) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def timed(fn: Callable[[Any], object], items: Sequence[Any], iters: int) -> list[float]:
    """Seconds per call of ``fn(item)``, rotating through ``items``."""
    out = []
    for i in range(iters):
        item = items[i % len(items)]
        t = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t)
    return out


def _encode(snap: Snapshot, encoding: str) -> bytes:
    return snapshot_to_pb(snap, encoding=encoding).SerializeToString()


def bench_codec(snaps: list[Snapshot], iters: int) -> list[tuple[str, float, float, float, float, int]]:
    rows = []
    for enc in ("columns", "rows"):
        blobs = [snapshot_to_pb(s, encoding=enc).SerializeToString() for s in snaps]
        e = timed(partial(_encode, encoding=enc), snaps, iters)
        d = timed(lambda b: snapshot_from_pb(pb.Snapshot.FromString(b), max_requests=100_000), blobs, iters)
        rows.append((enc, *pct(e), *pct(d), len(blobs[0])))
    return rows


def serve_child(port_file: str) -> None:
    """Child process: serve until stdin closes."""
    with SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning")) as srv:
        Path(port_file).write_text(str(srv.port))
        sys.stdin.read()


def start_server(in_process: bool) -> tuple[str, Callable[[], None]]:
    if in_process:
        srv = SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning")).start()
        return srv.target, lambda: srv.stop(0)
    port_file = Path(tempfile.mkdtemp()) / "port"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_latency", "--serve-child", str(port_file)],
                            cwd=ROOT, stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("benchmark server did not start")
        time.sleep(0.05)

    def stop() -> None:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)

    return f"127.0.0.1:{port_file.read_text()}", stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--queued", type=int, default=512)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policy", default="slidingserve")
    ap.add_argument("--in-process", action="store_true", help="embed the server in this process")
    ap.add_argument("--serve-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child:
        serve_child(args.serve_child)
        return

    snaps = [busy_snapshot(args.decodes, args.queued, seed=s) for s in range(args.seeds)]
    print(f"snapshot: {args.decodes} decodes + {args.queued} waiting/prefilling (ShareGPT lengths), "
          f"{args.seeds} seeds, {args.iters} calls each; policy {args.policy}; "
          f"server {'in-process' if args.in_process else 'in a separate process'}")

    print("\nwire encoding               encode p50/p99 ms    decode+validate p50/p99 ms   bytes")
    for enc, e50, e99, d50, d99, size in bench_codec(snaps, args.iters):
        print(f"  {enc:24s}  {e50:7.3f} / {e99:7.3f}       {d50:7.3f} / {d99:7.3f}          {size}")

    pol, pred = registry.create(args.policy), default_predictor()
    # Fresh Snapshot objects per call, as a server sees them (no memoised derived columns).
    fresh = [snapshot_from_pb(snapshot_to_pb(s), max_requests=100_000)[0] for s in snaps for _ in range(50)]
    inproc = timed(lambda s: pol.plan(s, pred), fresh, min(args.iters, len(fresh)))

    target, stop = start_server(args.in_process)
    results = []
    try:
        for enc in ("columns", "rows"):
            with SchedulerClient(target, timeout_s=5.0, encoding=enc) as cl:
                unary = partial(cl.schedule, policy=args.policy)
                timed(unary, snaps, 60)  # warm-up: connection, caches
                results.append((f"unary ({enc})", *pct(timed(unary, snaps, args.iters))))
                with cl.stream() as st:
                    stream = partial(st.schedule, policy=args.policy)
                    timed(stream, snaps, 60)
                    results.append((f"stream ({enc})", *pct(timed(stream, snaps, args.iters))))
        # Server-side time, as reported in the responses (columnar).
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.SchedulerServiceStub(ch)
            reqs = [pb.ScheduleRequest(snapshot=snapshot_to_pb(s), policy=args.policy) for s in snaps]
            srv_times = [stub.Schedule(reqs[i % len(reqs)]).server_us * 1e-6 for i in range(args.iters)]
    finally:
        stop()

    print("\nend to end (client encode → gRPC → plan → client decode)   p50 ms   p99 ms")
    print(f"  {'in-process policy.plan, fresh snapshots (no gRPC)':52s}  {pct(inproc)[0]:7.3f}  {pct(inproc)[1]:7.3f}")
    print(f"  {'server-side (decode+validate+plan+encode)':52s}  {pct(srv_times)[0]:7.3f}  {pct(srv_times)[1]:7.3f}")
    for name, p50, p99 in results:
        print(f"  {name:52s}  {p50:7.3f}  {p99:7.3f}")


if __name__ == "__main__":
    main()
