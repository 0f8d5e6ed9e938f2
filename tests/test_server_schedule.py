"""Schedule / ScheduleStream over real loopback gRPC: same plans as in-process, precise
INVALID_ARGUMENT errors, and a server that keeps serving after bad input."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import default_predictor, registry
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server import SERVICE_NAME, SchedulerServer
from scheduler_service.wire.convert import snapshot_to_pb
from tests.grpc_support import InjectedPolicy, inject, make_server, mixed_snapshot

MAX_REQUESTS = 200


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with make_server(max_requests_per_snapshot=MAX_REQUESTS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: SchedulerServer) -> Iterator[SchedulerClient]:
    with SchedulerClient(server.target, timeout_s=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: SchedulerServer) -> Iterator[pb_grpc.SchedulerServiceStub]:
    with grpc.insecure_channel(server.target) as ch:
        yield pb_grpc.SchedulerServiceStub(ch)


CASES = [
    ("slidingserve", None),
    ("slidingserve", {"window": 1}),
    ("vllm-fcfs", None),
    ("sarathi", None),
    ("sarathi-edf", None),
    ("qoserve", None),
    ("sarathi-edf+sc+mlps", None),
]


@pytest.mark.parametrize(("policy", "params"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_unary_and_stream_equal_in_process(client: SchedulerClient, policy: str, params: dict | None,
                                           seed: int) -> None:
    snap = mixed_snapshot(seed)
    want = registry.create(policy, params).plan(snap, default_predictor())
    got = client.schedule(snap, policy=policy, params=params)
    assert got.decision_key() == want.decision_key()
    with client.stream() as stream:
        for _ in range(2):
            assert stream.schedule(snap, policy=policy, params=params).decision_key() == want.decision_key()


@pytest.mark.parametrize("encoding", ["columns", "rows"])
def test_both_encodings_give_the_same_plan(server: SchedulerServer, encoding: str) -> None:
    snap = mixed_snapshot(3)
    want = registry.create("slidingserve").plan(snap, default_predictor())
    with SchedulerClient(server.target, timeout_s=10.0, encoding=encoding) as c:
        assert c.schedule(snap).decision_key() == want.decision_key()


def test_default_policy_and_empty_snapshot(stub: pb_grpc.SchedulerServiceStub) -> None:
    req = pb.ScheduleRequest(request_id="e1", snapshot=pb.Snapshot(now=1.0, max_batch_tokens=16, max_num_seqs=4))
    resp = stub.Schedule(req, timeout=10)
    assert resp.request_id == "e1"
    assert resp.plan.policy == "slidingserve"
    assert list(resp.plan.allocation_ids) == []
    assert resp.server_us >= 0


def _bad_requests() -> list[tuple[str, pb.ScheduleRequest, str]]:
    base = snapshot_to_pb(mixed_snapshot(0, 4, 4))

    def req(mutate: object = None, **kw: object) -> pb.ScheduleRequest:
        r = pb.ScheduleRequest(snapshot=pb.Snapshot(), **kw)  # type: ignore[arg-type]
        r.snapshot.CopyFrom(base)
        if callable(mutate):
            mutate(r.snapshot)
        return r

    def nan(s: pb.Snapshot) -> None:
        s.columns.arrival[2] = float("nan")

    def dup(s: pb.Snapshot) -> None:
        s.columns.ids[3] = s.columns.ids[1]

    def over(s: pb.Snapshot) -> None:
        s.columns.computed_tokens[5] = s.columns.prompt_tokens[5] + 1

    def short(s: pb.Snapshot) -> None:
        del s.columns.ttft_slo[-1]

    def too_many(s: pb.Snapshot) -> None:
        n = MAX_REQUESTS + 1
        s.columns.Clear()
        s.columns.ids.extend(f"x{i}" for i in range(n))
        s.columns.arrival.extend([0.0] * n)
        s.columns.prompt_tokens.extend([10] * n)
        s.columns.computed_tokens.extend([0] * n)
        s.columns.output_tokens.extend([0] * n)
        s.columns.ttft_slo.extend([1.0] * n)
        s.columns.tbt_slo.extend([0.1] * n)
        s.columns.protected.extend([False] * n)

    def bad_limit(s: pb.Snapshot) -> None:
        s.max_batch_tokens = 0

    def rows_nan(s: pb.Snapshot) -> None:
        s.rows.requests.add(id="a", arrival=float("inf"), prompt_tokens=5, ttft_slo=1.0, tbt_slo=0.1)

    return [
        ("nan", req(nan), "snapshot.columns.arrival[2]"),
        ("duplicate", req(dup), "snapshot.columns.ids[3]"),
        ("computed>prompt", req(over), "snapshot.columns.computed_tokens[5]"),
        ("mismatched", req(short), "snapshot.columns.ttft_slo"),
        ("too-many", req(too_many), "snapshot.columns"),
        ("limit", req(bad_limit), "snapshot.max_batch_tokens"),
        ("rows", req(rows_nan), "snapshot.rows.requests[0].arrival"),
        ("unknown-policy", req(policy="nope"), "policy"),
        ("bad-param", req(policy="slidingserve", params={"window": "9"}), "params.window"),
        ("unknown-param", req(policy="slidingserve", params={"colour": "red"}), "params.colour"),
        ("param-type", req(policy="slidingserve", params={"window": "two"}), "params.window"),
    ]


BAD = _bad_requests()


@pytest.mark.parametrize(("name", "request_", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_invalid_argument_with_field(client: SchedulerClient, stub: pb_grpc.SchedulerServiceStub,
                                                    name: str, request_: pb.ScheduleRequest, field: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        stub.Schedule(request_, timeout=10)
    err = SchedulerError.from_rpc_error(exc.value)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.fields, err.violations
    assert "Traceback" not in err.message
    # ... and the server keeps serving.
    assert client.schedule(mixed_snapshot(0, 4, 4)).policy == "slidingserve"


def test_stream_survives_bad_requests(stub: pb_grpc.SchedulerServiceStub) -> None:
    good = pb.ScheduleRequest(request_id="ok", snapshot=snapshot_to_pb(mixed_snapshot(0, 4, 4)))
    reqs = [good, *(b[1] for b in BAD), good]
    for i, r in enumerate(reqs):
        r.request_id = f"q{i}"
    resps = list(stub.ScheduleStream(iter(reqs), timeout=10))
    assert [r.request_id for r in resps] == [r.request_id for r in reqs]
    assert resps[0].HasField("plan") and resps[-1].HasField("plan")
    for (_, _, field), r in zip(BAD, resps[1:-1], strict=True):
        assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert field in [v.field for v in r.error.field_violations]


def test_client_stream_raises_and_continues(client: SchedulerClient) -> None:
    with client.stream() as s:
        with pytest.raises(SchedulerError) as exc:
            s.schedule(mixed_snapshot(0, 4, 4), policy="nope")
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and exc.value.fields == ["policy"]
        assert s.schedule(mixed_snapshot(0, 4, 4)).policy == "slidingserve"


def test_internal_error_hides_traceback(server: SchedulerServer, client: SchedulerClient) -> None:
    inject(server, InjectedPolicy(name="boom", fail=True))
    with pytest.raises(SchedulerError) as exc:
        client.schedule(mixed_snapshot(0, 4, 4), policy="boom")
    assert exc.value.code == grpc.StatusCode.INTERNAL
    assert "secret" not in exc.value.message and "ref " in exc.value.message
    with client.stream() as s, pytest.raises(SchedulerError) as exc2:
        s.schedule(mixed_snapshot(0, 4, 4), policy="boom")
    assert exc2.value.code == grpc.StatusCode.INTERNAL
    assert client.schedule(mixed_snapshot(0, 4, 4)).policy == "slidingserve"


def test_stream_deadline_then_stream_reopens(server: SchedulerServer, client: SchedulerClient) -> None:
    inject(server, InjectedPolicy(name="slow", delay_s=0.3))
    snap = mixed_snapshot(0, 4, 4)
    with client.stream() as s:
        with pytest.raises(SchedulerError) as exc:
            s.schedule(snap, policy="slow", timeout_s=0.05)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        plan = s.schedule(snap, timeout_s=5)  # the stream was cancelled and reopens
        assert plan.policy == "slidingserve"
    with pytest.raises(SchedulerError) as exc:
        client.schedule(snap, policy="slow", timeout_s=0.05)
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_serving(server: SchedulerServer) -> None:
    with grpc.insecure_channel(server.target) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_service(server: SchedulerServer) -> None:
    with grpc.insecure_channel(server.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
        names = [s.name for s in resp.list_services_response.service]
        assert "slidingserve.v1.SchedulerService" in names
        assert "grpc.health.v1.Health" in names


def test_list_policies(client: SchedulerClient) -> None:
    info = client.list_policies()
    assert info.default_policy == "slidingserve"
    assert info.names() == registry.names()
    ss = next(p for p in info.policies if p.name == "slidingserve")
    window = next(q for q in ss.params if q.name == "window")
    assert (window.type, window.default, window.min, window.max) == ("int", "2", 1.0, 4.0)
    d = info.to_dict()
    assert d["default"] == "slidingserve" and len(d["policies"]) == len(info.policies)


def test_schedule_accepts_json_snapshot(client: SchedulerClient) -> None:
    snap = mixed_snapshot(5, 3, 3)
    got = client.schedule(snap.to_dict())
    assert got.decision_key() == registry.create("slidingserve").plan(snap, default_predictor()).decision_key()
    assert np.all(np.array([a.tokens for a in got.allocations]) >= 1)
