"""``cached_tokens`` (issue 23, "hit = started"): prefix-cache hits of a waiting request shown
as computed tokens are context, not work, and do not start the request.

A request with ``cached_tokens == computed_tokens > 0`` has not been admitted: it holds no
KV of its own (``Snapshot.started`` is False), so vllm-fcfs and sarathi do not put it among
the started prefills, QoServe may relegate it, SlidingServe's KV-growth watermark does not
count it as a holder and holds it back like any new admission; a plan's chunk for it is
still only the prompt tokens beyond the hit.  The field round-trips through JSON and
protobuf (both encodings) and is validated (``0 <= cached_tokens <= computed_tokens``),
over gRPC as INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import Request, Snapshot, ValidationError, default_predictor, registry
from scheduler_service.core.batch import CandidateQueue
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.server import SchedulerServer
from scheduler_service.wire.convert import snapshot_from_pb, snapshot_to_pb
from tests.grpc_support import make_server
from tests.strategies import snapshots
from tests.test_properties import PROPS, VARIANTS, any_predictor, check_invariants

NOW = 10.0


def _fcfs_case(max_batch_tokens: int) -> Snapshot:
    """``hit``: waiting, its first 64 tokens prefix-cache hits, arrived first; ``own``:
    partly prefilled (50 tokens of its own), arrived later."""
    return Snapshot.from_requests(
        [Request("hit", 0.0, 200, computed_tokens=64, cached_tokens=64, ttft_slo=100.0, tbt_slo=0.1),
         Request("own", 1.0, 200, computed_tokens=50, ttft_slo=100.0, tbt_slo=0.1)],
        now=NOW, max_batch_tokens=max_batch_tokens)


# ------------------------------------------------------------------- the mask
def test_started_mask() -> None:
    s = Snapshot.from_requests(
        [Request("new", 0.0, 100, ttft_slo=1.0, tbt_slo=0.1), Request("hit", 0.0, 100, computed_tokens=40, cached_tokens=40, ttft_slo=1.0, tbt_slo=0.1),
         Request("hit+own", 0.0, 100, computed_tokens=60, cached_tokens=40, ttft_slo=1.0, tbt_slo=0.1),
         Request("own", 0.0, 100, computed_tokens=60, ttft_slo=1.0, tbt_slo=0.1), Request("dec", 0.0, 10, computed_tokens=10, output_tokens=2, ttft_slo=1.0, tbt_slo=0.1)],
        now=NOW)
    assert s.started.tolist() == [False, False, True, True, True]
    assert not s.started.flags.writeable
    # the hits are context, not work
    assert s.remaining_prefill.tolist() == [100, 60, 40, 40, 0]
    assert s.kv_tokens.tolist()[:2] == [0, 40]


# ------------------------------------------------------------------- policies
@pytest.mark.parametrize("name", ["vllm-fcfs", "vllm-priority", "sarathi"])
def test_a_hit_is_not_a_started_prefill(name: str) -> None:
    """Started prefills go first: the request with its own KV, not the earlier one whose
    computed tokens are prefix-cache hits."""
    plan = registry.create(name, {"chunk_size": 150} if name == "sarathi" else None).plan(
        _fcfs_case(150), default_predictor())
    assert [(a.id, a.tokens) for a in plan.allocations] == [("own", 150)]
    # with room for both, the hit's chunk is the tokens beyond the hit
    plan = registry.create(name).plan(_fcfs_case(2048), default_predictor())
    assert plan.tokens_by_id() == {"hit": 136, "own": 150}


def test_qoserve_relegates_a_hit_that_cannot_make_its_deadline() -> None:
    s = Snapshot.from_requests(
        [Request("hit", NOW - 0.9, 1000, computed_tokens=100, cached_tokens=100, ttft_slo=1.0, tbt_slo=0.1),
         Request("own", NOW - 0.9, 1000, computed_tokens=100, ttft_slo=1.0, tbt_slo=0.1)],
        now=NOW, prefill_throughput=1000.0)
    pol = registry.create("qoserve")
    # 900 tokens at 1000 tokens/s pass the deadline 0.1 s away: only a request that has not
    # started is relegated
    assert pol.relegated(s, default_predictor(), np.arange(2)).tolist() == [True, False]


def _watermark_case(computed: int, cached: int, prompt: int = 100) -> Snapshot:
    """A request (``computed`` tokens, ``cached`` of them prefix-cache hits) and a new one
    behind it; 400 KV tokens free."""
    return Snapshot.from_requests(
        [Request("hit", 0.0, prompt, computed_tokens=computed, cached_tokens=cached, ttft_slo=100.0, tbt_slo=0.1),
         Request("new", 1.0, 1000, ttft_slo=100.0, tbt_slo=0.1)],
        now=NOW, max_batch_tokens=2048, free_kv_tokens=400)


def test_a_hit_is_no_kv_holder_and_is_held_back_by_the_watermark() -> None:
    """SlidingServe's KV-growth watermark: nothing holds KV, so nothing is reserved and the
    plan may fill the whole 400 free tokens, exactly as without the hit."""
    pred = default_predictor()
    for params in ({}, {"batch_constructor": False}):
        pol = registry.create("slidingserve", params)
        with_hit = pol.plan(_watermark_case(64, 64), pred)
        assert with_hit.token_budget == pol.plan(_watermark_case(0, 0), pred).token_budget == 400
        assert with_hit.tokens_by_id()["hit"] == 36  # only the tokens beyond the hit
        # the same request with 64 tokens of its own holds KV: 64 iterations of growth reserved
        assert pol.plan(_watermark_case(64, 0), pred).token_budget == 400 - 64


def test_the_watermark_holds_back_a_hit_not_a_started_request() -> None:
    """The candidate queue: past the watermark the stream runs only up to its first request
    that has not started; a started one at its head may use the whole headroom."""
    pred = default_predictor()

    def first_cap(computed: int, cached: int) -> int:
        s = _watermark_case(computed, cached, prompt=1000)
        return CandidateQueue.build(s, pred, np.zeros(0, np.int64), np.arange(2), n_all_decodes=0,
                                    kv_growth_reserve=300).first_cap

    assert first_cap(64, 0) == 400
    assert first_cap(64, 64) == first_cap(0, 0) == 100  # 400 free - 300 reserved


@st.composite
def hit_snapshots(draw: st.DrawFn) -> tuple[Snapshot, Snapshot]:
    """A valid snapshot with some waiting requests given prefix-cache hits (computed =
    cached = h), and the same snapshot with each of them a fresh request of the remaining
    ``prompt - h`` tokens instead."""
    snap = draw(snapshots(max_n=10, max_prompt=64, max_bmax=64))
    d = snap.to_dict()
    hits, fresh = [], []
    for r in d["requests"]:
        h = 0
        if r["computed_tokens"] == 0 and r["prompt_tokens"] > 1 and draw(st.booleans()):
            h = draw(st.integers(1, r["prompt_tokens"] - 1))
        hits.append({**r, "computed_tokens": h, "cached_tokens": h} if h else r)
        fresh.append({**r, "prompt_tokens": r["prompt_tokens"] - h})
    return Snapshot.from_json({**d, "requests": hits}), Snapshot.from_json({**d, "requests": fresh})


@PROPS
@given(pair=hit_snapshots(), pred=any_predictor)
def test_a_hit_plans_like_a_fresh_request_of_the_remaining_tokens(pair: tuple[Snapshot, Snapshot],
                                                                 pred: Any) -> None:
    """Policies that read no predictor for their allocations allocate exactly as for fresh
    requests of the tokens beyond the hits; QoServe relegates the same requests."""
    hit, fresh = pair
    assert not (hit.started & (hit.cached_tokens > 0)).any()
    for name in ("vllm-fcfs", "vllm-priority", "sarathi", "sarathi-edf"):
        pol = registry.create(name)
        assert pol.plan(hit, pred).allocations == pol.plan(fresh, pred).allocations, name
    qos = registry.create("qoserve")
    pre = np.flatnonzero(~hit.is_decoding)
    assert np.array_equal(qos.relegated(hit, pred, pre), qos.relegated(fresh, pred, pre))


@pytest.mark.parametrize(("name", "overrides"), VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
@settings(PROPS, max_examples=40)
@given(pair=hit_snapshots(), pred=any_predictor)
def test_policy_invariants_with_hits(name: str, overrides: dict[str, Any], pair: tuple[Snapshot, Snapshot],
                                     pred: Any) -> None:
    """Every policy's plan on snapshots with hits is valid: a hit's chunk is at most the
    tokens beyond the hit (``remaining_prefill``)."""
    snap = pair[0]
    pol = registry.create(name, overrides)
    check_invariants(name, getattr(pol.params, "chunk_size", None), snap, pred, pol.plan(snap, pred), pol.params)


# ----------------------------------------------------------------- formats
def _violations(fn: Any) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as ei:
        fn()
    return [(v.field, v.description) for v in ei.value.violations]


def test_json_round_trip_and_validation() -> None:
    s = _fcfs_case(2048)
    doc = s.to_dict()
    assert doc["requests"][0]["cached_tokens"] == 64 and "cached_tokens" not in doc["requests"][1]
    back = Snapshot.from_json(s.to_json())
    assert back.cached_tokens.tolist() == [64, 0] and back.started.tolist() == [False, True]
    doc["requests"][1]["cached_tokens"] = 51  # more than its 50 computed tokens
    doc["requests"][0]["cached_tokens"] = -1
    v = _violations(lambda: Snapshot.from_json(doc))
    assert ("requests[0].cached_tokens", "must be >= 0") in v
    assert [f for f, d in v if "exceeds computed_tokens" in d] == ["requests[1].cached_tokens"]
    # left out: 0 (the form before the field)
    del doc["requests"][0]["cached_tokens"], doc["requests"][1]["cached_tokens"]
    assert not Snapshot.from_json(doc).cached_tokens.any()


@pytest.mark.parametrize("encoding", ["columns", "rows"])
def test_protobuf_round_trip(encoding: str) -> None:
    s = _fcfs_case(2048)
    msg = pb.Snapshot.FromString(snapshot_to_pb(s, encoding=encoding).SerializeToString())
    if encoding == "columns":
        assert list(msg.columns.cached_tokens) == [64, 0]
    else:
        assert [r.cached_tokens for r in msg.rows.requests] == [64, 0]
    back, _ = snapshot_from_pb(msg, max_requests=10)
    assert back.cached_tokens.tolist() == [64, 0] and back.started.tolist() == [False, True]
    # none cached: the field is not sent (older peers see the snapshot they always did)
    plain = snapshot_to_pb(_watermark_case(0, 0))
    assert len(plain.columns.cached_tokens) == 0


def _bad(encoding: str) -> pb.Snapshot:
    """``_fcfs_case`` with cached_tokens [-1, 51] (row 1 has 50 computed tokens)."""
    msg = snapshot_to_pb(_fcfs_case(2048), encoding=encoding)
    if encoding == "columns":
        msg.columns.cached_tokens[:] = [-1, 51]
    else:
        msg.rows.requests[0].cached_tokens, msg.rows.requests[1].cached_tokens = -1, 51
    return msg


@pytest.mark.parametrize(("encoding", "path"), [("columns", "snapshot.columns.cached_tokens[{}]"),
                                                ("rows", "snapshot.rows.requests[{}].cached_tokens")])
def test_protobuf_validation_names_the_field(encoding: str, path: str) -> None:
    v = _violations(lambda: snapshot_from_pb(_bad(encoding), max_requests=10))
    assert (path.format(0), "must be >= 0") in v
    assert [f for f, d in v if "exceeds computed_tokens" in d] == [path.format(1)]


@pytest.fixture(scope="module")
def client() -> Iterator[SchedulerClient]:
    srv: SchedulerServer
    with make_server() as srv, SchedulerClient(srv.target, timeout_s=10.0) as c:
        yield c


def test_grpc_carries_cached_tokens(client: SchedulerClient) -> None:
    """The service decodes the field: its vllm-fcfs plan puts the started request first."""
    plan = client.schedule(_fcfs_case(150), policy="vllm-fcfs")
    assert [(a.id, a.tokens) for a in plan.allocations] == [("own", 150)]


@pytest.mark.parametrize(("encoding", "path"), [("columns", "snapshot.columns.cached_tokens[{}]"),
                                                ("rows", "snapshot.rows.requests[{}].cached_tokens")])
def test_grpc_invalid_argument_names_the_field(client: SchedulerClient, encoding: str, path: str) -> None:
    with pytest.raises(SchedulerError) as e:
        client.schedule(_bad(encoding), policy="vllm-fcfs")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(e.value.fields) == [path.format(0), path.format(1)]
    assert client.schedule(_fcfs_case(150), policy="vllm-fcfs").allocations  # still serving
