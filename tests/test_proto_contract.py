"""The wire contract: generated code is fresh, field numbers are stable, and the edge
conversion round-trips core types exactly."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from scheduler_service.core import Allocation, Plan, ValidationError, batch_features
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import (
    plan_from_pb,
    plan_to_pb,
    report_from_pb,
    snapshot_from_pb,
    snapshot_to_pb,
)
from scheduler_service.wire.profile import EngineProfile
from tests.grpc_support import mixed_snapshot

ROOT = Path(__file__).resolve().parent.parent


def _genproto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("genproto", ROOT / "tools" / "genproto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_is_fresh() -> None:
    assert _genproto().check() == 0


def test_check_names_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    gp = _genproto()
    copy = tmp_path / "gen"
    shutil.copytree(gp.GEN, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "slidingserve" / "v1" / "scheduler_pb2.py").write_text("# edited by hand\n")
    monkeypatch.setattr(gp, "GEN", copy)
    assert gp.check() == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "slidingserve/v1/scheduler_pb2.py" in err


#: Field numbers are part of the contract: changing one breaks every deployed engine.
PINNED = {
    "EngineProfile": {"model": 1, "hardware": 2, "tensor_parallel": 3},
    "RequestColumns": {"ids": 1, "arrival": 2, "prompt_tokens": 3, "computed_tokens": 4, "output_tokens": 5,
                       "ttft_slo": 6, "tbt_slo": 7, "protected": 8},
    "Request": {"id": 1, "arrival": 2, "prompt_tokens": 3, "computed_tokens": 4, "output_tokens": 5,
                "ttft_slo": 6, "tbt_slo": 7, "protected": 8},
    "Snapshot": {"now": 1, "max_batch_tokens": 2, "max_num_seqs": 3, "free_kv_tokens": 4,
                 "prefill_throughput": 5, "engine_profile": 6, "engine_id": 7, "columns": 8, "rows": 9},
    "ScheduleRequest": {"request_id": 1, "snapshot": 2, "policy": 3, "params": 4},
    "Plan": {"policy": 1, "policy_version": 2, "predictor_version": 3, "path": 4, "token_budget": 5,
             "predicted_latency_ms": 6, "allocation_ids": 7, "allocation_tokens": 8, "decision_us": 9,
             "breakdown_us": 10},
    "ScheduleResponse": {"request_id": 1, "plan": 2, "server_us": 3, "error": 4},
    "IterationReport": {"engine_profile": 1, "engine_id": 2, "latency_ms": 3, "composition": 4,
                        "features": 5, "request_id": 6},
    "ReportSummary": {"accepted": 1, "rejected": 2, "predictor_version": 3, "rejection_reasons": 4},
    "GetPredictorResponse": {"predictor_json": 1, "version": 2, "sample_counts": 3, "profile_key": 4,
                             "reports_accepted": 5, "buffered_samples": 6, "refits": 7, "published": 8},
}


@pytest.mark.parametrize("message", sorted(PINNED))
def test_field_numbers_are_stable(message: str) -> None:
    desc = pb.DESCRIPTOR.message_types_by_name[message]
    got = {f.name: f.number for f in desc.fields}
    assert {k: got.get(k) for k in PINNED[message]} == PINNED[message]


def test_service_methods() -> None:
    svc = pb.DESCRIPTOR.services_by_name["SchedulerService"]
    kinds = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert kinds == {"Schedule": (False, False), "ScheduleStream": (True, True),
                     "ReportIterations": (True, False), "ListPolicies": (False, False),
                     "GetPredictor": (False, False), "WhatIf": (False, False)}
    assert pb.DESCRIPTOR.package == "slidingserve.v1"


@pytest.mark.parametrize("encoding", ["columns", "rows"])
def test_snapshot_round_trip(encoding: str) -> None:
    prof = EngineProfile("m", "h", 4)
    snap = mixed_snapshot(11, profile=prof.key)
    msg = pb.Snapshot.FromString(snapshot_to_pb(snap, encoding=encoding).SerializeToString())
    assert msg.WhichOneof("requests") == encoding
    back, p = snapshot_from_pb(msg, max_requests=1000)
    assert p == prof and back.to_dict() == snap.to_dict()


def test_plan_round_trip() -> None:
    plan = Plan("slidingserve", "1.0.0", "p-x", "sliding_chunker", 7, 12.5,
                (Allocation("a", 1), Allocation("b", 6)), 120, {"sorter": 10, "chunker": 40})
    assert plan_from_pb(pb.Plan.FromString(plan_to_pb(plan).SerializeToString())) == plan


def test_profile_key_round_trip_and_validation() -> None:
    p = EngineProfile("meta-llama/Llama-3-8B", "a100", 2)
    assert EngineProfile.from_key(p.key) == p
    assert EngineProfile.parse("") == EngineProfile() and EngineProfile.parse("free text").model == "free text"
    msg = pb.Snapshot(engine_profile=pb.EngineProfile(model="a|b"))
    with pytest.raises(ValidationError) as exc:
        snapshot_from_pb(msg, max_requests=10)
    assert exc.value.violations[0].field == "snapshot.engine_profile"


def test_report_features_scenarios() -> None:
    x, s = batch_features(np.array([1, 1, 50]), np.array([3, 4, 0]))
    for wire, want in ((pb.SCENARIO_UNSPECIFIED, s), (pb.SCENARIO_DECODE, 0), (pb.SCENARIO_MIXED, 2)):
        msg = pb.IterationReport(latency_ms=5.0, features=pb.BatchFeatures(x=x.tolist(), scenario=wire))
        _, x2, s2, lat = report_from_pb(msg, max_requests=10)
        assert s2 == want and lat == 5.0 and np.array_equal(x2, x)
    msg = pb.IterationReport(latency_ms=5.0, composition=pb.BatchComposition(c=[1, 1, 50], u=[3, 4, 0]))
    _, x3, s3, _ = report_from_pb(msg, max_requests=10)
    assert np.array_equal(x3, x) and s3 == s
    with pytest.raises(ValidationError):
        report_from_pb(pb.IterationReport(latency_ms=5.0), max_requests=10)


def test_generated_package_is_importable_without_sys_path_tricks() -> None:
    assert "slidingserve" not in sys.modules  # no top-level alias package was needed


def test_fast_column_encoding_equals_protobuf_encoding() -> None:
    snap = mixed_snapshot(4)
    fast = snapshot_to_pb(snap).columns
    ref = pb.RequestColumns(ids=list(snap.ids))
    for name in ("arrival", "prompt_tokens", "computed_tokens", "output_tokens", "ttft_slo", "tbt_slo", "protected"):
        getattr(ref, name).extend(getattr(snap, name).tolist())
    assert fast == ref and fast.SerializeToString() == ref.SerializeToString()
    empty = snapshot_to_pb(mixed_snapshot(0, 0, 0)).columns
    assert empty == pb.RequestColumns()
