"""Invariants of every registered policy on random valid snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import (
    BatchLatencyPredictor,
    Plan,
    Snapshot,
    default_predictor,
    plan_violations,
    registry,
)
from scheduler_service.core.plan import PATHS
from tests.factories import predict_cu
from tests.strategies import predictors, snapshots

VARIANTS: list[tuple[str, dict[str, Any]]] = [(n, {}) for n in sorted(registry.names())] + [
    ("slidingserve", {"window": 1}),
    ("slidingserve", {"window": 3}),
    ("slidingserve", {"window": 4, "granularity": 1}),
    ("slidingserve", {"order": "edf", "max_candidates": 2}),
    ("sarathi", {"chunk_size": 8}),
    ("qoserve", {"min_chunk": 4, "chunk_step": 8}),
]
SLIDING = {"slidingserve", "sarathi-edf+sc", "sarathi-edf+sc+mlps"}

PROPS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
any_predictor = st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True))


def check_invariants(name: str, chunk: int | None, snap: Snapshot, pred: BatchLatencyPredictor,
                     plan: Plan) -> None:
    assert plan_violations(snap, plan) == []
    idx = {rid: i for i, rid in enumerate(snap.ids)}
    ids = [a.id for a in plan.allocations]
    assert len(set(ids)) == len(ids), "duplicate ids"
    assert set(ids) <= set(idx), "unknown ids"
    total = sum(a.tokens for a in plan.allocations)
    assert plan.token_budget == total <= snap.max_batch_tokens
    assert len(ids) <= snap.max_num_seqs
    if snap.free_kv_tokens is not None:
        assert total <= snap.free_kv_tokens
    for a in plan.allocations:
        i = idx[a.id]
        if snap.is_decoding[i]:
            assert a.tokens == 1, a
        else:
            assert 1 <= a.tokens <= int(snap.remaining_prefill[i]), a
    n_dec = int(snap.is_decoding.sum())
    got_dec = sum(bool(snap.is_decoding[idx[r]]) for r in ids)
    if name != "vllm-fcfs":  # vLLM interleaves running prefills and decodes by arrival
        # every decode gets its token unless a limit (or a fixed chunk) forces fewer
        cap = min(n_dec, snap.max_batch_tokens, snap.max_num_seqs, chunk or n_dec,
                  snap.free_kv_tokens if snap.free_kv_tokens is not None else n_dec)
        assert got_dec == cap
    assert plan.policy == name
    assert plan.predictor_version == pred.version
    if name in SLIDING:
        assert plan.path in PATHS
        if not ids:
            assert plan.path == "idle"
    else:
        assert plan.path == name
    cu = [(a.tokens, int(snap.kv_tokens[idx[a.id]])) for a in plan.allocations]
    assert plan.predicted_latency_ms == pytest.approx(predict_cu(pred, cu), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("name", "overrides"), VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
@PROPS
@given(snap=snapshots(max_n=10, max_prompt=64, max_bmax=64), pred=any_predictor)
def test_policy_invariants_and_determinism(name: str, overrides: dict[str, Any], snap: Snapshot,
                                           pred: BatchLatencyPredictor) -> None:
    pol = registry.create(name, overrides)
    plan = pol.plan(snap, pred)
    check_invariants(name, getattr(pol.params, "chunk_size", None), snap, pred, plan)
    assert pol.plan(snap, pred).decision_key() == plan.decision_key()
    copy = Snapshot.from_json(snap.to_json())
    pred_copy = BatchLatencyPredictor.from_json(pred.to_json())
    assert registry.create(name, overrides).plan(copy, pred_copy).decision_key() == plan.decision_key()


@PROPS
@given(snap=snapshots(max_n=10), chunk=st.integers(1, 80))
def test_sarathi_decodes_fill_the_chunk_first(snap: Snapshot, chunk: int) -> None:
    plan = registry.create("sarathi", {"chunk_size": chunk}).plan(snap, default_predictor())
    n_dec = int(snap.is_decoding.sum())
    kv = snap.free_kv_tokens if snap.free_kv_tokens is not None else n_dec
    want = min(n_dec, chunk, snap.max_batch_tokens, snap.max_num_seqs, kv)
    got = sum(bool(snap.is_decoding[snap.ids.index(a.id)]) for a in plan.allocations)
    assert got == want
    assert plan.token_budget <= min(chunk, snap.max_batch_tokens)


@PROPS
@given(snap=snapshots(max_n=12))
def test_slidingserve_serves_expired_only_after_live_prefills_fit(snap: Snapshot) -> None:
    """Expired prefills sort last: one is served only when every live prefill is served in
    full, or the batch-constructor path picked whole live requests (it never takes expired)."""
    plan = registry.create("slidingserve").plan(snap, default_predictor())
    a = plan.as_dict()
    idx = {rid: i for i, rid in enumerate(snap.ids)}
    expired = [r for r in a if not snap.is_decoding[idx[r]] and snap.slack[idx[r]] <= 0]
    if plan.path == "batch_constructor":
        assert not expired
        assert all(a[r] == int(snap.remaining_prefill[idx[r]]) for r in a if not snap.is_decoding[idx[r]])
    elif expired:
        live = [i for i in range(len(snap)) if not snap.is_decoding[i] and snap.slack[i] > 0]
        assert all(a.get(snap.ids[i], 0) == int(snap.remaining_prefill[i]) for i in live)
    assert np.all(np.isfinite([plan.predicted_latency_ms]))
