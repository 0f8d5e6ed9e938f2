"""The *previous release* side of the cross-version wire tests (tests/test_wire_compat.py).

Run as a script in a subprocess, never imported by pytest::

    python tests/wire_compat_peer.py --stubs DIR --source DIR serve  --snapshots FILE
    python tests/wire_compat_peer.py --stubs DIR --source DIR client --snapshots FILE --target HOST:PORT

``--source`` is the previous release's source tree (``git archive`` of the commit recorded
next to the baseline image) and ``--stubs`` holds Python code that protoc generated from the
baseline image (``slidingserve/v1/scheduler_pb2*.py``).  Both go in front of everything else
on ``sys.path``, and the stubs replace ``scheduler_service.gen.slidingserve.v1`` in
``sys.modules`` before any of the old code imports them, so this process is the previous
release in code *and* wire schema.  It runs in its own process because one protobuf
descriptor pool cannot hold two revisions of ``slidingserve/v1/scheduler.proto``.

Only entry points that every release has are used here (SchedulerServer, ServerConfig,
SchedulerClient, the policy registry, Snapshot/Plan JSON), so this script keeps working
when the baseline is rolled forward.

``serve`` prints one JSON line ``{"port", "reference", "modules"}`` (``reference``: the old release's
in-process plans for the snapshots, the ground truth for what its service must answer),
then serves until stdin closes.  ``client`` prints one JSON line with everything the old
client saw (see :func:`run_client`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

#: A field number no revision of the contract uses (below the 2^29-1 maximum): it stands for
#: "a field added by a release newer than the receiver".
UNKNOWN_FIELD = 536_870_000
GEN_PKG = "scheduler_service.gen.slidingserve.v1"


def install_stubs(stubs: Path, source: Path) -> tuple[Any, Any]:
    """Put the old source tree first on sys.path and make its generated package resolve
    to the stubs compiled from the baseline image; returns (pb, pb_grpc)."""
    sys.path[:0] = [str(source), str(stubs)]
    pb = importlib.import_module("slidingserve.v1.scheduler_pb2")
    pb_grpc = importlib.import_module("slidingserve.v1.scheduler_pb2_grpc")
    package = importlib.import_module(GEN_PKG)
    for name, module in (("scheduler_pb2", pb), ("scheduler_pb2_grpc", pb_grpc)):
        sys.modules[f"{GEN_PKG}.{name}"] = module
        setattr(package, name, module)
    if not str(Path(package.__file__ or "").resolve()).startswith(str(source.resolve())):
        raise SystemExit(f"wire_compat_peer: {GEN_PKG} resolved to {package.__file__}, not the old tree")
    return pb, pb_grpc


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def unknown_varint(number: int = UNKNOWN_FIELD, value: int = 42) -> bytes:
    """Bytes of one varint field ``number`` (wire type 0)."""
    return varint(number << 3) + varint(value)


def with_unknown_fields(message: bytes, nested_field: int | None = None) -> bytes:
    """``message`` plus an unknown field at the top level and, when ``nested_field`` names a
    singular message field, one inside that sub-message too (an embedded message that
    appears twice is merged by every parser, so the appended copy only adds the field)."""
    extra = unknown_varint()
    if nested_field is not None:
        extra += varint((nested_field << 3) | 2) + varint(len(unknown_varint())) + unknown_varint()
    return message + extra


def _identity(b: bytes) -> bytes:
    return b


def _unknown_numbers(message: Any) -> list[int]:
    from google.protobuf import unknown_fields

    fields = unknown_fields.UnknownFieldSet(message)
    return sorted({fields[i].field_number for i in range(len(fields))})


def _load_snapshots(path: str) -> list[dict[str, Any]]:
    return list(json.loads(Path(path).read_text()))


def _reference(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The old release's own in-process plans (bootstrap predictor, like a fresh server)."""
    from scheduler_service.core import Snapshot, default_predictor, registry

    pred = default_predictor()
    return [registry.create(c["policy"], c["params"]).plan(Snapshot.from_json(c["snapshot"]), pred).to_dict()
            for c in cases]


def _origins() -> dict[str, str]:
    """Where the code that ran came from (the test checks it was the old release)."""
    import scheduler_service.server

    return {"server": str(scheduler_service.server.__file__),
            "pb": str(sys.modules[f"{GEN_PKG}.scheduler_pb2"].__file__)}


def run_server(cases: list[dict[str, Any]]) -> None:
    from scheduler_service.server import SchedulerServer, ServerConfig

    server = SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning", grace_s=1.0))
    server.start()
    try:
        print(json.dumps({"port": server.port, "reference": _reference(cases), "modules": _origins()}), flush=True)
        sys.stdin.read()  # the test closes stdin when it is done
    finally:
        server.stop(0.5)


def run_client(cases: list[dict[str, Any]], target: str, pb: Any) -> dict[str, Any]:
    """Everything an engine of the previous release does against ``target``."""
    import grpc

    from scheduler_service.core import Snapshot
    try:  # releases before the client moved below the adapter kept it in the clients package
        from scheduler_service.client import IterationReport, SchedulerClient
    except ImportError:
        from clients.client import IterationReport, SchedulerClient  # type: ignore[import-not-found,no-redef]
    try:  # the previous release kept the conversions in the server package
        from scheduler_service.server.convert import plan_from_pb, snapshot_to_pb
    except ImportError:
        from scheduler_service.wire.convert import plan_from_pb, snapshot_to_pb

    out: dict[str, Any] = {"unary": [], "stream": [], "rows": []}
    with SchedulerClient(target, timeout_s=10.0) as client, \
            SchedulerClient(target, timeout_s=10.0, encoding="rows") as rows_client:
        stream = client.stream()
        for c in cases:
            snap = Snapshot.from_json(c["snapshot"])
            out["unary"].append(client.schedule(snap, c["policy"], c["params"]).to_dict())
            out["stream"].append(stream.schedule(snap, c["policy"], c["params"]).to_dict())
            out["rows"].append(rows_client.schedule(snap, c["policy"], c["params"]).to_dict())
        stream.close()
        summary = client.report(
            [IterationReport(latency_ms=5.0 + i, c=[1, 1, 64], u=[100 + i, 200, 0], profile=None,
                             engine_id="old-engine") for i in range(4)])
        out["report"] = {"accepted": summary.accepted, "rejected": summary.rejected}
        out["policies"] = client.list_policies().names()
        out["predictor_version"] = client.get_predictor().version

        # Raw bytes: the request carries unknown fields (as if from a newer engine), and we
        # look at what a newer server put into the response that this schema does not know.
        channel = grpc.insecure_channel(target)
        raw_schedule = channel.unary_unary("/slidingserve.v1.SchedulerService/Schedule",
                                           request_serializer=_identity,
                                           response_deserializer=pb.ScheduleResponse.FromString)
        first = cases[0]
        request = pb.ScheduleRequest(request_id="raw-1", snapshot=snapshot_to_pb(Snapshot.from_json(first["snapshot"])),
                                     policy=first["policy"], params=first["params"])
        response = raw_schedule(with_unknown_fields(request.SerializeToString(), nested_field=2), timeout=10.0)
        out["raw_plan"] = plan_from_pb(response.plan).to_dict()
        out["unknown_in_response"] = _unknown_numbers(response)
        out["unknown_in_plan"] = _unknown_numbers(response.plan)

        raw_report = channel.stream_unary("/slidingserve.v1.SchedulerService/ReportIterations",
                                          request_serializer=_identity,
                                          response_deserializer=pb.ReportSummary.FromString)
        report = IterationReport(latency_ms=7.0, c=[1, 32], u=[50, 0]).to_pb()
        summary_pb = raw_report(iter([with_unknown_fields(report.SerializeToString(), nested_field=4)]),
                                timeout=10.0)
        out["raw_report"] = {"accepted": summary_pb.accepted, "rejected": summary_pb.rejected}
        channel.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stubs", type=Path, required=True)
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("role", choices=("serve", "client"))
    ap.add_argument("--snapshots", required=True, help="JSON list of {snapshot, policy, params}")
    ap.add_argument("--target", default="")
    args = ap.parse_args(argv)
    pb, _ = install_stubs(args.stubs, args.source)
    cases = _load_snapshots(args.snapshots)
    if args.role == "serve":
        run_server(cases)
    else:
        result = run_client(cases, args.target, pb)
        result["reference"] = _reference(cases)
        result["modules"] = _origins()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
