"""The service explains one decision in ``explain_every`` over real loopback gRPC: the
explained plan's reasons go back to the engine and set
``slidingserve_requests_waiting_by_reason``; ``explain_every=0`` explains none."""

from __future__ import annotations

import json

import pytest

from benchmarks.snapshots import busy_snapshot
from scheduler_service.client import SchedulerClient
from scheduler_service.core import Snapshot, default_predictor, registry
from scheduler_service.core.reasons import CODES, plan_explained, reason_counts
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.server import ServerConfig
from scheduler_service.server.servicer import encode_plan
from scheduler_service.wire.convert import plan_from_pb, plan_to_pb
from tests.grpc_support import make_server, mixed_snapshot

GAUGE = "slidingserve_requests_waiting_by_reason"


def _gauge(srv: object, deployment: str = "") -> dict[str, float]:
    out = {}
    for fam in srv.metrics.registry.collect():  # type: ignore[attr-defined]
        if fam.name == GAUGE:
            for s in fam.samples:
                if s.labels["deployment"] == deployment:
                    out[s.labels["reason"]] = s.value
    return out


def test_every_explained_plan_sets_the_gauge_and_carries_its_reasons() -> None:
    busy = busy_snapshot(n_decode=64, n_queued=96, seed=1)
    light = mixed_snapshot(2, n_decode=8, n_prefill=6)
    with make_server(explain_every=1) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        for policy in ("slidingserve", "sarathi"):
            want = plan_explained(registry.create(policy), busy, default_predictor())
            assert want.reasons, "the busy snapshot leaves requests waiting"
            for _ in range(2):
                got = client.schedule(busy, policy=policy)
                assert got.decision_key() == want.decision_key()
                assert list(got.reasons) == list(want.reasons)
            counts = reason_counts(want.reasons)
            gauge = _gauge(srv)
            assert {c: n for c, n in gauge.items() if n} == counts
            assert set(gauge) <= set(CODES)
        with client.stream() as stream:  # the streaming path too; codes now gone are set to 0
            got = stream.schedule(light, policy="vllm-fcfs")
        want = plan_explained(registry.create("vllm-fcfs"), light, default_predictor())
        assert list(got.reasons) == list(want.reasons)
        assert {c: n for c, n in _gauge(srv).items() if n} == reason_counts(want.reasons)


def test_one_in_n_and_never() -> None:
    busy = busy_snapshot(n_decode=64, n_queued=96, seed=1)
    with make_server(explain_every=3) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        carried = [bool(client.schedule(busy).reasons) for _ in range(6)]
        assert carried == [False, False, True, False, False, True]
    with make_server(explain_every=0) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        for _ in range(4):
            assert not client.schedule(busy).reasons
        assert _gauge(srv) == {}


def test_reasons_are_additive_on_the_wire() -> None:
    """An explained response decodes to the same decision as an unexplained one."""
    busy = busy_snapshot(n_decode=64, n_queued=96, seed=1)
    policy = registry.create("slidingserve")
    plain = plan_to_pb(policy.plan(busy, default_predictor()))
    explained = plan_to_pb(plan_explained(policy, busy, default_predictor()))
    assert len(explained.reasons) > 0
    assert len(plain.reasons) == 0
    assert (explained.path, explained.token_budget) == (plain.path, plain.token_budget)
    assert explained.allocation_ids == plain.allocation_ids
    assert explained.allocation_tokens == plain.allocation_tokens


def test_the_knob_is_validated() -> None:
    assert ServerConfig().explain_every == 16
    with pytest.raises(Exception, match="explain_every"):
        ServerConfig(explain_every=-1)


@pytest.mark.parametrize("policy", ["slidingserve", "sarathi", "qoserve"])
def test_the_fast_reason_encoding_is_the_wire_format(policy: str) -> None:
    snap = busy_snapshot(n_decode=64, n_queued=96, seed=2)
    plan = plan_explained(registry.create(policy), snap, default_predictor())
    assert len(plan.reasons) > 0
    got = encode_plan(plan, snap.ids)
    assert got == plan_to_pb(plan)
    assert plan_from_pb(pb.Plan.FromString(got.SerializeToString())).reasons == plan.reasons
    data = json.loads(snap.to_json())  # ids over 127 bytes: multi-byte lengths
    for k, r in enumerate(data["requests"]):
        r["id"] = f"request-{'x' * 200}-{k}"
    long = Snapshot.from_json(data)
    plan = plan_explained(registry.create(policy), long, default_predictor())
    assert encode_plan(plan, long.ids) == plan_to_pb(plan)


def test_a_plan_that_cannot_be_explained_still_goes_back() -> None:
    """A policy whose plan names a request the snapshot does not have (the engine's plan
    check refuses it) is answered, unexplained: an explanation never fails a decision."""
    from scheduler_service.core import Allocation
    from tests.grpc_support import UnknownId, inject

    snap = mixed_snapshot(3, n_decode=4, n_prefill=4)
    with make_server(explain_every=1) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        inject(srv, UnknownId())  # type: ignore[arg-type]
        got = client.schedule(snap, policy="unknown-id")
        assert got.allocations == (Allocation("not-a-request", 1),) and not got.reasons
        assert client.schedule(snap, policy="slidingserve").reasons  # the next one is explained
