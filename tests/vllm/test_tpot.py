"""The TPOT objective in the vLLM adapter, on real vLLM request objects: ``slo_tpot_ms``
reaches the snapshot, and each paced request's first token is timed for its
``first_token_time`` (once, when it is first seen decoding)."""

from __future__ import annotations

import pytest

from engine_adapter.vllm.settings import SettingsError, parse_slo_classes
from engine_adapter.vllm.snapshot import ClassSlo, SloDefaults, SnapshotBuilder

from .support import make_request


def _decode(r: object, prompt: int) -> None:
    r.num_computed_tokens = prompt  # type: ignore[attr-defined]
    r.append_output_token_ids(7)  # type: ignore[attr-defined]


def test_paced_requests_carry_their_objective_and_first_token_time() -> None:
    b = SnapshotBuilder(SloDefaults(ttft_s=1.0), profile="")
    paced = make_request(64, 8, extra_args={"slo_tpot_ms": 40}, arrival=100.0)
    plain = make_request(64, 8, arrival=100.0)
    snap, _ = b.build([], [paced, plain], max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000, now=100.5)
    assert snap.tpot_slo.tolist() == [0.04, 0.0] and snap.first_token_time.tolist() == [0.0, 0.0]
    for r in (paced, plain):
        _decode(r, 64)
    snap, rows = b.build([paced, plain], [], max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000, now=101.25)
    assert rows == [paced, plain] and snap.is_decoding.all()
    # the first time it is seen decoding, and only the paced one (the other needs none)
    assert snap.first_token_time.tolist() == [101.25, 0.0]
    assert snap.slack[0] == 101.25 + 1 * 0.04 - 101.25  # one token so far: the next is due one TPOT on
    for r in (paced, plain):  # the first output token computed, a second sampled
        r.num_computed_tokens += 1
        r.append_output_token_ids(8)
    later, _ = b.build([paced, plain], [], max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000, now=101.5)
    assert later.first_token_time.tolist() == [101.25, 0.0]  # kept, not re-timed
    assert later.slack[0] == 101.25 + 2 * 0.04 - 101.5


def test_the_class_table_takes_a_tpot_objective() -> None:
    assert parse_slo_classes('{"1": {"ttft_ms": 500, "tpot_ms": 40}}') == {1: ClassSlo(ttft_s=0.5, tpot_s=0.04)}
    for bad, msg in (('{"1": {"tpot_ms": -1}}', "tpot_ms must be a number"),
                     ('{"1": {"tpot_ms": 1e300}}', "tpot_ms must be at most")):
        with pytest.raises(SettingsError, match=msg):
            parse_slo_classes(bad)
    b = SnapshotBuilder(SloDefaults(ttft_s=1.0, classes=parse_slo_classes('{"2": {"tpot_ms": 25}}')), profile="")
    reqs = [make_request(32, 4, priority=2), make_request(32, 4), make_request(32, 4, priority=2,
                                                                              extra_args={"slo_tpot_ms": 60})]
    snap, _ = b.build([], reqs, max_batch_tokens=512, max_num_seqs=8, free_kv_tokens=10_000)
    assert snap.tpot_slo.tolist() == [0.025, 0.0, 0.06]


def test_explain_every_is_a_setting_of_the_adapter() -> None:
    from engine_adapter.vllm.settings import VllmAdapterSettings

    assert VllmAdapterSettings.from_env({}).explain_every == 16
    assert VllmAdapterSettings.from_env({"SLIDINGSERVE_EXPLAIN_EVERY": "0"}).explain_every == 0
    with pytest.raises(SettingsError, match="SLIDINGSERVE_EXPLAIN_EVERY must be in"):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_EXPLAIN_EVERY": "-1"})
