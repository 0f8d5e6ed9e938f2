"""Request classes (priority, sheddable) end to end: the snapshot, JSON, protobuf both
encodings, real gRPC, the simulator's workloads, and the ``vllm-priority`` baseline."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.workloads import CLASS_MIXES, ClassMix, SLOClass, make_workload
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import Snapshot, ValidationError, default_predictor, registry
from scheduler_service.core.snapshot import MAX_PRIORITY, Request
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.server import SchedulerServer
from scheduler_service.wire.convert import snapshot_from_pb, snapshot_to_pb
from tests.factories import random_snapshot
from tests.grpc_support import make_server


def classed(seed: int, n: int = 12) -> Snapshot:
    """A random snapshot with random classes on top."""
    base = random_snapshot(seed, n=n, max_prompt=300)
    rng = np.random.default_rng(seed + 991)
    d = base.to_dict()
    for r in d["requests"]:
        r["priority"] = int(rng.integers(-2, 3))
        r["sheddable"] = bool(rng.random() < 0.4)
    return Snapshot.from_json(d)


# ------------------------------------------------------------------ snapshot
def test_default_class_is_priority_zero_not_sheddable() -> None:
    s = Snapshot.from_requests([Request("a", 0.0, 10), Request("b", 0.0, 5)], now=1.0)
    assert s.priority.tolist() == [0, 0] and s.sheddable.tolist() == [False, False]
    assert not s.priority.flags.writeable
    # the v1 JSON form is unchanged when every request is of the default class
    assert all("priority" not in r and "sheddable" not in r for r in s.to_dict()["requests"])


@pytest.mark.parametrize("seed", range(5))
def test_json_round_trip_keeps_classes(seed: int) -> None:
    s = classed(seed)
    t = Snapshot.from_json(s.to_json())
    assert t.priority.tolist() == s.priority.tolist()
    assert t.sheddable.tolist() == s.sheddable.tolist()


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("priority", 1 << 40, "requests[0].priority"),
    ("priority", 1.5, "requests[0].priority"),
    ("priority", True, "requests[0].priority"),
    ("sheddable", "yes", "requests[0].sheddable"),
])
def test_bad_class_values_name_the_field(field: str, value: object, expect: str) -> None:
    d = Snapshot.from_requests([Request("a", 0.0, 10)], now=1.0).to_dict()
    d["requests"][0][field] = value
    with pytest.raises(ValidationError) as e:
        Snapshot.from_json(d)
    assert expect in [v.field for v in e.value.violations]


def test_class_column_of_wrong_length_is_rejected() -> None:
    with pytest.raises(ValidationError) as e:
        Snapshot.from_columns(now=1.0, max_batch_tokens=64, max_num_seqs=4, ids=["a", "b"], arrival=[0.0, 0.0],
                              prompt_tokens=[4, 4], computed_tokens=[0, 0], output_tokens=[0, 0],
                              ttft_slo=[1.0, 1.0], tbt_slo=[0.1, 0.1], protected=[False, False], priority=[1])
    assert [v.field for v in e.value.violations] == ["priority"]


# ---------------------------------------------------------------------- wire
@pytest.mark.parametrize("encoding", ["columns", "rows"])
@pytest.mark.parametrize("seed", range(4))
def test_protobuf_round_trip_keeps_classes(encoding: str, seed: int) -> None:
    s = classed(seed)
    t, _ = snapshot_from_pb(snapshot_to_pb(s, encoding=encoding), max_requests=100)
    assert t.priority.tolist() == s.priority.tolist()
    assert t.sheddable.tolist() == s.sheddable.tolist()


def test_a_v1_message_is_unchanged_and_decodes_to_the_default_class() -> None:
    s = random_snapshot(3, n=10, max_prompt=300)
    msg = snapshot_to_pb(s)
    assert len(msg.columns.priority) == 0 and len(msg.columns.sheddable) == 0
    t, _ = snapshot_from_pb(pb.Snapshot.FromString(msg.SerializeToString()), max_requests=100)
    assert not t.priority.any() and not t.sheddable.any()


def test_class_column_of_wrong_length_on_the_wire_names_the_field() -> None:
    msg = snapshot_to_pb(random_snapshot(1, n=5, max_prompt=100))
    msg.columns.priority.extend([1, 2])
    with pytest.raises(ValidationError) as e:
        snapshot_from_pb(msg, max_requests=100)
    assert [v.field for v in e.value.violations] == ["snapshot.columns.priority"]


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with make_server() as srv:
        yield srv


def test_priority_travels_over_grpc(server: SchedulerServer) -> None:
    reqs = [Request("late-low", 0.0, 1500, priority=5), Request("early-high", 1.0, 1500, priority=-1),
            Request("mid", 0.5, 1500)]
    s = Snapshot.from_requests(reqs, now=2.0, max_batch_tokens=2048)
    with SchedulerClient(server.target, timeout_s=10.0) as c:
        plan = c.schedule(s, policy="vllm-priority")
        assert [a.id for a in plan.allocations] == ["early-high", "mid"]
        assert plan.tokens_by_id() == registry.create("vllm-priority").plan(s, default_predictor()).tokens_by_id()
        msg = snapshot_to_pb(s)
        msg.columns.priority[0] = MAX_PRIORITY + 1
        with pytest.raises(SchedulerError) as e:
            c.schedule(msg, policy="vllm-priority")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.fields == ["snapshot.columns.priority[0]"]
        assert c.schedule(s, policy="vllm-priority").allocations  # still serving


# ------------------------------------------------------------- vllm-priority
@settings(max_examples=120, deadline=None)
@given(st.integers(0, 10_000))
def test_vllm_priority_serves_each_group_in_priority_order(seed: int) -> None:
    """Within the running and the waiting group, a request gets tokens only when every
    request before it in (priority, arrival) order got all it needs."""
    s = classed(seed)
    plan = registry.create("vllm-priority").plan(s, default_predictor())
    got = plan.tokens_by_id()
    for group in (s.computed_tokens > 0, s.computed_tokens == 0):
        idx = np.flatnonzero(group)
        order = idx[np.lexsort((s.arrival[idx], s.priority[idx]))]
        need = [1 if s.is_decoding[i] else int(s.remaining_prefill[i]) for i in order]
        served = [got.get(s.ids[i], 0) for i in order]
        for k in range(1, len(order)):
            if served[k] > 0:
                assert all(served[j] == need[j] for j in range(k)), (seed, served, need)


@pytest.mark.parametrize("seed", range(30))
def test_vllm_priority_without_classes_is_vllm_fcfs(seed: int) -> None:
    s = random_snapshot(seed, n=12, max_prompt=300)
    pred = default_predictor()
    a = registry.create("vllm-priority").plan(s, pred)
    b = registry.create("vllm-fcfs").plan(s, pred)
    assert a.tokens_by_id() == b.tokens_by_id()


# ----------------------------------------------------------------- workloads
def test_class_mix_keeps_arrivals_and_scales_slos() -> None:
    plain = make_workload("mixed-v1", 2000, 2.0, seed=4)
    w = make_workload("mixed-v1", 2000, 2.0, seed=4, classes="interactive-batch")
    assert np.array_equal(plain.arrival, w.arrival) and np.array_equal(plain.prompt_tokens, w.prompt_tokens)
    mix = CLASS_MIXES["interactive-batch"]
    for c in mix.classes:
        sel = w.priority == c.priority
        assert abs(sel.mean() - c.fraction) < 0.04
        assert np.allclose(w.ttft_slo[sel], plain.ttft_slo[sel] * c.ttft_scale)
        assert np.allclose(w.tbt_slo[sel], plain.tbt_slo[sel] * c.tbt_scale)
        assert (w.sheddable[sel] == c.sheddable).all()


def test_bad_class_mixes_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown class mix"):
        make_workload("sharegpt", 10, 1.0, seed=0, classes="nope")
    with pytest.raises(ValueError):
        ClassMix(())
    with pytest.raises(ValueError):
        SLOClass("x", 0.5, ttft_scale=0.0)


def test_simulator_hands_classes_to_the_policy() -> None:
    """The simulated engine's snapshots carry the workload's classes: vllm-priority
    then serves the smaller priority first under load."""
    from clients.bench.runner import profile_predictor
    from engine_adapter.core import AdapterCore, AdapterSettings
    from engine_adapter.inprocess import InProcessBackend
    from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth

    w = make_workload("mixed-v1", 300, 6.0, seed=2, classes="interactive-batch")
    seen: list[np.ndarray] = []

    class Spy(InProcessBackend):
        def schedule(self, snapshot: Snapshot, timeout_s: float):  # type: ignore[no-untyped-def]
            seen.append(snapshot.priority.copy())
            return super().schedule(snapshot, timeout_s)

    prof = PROFILES[DEFAULT_PROFILE]
    pred = profile_predictor(DEFAULT_PROFILE)
    s = AdapterSettings(policy="vllm-priority", profile=prof.key, report_inline=True)
    eng = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), prof, AdapterCore(Spy(s, pred), s, pred),
                          EngineConfig(noise_seed=2))
    r = eng.run()
    assert any(len(set(p.tolist())) > 1 for p in seen)
    ttft = eng.first_token - w.arrival
    assert np.median(ttft[w.priority == 0]) < np.median(ttft[w.priority == 2])
    assert r.completed == len(w)
