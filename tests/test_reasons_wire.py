"""The compact wire form of the reasons (plan fields 16-19, issue 24): a round trip over
real gRPC on loopback with ``reasons: every`` and ``sampled``, engines that read only
field 15 or only the compact fields, decisions unchanged by either, the compact decode
equal to ``explain``'s reasons on random snapshots, and the engine's ReasonLog over it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.core import ReasonLog
from scheduler_service.core import (
    BatchLatencyPredictor,
    Snapshot,
    ValidationError,
    default_predictor,
    registry,
)
from scheduler_service.core.plan import Reason, Reasons
from scheduler_service.core.reasons import CODES, explain, plan_explained, reason_counts
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server.config import ServerConfig
from scheduler_service.wire.convert import encode_plan, plan_from_pb, plan_to_pb, snapshot_to_pb
from tests.grpc_support import make_server, mixed_snapshot

from .strategies import predictors
from .test_reasons import POLICIES, _loaded, waiting_snapshots

COMPACT = ("reason_code_table", "reason_codes", "reason_rows", "reason_values")
BASELINE = Path(__file__).resolve().parents[1] / "proto" / "baseline" / "slidingserve-v1.0.binpb"


@pytest.fixture(scope="module")
def snap() -> Snapshot:
    return mixed_snapshot(5, n_decode=40, n_prefill=120, max_batch_tokens=512)


def _decisions(srv_kw: dict[str, object], snap: Snapshot, asks: list[bool]) -> list[pb.ScheduleResponse]:
    with make_server(**srv_kw) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.SchedulerServiceStub(channel)
        snap_pb = snapshot_to_pb(snap)
        reqs = [pb.ScheduleRequest(request_id=f"s{k}", snapshot=snap_pb, explain=ask) for k, ask in enumerate(asks)]
        return list(stub.ScheduleStream(iter(reqs), timeout=30.0))


def _without_reasons(msg: pb.Plan) -> bytes:
    """The plan's wire bytes without its reasons and measurements: the decision."""
    m = pb.Plan()
    m.CopyFrom(msg)
    for f in (*COMPACT, "reasons", "decision_us", "breakdown_us"):
        m.ClearField(f)
    return m.SerializeToString(deterministic=True)


def test_every_plan_carries_compact_reasons_over_grpc(snap: Snapshot) -> None:
    """``reasons: every``: each plan has the compact form, decoded (with the snapshot's
    ids) into the reasons ``plan_explained`` gives in process; field 15 only on the
    sampled (explain_every 3: the 3rd, 6th) and asked ones, as before."""
    want = plan_explained(registry.create("slidingserve"), snap, default_predictor())
    assert len(want.reasons) > 10
    asks = [False, False, False, True, False, False, False]
    resps = _decisions({"reasons": "every", "explain_every": 3}, snap, asks)
    assert [len(r.plan.reasons) > 0 for r in resps] == [False, False, True, True, False, True, False]
    for r in resps:
        assert tuple(r.plan.reason_code_table) == CODES and len(r.plan.reason_codes) == len(want.reasons)
        plan = plan_from_pb(r.plan, snap.ids)
        assert isinstance(plan.reasons, Reasons)
        assert list(plan.reasons) == list(want.reasons)
        assert plan.decision_key() == want.decision_key()
        assert reason_counts(plan.reasons) == reason_counts(want.reasons)
        if r.plan.reasons:  # both forms say the same
            assert plan_from_pb(r.plan).reasons == want.reasons
    assert len({_without_reasons(r.plan) for r in resps}) == 1


def test_sampled_keeps_todays_plans(snap: Snapshot) -> None:
    """``reasons: sampled`` (and ``every``) leave the decision's bytes alone: the plans
    without reasons are byte for byte the plans with them, reasons cleared."""
    asks = [False, True, False, False]
    sampled = _decisions({"explain_every": 0}, snap, asks)
    every = _decisions({"reasons": "every", "explain_every": 0}, snap, asks)
    assert [bool(r.plan.reason_code_table) for r in sampled] == asks  # only the asked one
    assert [bool(r.plan.reasons) for r in sampled] == asks
    assert all(r.plan.reason_code_table for r in every)
    assert [bool(r.plan.reasons) for r in every] == asks
    assert len({_without_reasons(r.plan) for r in (*sampled, *every)}) == 1
    unexplained = sampled[0].plan
    assert not any(len(getattr(unexplained, f)) for f in COMPACT)


def test_the_setting_is_validated() -> None:
    assert ServerConfig().reasons == "sampled"
    assert ServerConfig(reasons="every").reasons == "every"
    with pytest.raises(ValidationError, match="reasons"):
        ServerConfig(reasons="all")
    with pytest.raises(ValidationError, match="every"):
        ServerConfig.from_mapping({"reasons": "always"})


def _explained(snap: Snapshot) -> tuple[pb.Plan, object]:
    plan = plan_explained(registry.create("slidingserve"), snap, default_predictor())
    return encode_plan(plan, snap.ids), plan


def test_old_and_new_engines_read_what_they_know(snap: Snapshot) -> None:
    """A plan with only field 15 (an older service) decodes to its reasons with or
    without ids; one with only the compact fields to the same with ids and to none
    without (a caller that cannot map rows); an engine built on the v1.0 schema parses
    a plan with both and sees the same decision."""
    msg, plan = _explained(snap)
    only15 = pb.Plan()
    only15.CopyFrom(msg)
    for f in COMPACT:
        only15.ClearField(f)
    assert only15 == plan_to_pb(dataclasses.replace(plan, reasons=tuple(plan.reasons)))  # type: ignore[type-var]
    for ids in (None, snap.ids):
        back = plan_from_pb(pb.Plan.FromString(only15.SerializeToString()), ids)
        assert list(back.reasons) == list(plan.reasons)  # type: ignore[attr-defined]
    compact = pb.Plan()
    compact.CopyFrom(msg)
    compact.ClearField("reasons")
    back = plan_from_pb(pb.Plan.FromString(compact.SerializeToString()), snap.ids)
    assert isinstance(back.reasons, Reasons) and back.reasons == plan.reasons  # type: ignore[attr-defined]
    assert plan_from_pb(compact).reasons == ()
    # the v1.0 schema (no field 15, no compact fields): unknown fields are skipped
    fds = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    old = message_factory.GetMessageClass(pool.FindMessageTypeByName("slidingserve.v1.Plan"))
    parsed = old.FromString(msg.SerializeToString())
    assert list(parsed.allocation_ids) == list(msg.allocation_ids)
    assert list(parsed.allocation_tokens) == list(msg.allocation_tokens) and parsed.path == msg.path


def test_compact_fields_that_do_not_fit_are_ignored(snap: Snapshot) -> None:
    """Rows past the snapshot, lengths that differ, an index past the table: the decoder
    keeps field 15's reasons (or none) instead of failing the plan."""
    msg, plan = _explained(snap)
    n = len(msg.reason_rows)
    for spoil in (lambda m: m.reason_rows.__setitem__(0, len(snap)),
                  lambda m: m.reason_values.append(1.0),
                  lambda m: setattr(m, "reason_codes", bytes([len(CODES)]) + m.reason_codes[1:])):
        bad = pb.Plan()
        bad.CopyFrom(msg)
        spoil(bad)
        assert len(bad.reason_rows) == n
        assert list(plan_from_pb(bad, snap.ids).reasons) == list(plan.reasons)  # type: ignore[attr-defined]
        bad.ClearField("reasons")
        assert plan_from_pb(bad, snap.ids).reasons == ()


def test_a_newer_table_is_read_as_sent(snap: Snapshot) -> None:
    """Codes this build does not know (a newer service): kept by name, counted, re-encoded."""
    msg, _ = _explained(snap)
    msg.ClearField("reasons")
    table = list(msg.reason_code_table)
    table[msg.reason_codes[0]] = "brand_new"
    del msg.reason_code_table[:]
    msg.reason_code_table.extend(table)
    back = plan_from_pb(msg, snap.ids)
    assert back.reasons[0].code == "brand_new" and "brand_new" in reason_counts(back.reasons)
    again = plan_from_pb(encode_plan(back, snap.ids), snap.ids)
    assert list(again.reasons) == list(back.reasons)
    assert plan_from_pb(encode_plan(back, snap.ids)).reasons == back.reasons


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.sampled_from([*POLICIES, "slidingserve", "slidingserve"]), waiting_snapshots(),
       st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)), st.booleans())
def test_the_compact_decode_is_explains_reasons(name: str, snap: Snapshot, pred: BatchLatencyPredictor,
                                                full: bool) -> None:
    """On random snapshots (classes, partial prefills, KV pressure, random predictors):
    encode, serialise, parse, decode with the snapshot's ids = ``explain``'s reasons."""
    policy = registry.create(name)
    told = explain(policy, snap, pred, policy.plan(snap, pred))
    msg = pb.Plan.FromString(encode_plan(told, snap.ids, full=full).SerializeToString())
    back = plan_from_pb(msg, snap.ids)
    assert list(back.reasons) == list(told.reasons)
    assert reason_counts(back.reasons) == reason_counts(told.reasons)
    assert back.decision_key() == told.decision_key()
    assert bool(msg.reasons) == (full and bool(told.reasons))
    assert bool(msg.reason_code_table) == isinstance(told.reasons, Reasons)


def test_the_reason_log_reads_compact_plans(caplog: pytest.LogCaptureFixture) -> None:
    """Every plan carrying compact reasons: the counts follow the latest plan (one
    ``bincount``, no Reason objects unless DEBUG), the debug log one line per change."""
    pred, policy = default_predictor(), registry.create("slidingserve")
    snaps = [_loaded(seed) for seed in range(6)]
    log = ReasonLog()
    for s in snaps:
        plan = plan_from_pb(encode_plan(plan_explained(policy, s, pred), s.ids, full=False), s.ids)
        assert ReasonLog.carries(plan)
        log.observe(s, plan)
        assert log.counts == reason_counts(plan_explained(policy, s, pred).reasons)
        assert plan.reasons._items is None  # type: ignore[attr-defined]  # no objects built
    assert log.explained == len(snaps)
    every3 = ReasonLog(count_every=3)
    s = snaps[0]
    plan = plan_from_pb(encode_plan(plan_explained(policy, s, pred), s.ids), s.ids)
    for k in range(1, 4):
        every3.observe(s, plan)
        assert bool(every3.counts) == (k == 3)
    with caplog.at_level(logging.DEBUG, logger="engine_adapter.reasons"):
        dbg = ReasonLog(count_every=100)
        dbg.observe(s, plan)
        assert dbg.counts == reason_counts(plan.reasons)  # DEBUG on: every plan read
    lines = [r.getMessage() for r in caplog.records if r.name == "engine_adapter.reasons"]
    assert len(lines) == len(plan.reasons) and all(" waits: " in x for x in lines)
    assert isinstance(plan.reasons[0], Reason)


# ------------------------------------------------------------- engines: client and plan check
def test_the_client_hands_the_engine_compact_reasons(snap: Snapshot) -> None:
    """``SchedulerClient`` decodes the compact form with the snapshot it sent (unary and
    stream), so a remote engine under ``reasons: every`` has a reason in every plan, checked
    on arrays by ``plan_violations``."""
    from scheduler_service.client import SchedulerClient
    from scheduler_service.core import plan_violations

    want = plan_explained(registry.create("slidingserve"), snap, default_predictor())
    with make_server(reasons="every", explain_every=0) as srv, \
            SchedulerClient(srv.target, timeout_s=10) as c, c.stream() as s:
        for plan in (c.schedule(snap, policy="slidingserve"), s.schedule(snap, policy="slidingserve")):
            assert isinstance(plan.reasons, Reasons) and list(plan.reasons) == list(want.reasons)
            assert plan_violations(snap, plan) == []
        # a snapshot given as JSON: no rows to read, so the reasons are field 15's (none here)
        assert c.schedule(snap.to_dict(), policy="slidingserve").reasons == ()


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(st.sampled_from([*POLICIES, "slidingserve"]), waiting_snapshots(), st.data())
def test_the_array_check_of_reasons_agrees_with_the_per_reason_one(name: str, snap: Snapshot,
                                                                    data: st.DataObject) -> None:
    """Reasons as arrays are checked without objects (``_reason_arrays_hold``): on the
    reasons ``explain`` gives they hold, and each way of breaking them (a waiting request
    without a reason, two reasons for one, a reason for a fully served request, an unknown
    code) fails the array check and is named by the per-reason one."""
    from scheduler_service.core import plan_violations
    from scheduler_service.core.check import _reason_arrays_hold

    if not len(snap):
        return  # no request, no reasons (nothing for either check)
    policy = registry.create(name)
    plan = explain(policy, snap, default_predictor(), policy.plan(snap, default_predictor()))
    assert isinstance(plan.reasons, Reasons)
    assert _reason_arrays_hold(snap, plan) and plan_violations(snap, plan) == []
    rows, codes, values = plan.reasons.arrays()
    served = sorted(set(range(len(snap))) - set(rows.tolist()))
    breaks = []
    if len(rows) > 1:  # (a plan left with no reason at all is an unexplained plan: not checked)
        breaks.append((rows[1:], codes[1:], values[1:], "waits without a reason"))
    if len(rows):
        breaks.append((np.r_[rows, rows[:1]], np.r_[codes, codes[:1]], np.r_[values, values[:1]], "two reasons"))
    if served:
        i = data.draw(st.sampled_from(served))
        breaks.append((np.r_[rows, i], np.r_[codes, 0], np.r_[values, 0.0], "fully serves"))
    for r, c, v, what in breaks:
        bad = dataclasses.replace(plan, reasons=Reasons(snap.ids, r, c, v))
        assert not _reason_arrays_hold(snap, bad), what
        assert any(what in p for p in plan_violations(snap, bad, limit=1000)), (what, plan_violations(snap, bad))
    if len(rows):
        unknown = dataclasses.replace(plan, reasons=Reasons(snap.ids, rows, codes, values,
                                                            names=(*CODES[:-1], "not_a_code")))
        assert codes.max() < len(CODES) - 1 or not _reason_arrays_hold(snap, unknown)
