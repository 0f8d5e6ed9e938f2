"""Snapshot validation (precise field violations), JSON form and derived columns."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

from scheduler_service.core import FieldViolation, Request, Snapshot, ValidationError
from tests.factories import decoding, make_snapshot, prefilling, waiting
from tests.strategies import snapshots

SPEC_EXAMPLE = """{
  "now": 12.345,
  "max_batch_tokens": 2048,
  "max_num_seqs": 256,
  "free_kv_tokens": 120000,
  "prefill_throughput": 5000.0,
  "requests": [
    {"id": "r1", "arrival": 12.0, "prompt_tokens": 1000, "computed_tokens": 500,
     "output_tokens": 0, "ttft_slo": 0.5, "tbt_slo": 0.05, "protected": false}
  ]
}"""


def base_doc(**top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "now": 10.0, "max_batch_tokens": 64, "max_num_seqs": 8,
        "requests": [{"id": "a", "arrival": 9.0, "prompt_tokens": 10, "ttft_slo": 1.0, "tbt_slo": 0.1}],
    }
    doc.update(top)
    return doc


def with_req(**fields: Any) -> dict[str, Any]:
    doc = base_doc()
    doc["requests"][0].update(fields)
    return doc


def violations_of(fn: Any, *a: Any, **kw: Any) -> dict[str, str]:
    with pytest.raises(ValidationError) as ei:
        fn(*a, **kw)
    v = ei.value.violations
    assert v and all(isinstance(x, FieldViolation) for x in v)
    return {x.field: x.description for x in v}


def req_violations(req: Request, **snap_kw: Any) -> dict[str, str]:
    return violations_of(make_snapshot, [req], now=10.0, **snap_kw)


# ------------------------------------------------------------ row checks
@pytest.mark.parametrize(
    ("req", "field", "needle"),
    [
        (Request("a", 0.0, prompt_tokens=0, ttft_slo=1.0, tbt_slo=0.1), "requests[0].prompt_tokens", ">= 1"),
        (Request("a", 0.0, prompt_tokens=-5, ttft_slo=1.0, tbt_slo=0.1), "requests[0].prompt_tokens", ">= 1"),
        (Request("a", 0.0, prompt_tokens=10, computed_tokens=-1, ttft_slo=1.0, tbt_slo=0.1), "requests[0].computed_tokens", ">= 0"),
        (Request("a", 0.0, prompt_tokens=10, computed_tokens=11, ttft_slo=1.0, tbt_slo=0.1), "requests[0].computed_tokens", "exceeds"),
        (Request("a", 0.0, prompt_tokens=10, computed_tokens=5, output_tokens=1, ttft_slo=1.0, tbt_slo=0.1),
         "requests[0].output_tokens", "must be 0 while"),
        (Request("a", 0.0, prompt_tokens=10, computed_tokens=0, output_tokens=3, ttft_slo=1.0, tbt_slo=0.1),
         "requests[0].output_tokens", "must be 0 while"),
        (Request("a", 0.0, prompt_tokens=10, computed_tokens=10, output_tokens=0, ttft_slo=1.0, tbt_slo=0.1),
         "requests[0].output_tokens", "once the prompt is fully computed"),
        (Request("a", float("nan"), prompt_tokens=10, ttft_slo=1.0, tbt_slo=0.1), "requests[0].arrival", "finite"),
        (Request("a", float("inf"), prompt_tokens=10, ttft_slo=1.0, tbt_slo=0.1), "requests[0].arrival", "finite"),
        (Request("a", 0.0, prompt_tokens=10, ttft_slo=float("nan"), tbt_slo=0.1), "requests[0].ttft_slo", "finite"),
        (Request("a", 0.0, prompt_tokens=10, ttft_slo=float("inf"), tbt_slo=0.1), "requests[0].ttft_slo", "finite"),
        (Request("a", 0.0, prompt_tokens=10, tbt_slo=float("-inf"), ttft_slo=1.0), "requests[0].tbt_slo", "finite"),
        (Request("a", 0.0, prompt_tokens=10, ttft_slo=0.0, tbt_slo=0.1), "requests[0].ttft_slo", "> 0"),
        (Request("a", 0.0, prompt_tokens=10, ttft_slo=-1.0, tbt_slo=0.1), "requests[0].ttft_slo", "> 0"),
        (Request("a", 0.0, prompt_tokens=10, tbt_slo=0.0, ttft_slo=1.0), "requests[0].tbt_slo", "> 0"),
        (Request("", 0.0, prompt_tokens=10, ttft_slo=1.0, tbt_slo=0.1), "requests[0].id", "non-empty"),
    ],
)
def test_row_violation(req: Request, field: str, needle: str) -> None:
    v = req_violations(req)
    assert field in v, v
    assert needle in v[field]


def test_negative_output_tokens_reported() -> None:
    v = req_violations(Request("a", 0.0, prompt_tokens=10, computed_tokens=10, output_tokens=-2, ttft_slo=1.0, tbt_slo=0.1))
    assert "requests[0].output_tokens" in v


def test_violation_index_points_at_the_bad_row() -> None:
    reqs = [waiting("a", 5), waiting("b", 5), prefilling("c", 5, 2), Request("d", 0.0, 5, computed_tokens=6, ttft_slo=1.0, tbt_slo=0.1)]
    v = violations_of(make_snapshot, reqs)
    assert set(v) == {"requests[3].computed_tokens"}


def test_every_bad_row_is_reported_at_once() -> None:
    reqs = [Request("a", 0.0, 5, computed_tokens=-1, ttft_slo=1.0, tbt_slo=0.1), Request("b", float("nan"), 5, ttft_slo=1.0, tbt_slo=0.1), Request("c", 0.0, 5, tbt_slo=-1.0, ttft_slo=1.0)]
    v = violations_of(make_snapshot, reqs)
    assert set(v) == {"requests[0].computed_tokens", "requests[1].arrival", "requests[2].tbt_slo"}


def test_duplicate_ids() -> None:
    v = violations_of(make_snapshot, [waiting("x"), waiting("y"), waiting("x")])
    assert set(v) == {"requests[2].id"}
    assert "requests[0]" in v["requests[2].id"] and "'x'" in v["requests[2].id"]


# -------------------------------------------------------------- scalars
@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"max_batch_tokens": -3}, "max_batch_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"free_kv_tokens": -1}, "free_kv_tokens"),
        ({"prefill_throughput": 0.0}, "prefill_throughput"),
        ({"prefill_throughput": float("nan")}, "prefill_throughput"),
        ({"now": float("nan")}, "now"),
        ({"now": float("inf")}, "now"),
    ],
)
def test_scalar_violation(kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"now": 1.0}
    args.update(kw)
    v = violations_of(make_snapshot, [waiting("a")], **args)
    assert set(v) == {field}


def test_limit_of_one_is_valid_and_free_kv_zero_is_valid() -> None:
    s = make_snapshot([waiting("a")], max_batch_tokens=1, max_num_seqs=1, free_kv_tokens=0)
    assert (s.max_batch_tokens, s.max_num_seqs, s.free_kv_tokens) == (1, 1, 0)


def test_mismatched_column_lengths() -> None:
    v = violations_of(
        Snapshot.from_columns, now=0.0, max_batch_tokens=8, max_num_seqs=8, ids=["a", "b"],
        arrival=[0.0], prompt_tokens=[1, 2], computed_tokens=[0, 0, 0], output_tokens=[0, 0],
        ttft_slo=[1.0, 1.0], tbt_slo=[0.1, 0.1], protected=[False, False],
    )
    assert set(v) == {"arrival", "computed_tokens"}
    assert "1 entries" in v["arrival"] and "2 ids" in v["arrival"]
    assert "3 entries" in v["computed_tokens"]


def test_numpy_columns_wrong_dtype_and_ndim() -> None:
    v = violations_of(
        Snapshot.from_columns, now=0.0, max_batch_tokens=8, max_num_seqs=8, ids=["a"],
        arrival=np.zeros(1), prompt_tokens=np.array([1.5]), computed_tokens=np.zeros((1, 1), np.int64),
        output_tokens=np.zeros(1, np.int64), ttft_slo=np.ones(1), tbt_slo=np.ones(1),
        protected=np.zeros(1, bool),
    )
    assert set(v) == {"prompt_tokens", "computed_tokens"}


def test_too_many_requests() -> None:
    reqs = [waiting(f"r{i}") for i in range(3)]
    v = violations_of(make_snapshot, reqs, max_requests=2)
    assert "requests" in v and "3" in v["requests"] and "2" in v["requests"]
    assert len(make_snapshot(reqs, max_requests=3)) == 3
    doc = base_doc(requests=[{"id": f"r{i}", "arrival": 0.0, "prompt_tokens": 1, "ttft_slo": 1.0,
                              "tbt_slo": 0.1} for i in range(3)])
    v = violations_of(Snapshot.from_json, doc, max_requests=2)
    assert "requests" in v and "more than the limit 2" in v["requests"]


# ------------------------------------------------------------------ JSON
@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (base_doc(now="10"), "now"),
        (base_doc(now=True), "now"),
        (base_doc(max_batch_tokens=64.0), "max_batch_tokens"),
        (base_doc(max_batch_tokens=True), "max_batch_tokens"),
        (base_doc(max_num_seqs="8"), "max_num_seqs"),
        (base_doc(free_kv_tokens=1.5), "free_kv_tokens"),
        (base_doc(prefill_throughput="fast"), "prefill_throughput"),
        (base_doc(requests={}), "requests"),
        (base_doc(requests=[1]), "requests[0]"),
        (with_req(id=5), "requests[0].id"),
        (with_req(prompt_tokens=10.5), "requests[0].prompt_tokens"),
        (with_req(prompt_tokens="10"), "requests[0].prompt_tokens"),
        (with_req(computed_tokens=None), "requests[0].computed_tokens"),
        (with_req(arrival="9"), "requests[0].arrival"),
        (with_req(ttft_slo=[1.0]), "requests[0].ttft_slo"),
        (with_req(protected=1), "requests[0].protected"),
        (with_req(protected="false"), "requests[0].protected"),
    ],
)
def test_wrong_json_types(doc: dict[str, Any], field: str) -> None:
    v = violations_of(Snapshot.from_json, json.dumps(doc))
    assert field in v, v


def test_unknown_fields_top_level_and_request() -> None:
    doc = base_doc(extra=1)
    doc["requests"][0]["colour"] = "red"
    v = violations_of(Snapshot.from_json, doc)
    assert v == {"extra": "unknown field", "requests[0].colour": "unknown field"}


def test_missing_required_fields() -> None:
    v = violations_of(Snapshot.from_json, {"requests": [{"id": "a"}]})
    assert {"now", "max_batch_tokens", "max_num_seqs", "requests[0].arrival", "requests[0].prompt_tokens",
            "requests[0].ttft_slo", "requests[0].tbt_slo"} == set(v)
    assert all(d == "is required" for d in v.values())


@pytest.mark.parametrize("text", ["{", "", "not json", b"\xff\xfe", '{"now": 1,}'])
def test_invalid_json_text(text: str | bytes) -> None:
    v = violations_of(Snapshot.from_json, text)
    assert set(v) == {"snapshot"} and "not valid JSON" in v["snapshot"]


@pytest.mark.parametrize("text", ["[1, 2]", "3", '"x"', "null"])
def test_json_not_an_object(text: str) -> None:
    assert violations_of(Snapshot.from_json, text) == {"snapshot": "must be a JSON object"}


def test_json_nan_in_text_is_a_row_violation() -> None:
    text = json.dumps(with_req(arrival=float("nan")))
    assert "NaN" in text
    v = violations_of(Snapshot.from_json, text)
    assert set(v) == {"requests[0].arrival"}


def test_validation_error_str_is_one_line_with_count() -> None:
    reqs = [Request(f"r{i}", 0.0, 5, computed_tokens=-1, ttft_slo=1.0, tbt_slo=0.1) for i in range(5)]
    with pytest.raises(ValidationError) as ei:
        make_snapshot(reqs)
    s = str(ei.value)
    assert "\n" not in s and "requests[0].computed_tokens" in s and "(and 2 more)" in s
    assert isinstance(ei.value, ValueError)


def test_spec_example_parses() -> None:
    s = Snapshot.from_json(SPEC_EXAMPLE)
    assert s.now == 12.345 and s.max_batch_tokens == 2048 and s.max_num_seqs == 256
    assert s.free_kv_tokens == 120000 and s.prefill_throughput == 5000.0
    assert s.ids == ("r1",)
    assert s.remaining_prefill.tolist() == [500]
    assert s.is_decoding.tolist() == [False]
    assert s.slack[0] == pytest.approx(12.0 + 0.5 - 12.345)
    assert s.kv_tokens.tolist() == [500]
    assert json.loads(s.to_json()) == json.loads(SPEC_EXAMPLE)


def test_optional_fields_default() -> None:
    s = Snapshot.from_json(base_doc())
    assert s.free_kv_tokens is None and s.prefill_throughput is None
    assert s.computed_tokens.tolist() == [0] and s.output_tokens.tolist() == [0]
    assert s.protected.tolist() == [False]
    d = s.to_dict()
    assert "free_kv_tokens" not in d and "prefill_throughput" not in d


def test_bytes_and_mapping_inputs() -> None:
    doc = base_doc()
    a = Snapshot.from_json(doc)
    b = Snapshot.from_json(json.dumps(doc).encode())
    assert a.to_dict() == b.to_dict()


def test_columns_are_read_only() -> None:
    s = make_snapshot([waiting("a")])
    with pytest.raises(ValueError):
        s.prompt_tokens[0] = 5
    with pytest.raises(ValueError):
        s.slack[0] = 0.0


def test_empty_snapshot_is_valid() -> None:
    s = make_snapshot([], now=3.0)
    assert len(s) == 0 and s.slack.shape == (0,)
    assert Snapshot.from_json(s.to_json()).to_dict() == s.to_dict()


@settings(max_examples=40, deadline=None)
@given(snapshots())
def test_json_round_trip(s: Snapshot) -> None:
    d = s.to_dict()
    back = Snapshot.from_json(s.to_json())
    assert back.to_dict() == d
    assert Snapshot.from_json(d).to_dict() == d
    assert back.requests() == s.requests()
    for col in ("arrival", "prompt_tokens", "computed_tokens", "output_tokens", "ttft_slo", "tbt_slo",
                "protected"):
        np.testing.assert_array_equal(getattr(back, col), getattr(s, col))
        assert getattr(back, col).dtype == getattr(s, col).dtype


def test_round_trip_keeps_exact_floats() -> None:
    s = make_snapshot([waiting("a", arrival=0.1 + 0.2, ttft=1 / 3)], now=math.pi)
    back = Snapshot.from_json(s.to_json())
    assert back.now == math.pi and back.arrival[0] == 0.1 + 0.2 and back.ttft_slo[0] == 1 / 3


# ------------------------------------------------------------ derived
def test_derived_columns_hand_computed() -> None:
    reqs = [
        waiting("w", 300, arrival=9.0, ttft=2.0),                     # s = 9 + 2 - 10 = 1.0
        prefilling("p", 300, 120, arrival=9.5, ttft=0.25),            # s = 9.75 - 10 = -0.25
        decoding("d", 200, 5, arrival=8.0, ttft=1.0, tbt=0.2),        # s = 8 + 1 + 5*.2 - 10 = 0.0
        decoding("e", 50, 1, arrival=9.9, ttft=0.5, tbt=0.05),        # s = 9.9 + .5 + .05 - 10 = 0.45
    ]
    s = make_snapshot(reqs, now=10.0)
    assert s.is_decoding.tolist() == [False, False, True, True]
    assert s.remaining_prefill.tolist() == [300, 180, 0, 0]
    assert s.kv_tokens.tolist() == [0, 120, 204, 50]
    np.testing.assert_allclose(s.slack, [1.0, -0.25, 0.0, 0.45], atol=1e-12)
    np.testing.assert_allclose(s.ttft_deadline, [11.0, 9.75, 9.0, 10.4])
