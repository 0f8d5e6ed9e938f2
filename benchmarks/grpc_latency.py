"""Scheduling over real loopback gRPC: unary vs stream, columnar vs row encoding.

    .venv/bin/python -m benchmarks.grpc_latency [--iters 500] [--seeds 3] [--in-process] [--workers N]

The snapshot is a loaded engine's: 256 decodes + 512 waiting/prefilling requests with ShareGPT
lengths (``benchmarks.snapshots.busy_snapshot``, seeded).  The server (``slidingserve serve``)
runs in a separate process by default (as in production, engine and service share no GIL);
``--in-process`` embeds it instead.  Figures:

* per wire encoding: encode (core Snapshot → protobuf bytes), decode (bytes → validated core
  Snapshot) and the message size;
* per field of the columnar snapshot and of the plan: bytes on the wire and the time to decode
  it (server) or encode it (client / server);
* the server side of a call step by step, in this process with the server's own functions:
  parse (bytes → message), decode (message → numpy columns), validate (``Snapshot.from_arrays``),
  plan, encode (plan → response bytes); then decode + validate and plan encode before the
  columnar path (``np.array`` + ``Snapshot.from_columns``, list ``extend``) and after it,
  interleaved call by call;
* end-to-end p50/p99 of ``SchedulerClient.schedule`` (unary) and of one long-lived
  ``ScheduleStream``, client encode and plan decode included; ``server`` is the server-side time
  from the response (decode, validate, plan, encode), so ``e2e - server`` is transport and client;
* with ``--throughput 1,2``: decisions/s of ``--workers`` 1 and 2 under closed-loop streams.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks.snapshots import busy_snapshot
from engine_adapter.faults import ServiceProcess
from scheduler_service.client import SchedulerClient
from scheduler_service.core import Plan, Snapshot, default_predictor, registry
from scheduler_service.core.snapshot import COLUMN_DTYPES
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server import SchedulerServer, ServerConfig
from scheduler_service.wire.convert import columns_to_arrays, plan_to_pb, snapshot_from_pb, snapshot_to_pb


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


def bench_codec(snaps: list[Snapshot], iters: int) -> list[tuple[str, float, float, float, float, int]]:
    rows = []
    for enc in ("columns", "rows"):
        blobs = [snapshot_to_pb(s, encoding=enc).SerializeToString() for s in snaps]
        e = timed(lambda s, enc=enc: snapshot_to_pb(s, encoding=enc).SerializeToString(), snaps, iters)
        d = timed(lambda b: snapshot_from_pb(pb.Snapshot.FromString(b), max_requests=100_000), blobs, iters)
        rows.append((enc, *pct(e), *pct(d), len(blobs[0])))
    return rows


def _decode_field(c: pb.RequestColumns, name: str) -> object:
    """What the server's decoder does with one column (``columns_to_arrays``)."""
    if name == "ids":
        return tuple(c.ids)
    return np.asarray(getattr(c, name), dtype=COLUMN_DTYPES[name])


def bench_fields(snaps: list[Snapshot], plan: Plan, iters: int) -> list[tuple[str, int, float, float]]:
    """(field, bytes, decode µs p50, encode µs p50) per snapshot column and plan field.

    Bytes are the field's share of the serialized message (tag, length and payload);
    decode is the server's conversion of the parsed field to numpy (or the id tuple),
    encode the client's (snapshot) or server's (plan) filling of the field."""
    msgs = [pb.Snapshot.FromString(snapshot_to_pb(s).SerializeToString()).columns for s in snaps]
    parsed = pb.Plan.FromString(plan_to_pb(plan).SerializeToString())
    # (label, message class, field, parsed messages, server decode, values the sender fills in)
    cases: list[tuple[str, Any, str, list[Any], Callable[[Any], object], list[Any]]] = [
        (f"snapshot.columns.{name}", pb.RequestColumns, name, msgs, partial(_decode_field, name=name),
         [list(s.ids) if name == "ids" else getattr(s, name).tolist() for s in snaps])
        for name in ("ids", *COLUMN_DTYPES)]
    cases += [(f"plan.{name}", pb.Plan, name, [parsed], lambda m, name=name: list(getattr(m, name)), [values])
              for name, values in (("allocation_ids", [a.id for a in plan.allocations]),
                                   ("allocation_tokens", [a.tokens for a in plan.allocations]))]
    rows = []
    for label, cls, name, parsed_msgs, decode, values in cases:
        size = cls(**{name: getattr(parsed_msgs[0], name)}).ByteSize()
        dec = timed(decode, parsed_msgs, iters)
        enc = timed(lambda v, cls=cls, name=name: cls(**{name: v}), values, iters)
        rows.append((label, size, pct(dec)[0] * 1e3, pct(enc)[0] * 1e3))
    rows.append(("plan (other fields)", parsed.ByteSize() - sum(r[1] for r in rows[-2:]), 0.0, 0.0))
    return rows


def bench_server_steps(snaps: list[Snapshot], policy: str, iters: int) -> list[tuple[str, float, float]]:
    """The server side of a call, step by step, with the server's own functions, on a
    freshly parsed message each call (as the server sees them)."""
    pol, pred = registry.create(policy), default_predictor()
    blobs = [pb.ScheduleRequest(snapshot=snapshot_to_pb(s), policy=policy).SerializeToString() for s in snaps]
    steps: dict[str, list[float]] = {k: [] for k in ("parse", "decode", "validate", "plan", "encode", "total")}
    for i in range(iters):
        t0 = time.perf_counter()
        req = pb.ScheduleRequest.FromString(blobs[i % len(blobs)])
        t1 = time.perf_counter()
        ids, cols = columns_to_arrays(req.snapshot.columns)
        t2 = time.perf_counter()
        snap = Snapshot.from_arrays(ids=ids, columns=cols, **_scalars(req.snapshot))
        t3 = time.perf_counter()
        plan = pol.plan(snap, pred)
        t4 = time.perf_counter()
        pb.ScheduleResponse(request_id=req.request_id, plan=plan_to_pb(plan), server_us=1).SerializeToString()
        t5 = time.perf_counter()
        for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True):
            steps[k].append(dt)
    return [(k, *pct(v)) for k, v in steps.items()]


def _scalars(msg: pb.Snapshot) -> dict[str, Any]:
    return {"now": msg.now, "max_batch_tokens": msg.max_batch_tokens, "max_num_seqs": msg.max_num_seqs,
            "free_kv_tokens": msg.free_kv_tokens if msg.HasField("free_kv_tokens") else None}


def _decode_before(msg: pb.Snapshot) -> Snapshot:
    """The decoder before the columnar path, for comparison: ``np.array`` per column, then
    the generic ``Snapshot.from_columns`` (per-element type checks, copies)."""
    c = msg.columns
    cols = {name: np.array(getattr(c, name), dtype=dt) for name, dt in COLUMN_DTYPES.items()}
    return Snapshot.from_columns(ids=tuple(c.ids), **cols, **_scalars(msg))


def _decode_after(msg: pb.Snapshot) -> Snapshot:
    ids, cols = columns_to_arrays(msg.columns)
    return Snapshot.from_arrays(ids=ids, columns=cols, **_scalars(msg))


def _encode_before(plan: Plan) -> bytes:
    """The plan encoder before the columnar path: two list comprehensions and ``extend``."""
    msg = pb.Plan(policy=plan.policy, policy_version=plan.policy_version, predictor_version=plan.predictor_version,
                  path=plan.path, token_budget=plan.token_budget, predicted_latency_ms=plan.predicted_latency_ms,
                  decision_us=plan.decision_us)
    msg.allocation_ids.extend([a.id for a in plan.allocations])
    msg.allocation_tokens.extend([a.tokens for a in plan.allocations])
    msg.breakdown_us.update({str(k): int(v) for k, v in plan.breakdown_us.items()})
    return pb.ScheduleResponse(request_id="r", plan=msg, server_us=1).SerializeToString()


def _encode_after(plan: Plan) -> bytes:
    return pb.ScheduleResponse(request_id="r", plan=plan_to_pb(plan), server_us=1).SerializeToString()


def bench_before_after(snaps: list[Snapshot], policy: str, iters: int) -> list[tuple[str, float, float, float, float]]:
    """(step, before p50, before p99, after p50, after p99) in ms, the two interleaved call by
    call on freshly parsed messages (fresh id strings, no warm hashes), so both see the same
    machine."""
    pol, pred = registry.create(policy), default_predictor()
    blobs = [snapshot_to_pb(s).SerializeToString() for s in snaps]
    plans = [pol.plan(s, pred) for s in snaps]
    out = []
    for step, before, after, items in (("decode + validate", _decode_before, _decode_after, blobs),
                                       ("plan encode", _encode_before, _encode_after, plans)):
        times: dict[Any, list[float]] = {before: [], after: []}
        for i in range(iters):
            for fn in ((before, after) if i % 2 else (after, before)):
                item = items[i % len(items)]
                arg = pb.Snapshot.FromString(item) if isinstance(item, bytes) else item
                t = time.perf_counter()
                fn(arg)
                times[fn].append(time.perf_counter() - t)
        out.append((step, *pct(times[before]), *pct(times[after])))
    return out


def server(in_process: bool, workers: int = 1) -> SchedulerServer | ServiceProcess:
    """The benchmark server, to start with ``with``: embedded in this process, or
    ``slidingserve serve`` (one server, or a supervisor of ``workers``) in a subprocess."""
    if in_process:
        return SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning", grace_s=0.0))
    return ServiceProcess(Path(tempfile.mkdtemp(prefix="grpc-latency-")), log_level="warning", workers=workers)


# ------------------------------------------------------------- decisions per second
SCHEDULE_STREAM = "/slidingserve.v1.SchedulerService/ScheduleStream"


def _load_client(target: str, pid: str, blobs: list[bytes], seconds: float, out: Any, start: Any) -> None:
    """One closed-loop engine stand-in: a connection to worker ``pid`` (reconnecting until
    the kernel hands one to it), one ScheduleStream of pre-encoded requests, raw bytes both
    ways so that the client spends as little CPU as possible; puts its decision count."""
    import queue  # deferred: only the load clients need these

    from benchmarks.fleet_load import worker_channel  # fleet_load imports the engine adapter

    for _ in range(256):
        ch, got = worker_channel(target)
        if got == pid:
            break
        ch.close()
    else:  # the kernel never handed this client to its worker: say so rather than stream on a closed channel
        raise SystemExit(f"grpc_latency: 256 connections never reached worker {pid}")
    call = ch.stream_stream(SCHEDULE_STREAM, request_serializer=None, response_deserializer=None)
    start.wait()  # every client connected: all run over the same seconds
    end, done = time.monotonic() + seconds, 0
    q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    q.put(blobs[0])
    for done, _reply in enumerate(call(iter(q.get, None)), 1):  # the next request once answered
        q.put(None if time.monotonic() >= end else blobs[done % len(blobs)])
    ch.close()
    out.put(done)


def bench_throughput(snaps: list[Snapshot], workers: int, clients: int, seconds: float,
                     policy: str) -> tuple[float, list[int], float]:
    """Decisions/s of ``slidingserve serve --workers N`` under ``clients`` closed-loop
    streams spread evenly over the workers; returns (decisions/s, decisions per client,
    cores the service's processes used)."""
    import multiprocessing as mp  # deferred: only this figure uses it

    from benchmarks.fleet_load import Service

    blobs = [pb.ScheduleRequest(snapshot=snapshot_to_pb(s), policy=policy).SerializeToString() for s in snaps]
    with tempfile.TemporaryDirectory(prefix="grpc-throughput-") as tmp:
        service = Service(default_predictor().to_json(), clients, Path(tmp), workers)
        try:
            ctx = mp.get_context("spawn")
            out, start = ctx.Queue(), ctx.Barrier(clients + 1)
            procs = [ctx.Process(target=_load_client, args=(service.target, service.worker_pids[i % workers],
                                                            blobs, seconds, out, start))
                     for i in range(clients)]
            for p in procs:
                p.start()
            start.wait(timeout=180)
            cpu0 = service.cpu_s()
            counts = [out.get(timeout=seconds + 120) for _ in procs]
            cpu = service.cpu_s() - cpu0
            for p in procs:
                p.join(10)
        finally:
            service.stop()
    return sum(counts) / seconds, counts, cpu / seconds


def _spin(seconds: float) -> int:
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
    return n


def free_cores(seconds: float = 2.0) -> float:
    """How many cores this machine gives two busy processes right now, relative to one
    (2.0 on an idle 2-core box; less when other work shares it): the ceiling of any
    two-worker speed-up measured at the same time."""
    import multiprocessing as mp  # deferred: only this figure uses it

    one = _spin(seconds)
    with mp.get_context("spawn").Pool(2) as pool:
        two = pool.map(_spin, [seconds, seconds])
    return sum(two) / one


def main() -> None:
    args = _parser().parse_args()
    snaps = [busy_snapshot(args.decodes, args.queued, seed=s) for s in range(args.seeds)]
    print(f"snapshot: {args.decodes} decodes + {args.queued} waiting/prefilling (ShareGPT lengths), "
          f"{args.seeds} seeds, {args.iters} calls each; policy {args.policy}; "
          f"server {'in-process' if args.in_process else 'in a separate process'}")
    pol, pred = registry.create(args.policy), default_predictor()
    _print_in_process(snaps, pol.plan(snaps[0], pred), args)
    # Fresh Snapshot objects per call, as a server sees them (no memoised derived columns).
    fresh = [snapshot_from_pb(snapshot_to_pb(s), max_requests=100_000)[0] for s in snaps for _ in range(50)]
    inproc = timed(lambda s: pol.plan(s, pred), fresh, min(args.iters, len(fresh)))
    results, srv_times = _end_to_end(snaps, args)
    print("\nend to end (client encode → gRPC → plan → client decode)   p50 ms   p99 ms")
    for name, p50, p99 in [("in-process policy.plan, fresh snapshots (no gRPC)", *pct(inproc)),
                           ("server-side (decode+validate+plan+encode)", *pct(srv_times)), *results]:
        print(f"  {name:52s}  {p50:7.3f}  {p99:7.3f}")
    if args.throughput:
        _print_throughput(snaps, args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--queued", type=int, default=512)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policy", default="slidingserve")
    ap.add_argument("--in-process", action="store_true", help="embed the server in this process")
    ap.add_argument("--workers", type=int, default=1, help="worker processes of the benchmark server")
    ap.add_argument("--throughput", metavar="N,N", help="also measure decisions/s with these worker counts, e.g. 1,2")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop streams for --throughput")
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of each --throughput run")
    return ap


def _print_in_process(snaps: list[Snapshot], plan: Plan, args: argparse.Namespace) -> None:
    """The tables measured in this process: wire encodings, fields, server steps, before/after."""
    print("\nwire encoding               encode p50/p99 ms    decode+validate p50/p99 ms   bytes")
    for enc, e50, e99, d50, d99, size in bench_codec(snaps, args.iters):
        print(f"  {enc:24s}  {e50:7.3f} / {e99:7.3f}       {d50:7.3f} / {d99:7.3f}          {size}")
    print("\nper field (seed 0)                 bytes   decode p50 µs   encode p50 µs")
    for name, size, dec, encode in bench_fields(snaps, plan, args.iters):
        print(f"  {name:32s} {size:7d}   {dec:13.1f}   {encode:13.1f}")
    print("\nserver side, step by step (in this process)   p50 ms   p99 ms")
    for name, p50, p99 in bench_server_steps(snaps, args.policy, args.iters):
        print(f"  {name:44s} {p50:7.3f}  {p99:7.3f}")
    print("\nbefore → after the columnar path (interleaved)   before p50 / p99 ms    after p50 / p99 ms")
    for name, b50, b99, a50, a99 in bench_before_after(snaps, args.policy, args.iters):
        print(f"  {name:44s}  {b50:7.3f} / {b99:7.3f}     {a50:7.3f} / {a99:7.3f}")


def _end_to_end(snaps: list[Snapshot], args: argparse.Namespace) -> tuple[list[tuple[Any, ...]], list[float]]:
    """Unary and stream calls through the client (both encodings): (name, p50, p99) rows;
    and the server-side times the responses report (columnar)."""
    results: list[tuple[Any, ...]] = []
    with server(args.in_process, args.workers) as srv:
        for enc in ("columns", "rows"):
            with SchedulerClient(srv.target, timeout_s=5.0, encoding=enc) as cl:
                for kind in ("unary", "stream"):
                    with cl.stream() if kind == "stream" else contextlib.nullcontext(cl) as c:
                        fn = partial(c.schedule, policy=args.policy)
                        timed(fn, snaps, 60)  # warm-up: connection, caches
                        results.append((f"{kind} ({enc})", *pct(timed(fn, snaps, args.iters))))
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb_grpc.SchedulerServiceStub(ch)
            reqs = [pb.ScheduleRequest(snapshot=snapshot_to_pb(s), policy=args.policy) for s in snaps]
            srv_times = [stub.Schedule(reqs[i % len(reqs)]).server_us * 1e-6 for i in range(args.iters)]
    return results, srv_times


def _print_throughput(snaps: list[Snapshot], args: argparse.Namespace) -> None:
    """Decisions/s with each of ``--throughput``'s worker counts."""
    print(f"\ndecisions/s, {args.clients} closed-loop streams spread over the workers, {args.seconds:g} s each; "
          f"{os.cpu_count()} CPUs, two busy processes get {free_cores():.2f} cores now")
    base = None
    for w in (int(x) for x in args.throughput.split(",")):
        rate, counts, cores = bench_throughput(snaps, w, args.clients, args.seconds, args.policy)
        base = base or rate
        print(f"  workers {w}: {rate:8,.0f} decisions/s  ({rate / base:.2f}x the first)  service used {cores:.2f} "
              f"cores, {1e3 * cores / max(rate, 1e-9):.2f} CPU-ms per decision; per stream {counts}")
    print(f"  (machine after: two busy processes get {free_cores():.2f} cores)")


if __name__ == "__main__":
    main()
