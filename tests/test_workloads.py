"""Workloads from the real traces, and the claim that the default SLOs are met at low load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.workloads import Burst, SLOConfig, make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.data.traces import load_trace
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
from engine_adapter.sim.groundtruth import PROFILES, load_ground_truth
from engine_adapter.sim.profiling import fit_profile_predictor

PROFILE = "a100-tp2-llama2-7b"


def test_named_mixes_draw_from_the_right_traces() -> None:
    def pairs(p: np.ndarray, d: np.ndarray) -> set[tuple[int, int]]:
        return set(zip(p.tolist(), d.tolist(), strict=True))

    share, arxiv = load_trace("sharegpt"), load_trace("arxiv")
    in_share, in_arxiv = pairs(share.prefill, share.decode), pairs(arxiv.prefill, arxiv.decode)
    for name, share_part in (("mixed-v1", 0.75), ("mixed-v2", 5 / 6), ("sharegpt", 1.0), ("arxiv", 0.0)):
        w = make_workload(name, 4000, 2.0, seed=0)
        got = list(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist(), strict=True))
        assert all(g in in_share or g in in_arxiv for g in got)
        only_share = np.mean([g in in_share and g not in in_arxiv for g in got])
        assert only_share == pytest.approx(share_part, abs=0.03), name


def test_poisson_rate_seeding_and_sorting() -> None:
    a = make_workload("sharegpt", 3000, 4.0, seed=7)
    b = make_workload("sharegpt", 3000, 4.0, seed=7)
    c = make_workload("sharegpt", 3000, 4.0, seed=8)
    assert np.array_equal(a.arrival, b.arrival) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.arrival, c.arrival)
    assert np.all(np.diff(a.arrival) >= 0)
    assert 3000 / a.arrival[-1] == pytest.approx(4.0, rel=0.06)


def test_slo_assignment_and_protected_class() -> None:
    slo = SLOConfig(ttft_base_s=0.3, ttft_per_token_s=0.001, tbt_s=0.08, protected_fraction=0.2,
                    protected_ttft_scale=0.5)
    w = make_workload("arxiv", 2000, 1.0, seed=1, slo=slo)
    expect = 0.3 + 0.001 * w.prompt_tokens
    expect = np.where(w.protected, expect * 0.5, expect)
    assert np.allclose(w.ttft_slo, expect)
    assert np.all(w.tbt_slo == 0.08)
    assert 0.15 < w.protected.mean() < 0.25


def test_burst_raises_the_arrival_rate_inside_its_window() -> None:
    w = make_workload("sharegpt", 6000, 2.0, seed=3, burst=Burst(start_s=100.0, duration_s=100.0, multiplier=4.0))
    inside = ((w.arrival >= 100) & (w.arrival < 200)).sum() / 100.0
    before = (w.arrival < 100).sum() / 100.0
    assert before == pytest.approx(2.0, rel=0.2)
    assert inside == pytest.approx(8.0, rel=0.15)


def test_csv_workload_with_and_without_timestamps(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens,arrived_at\n10,5,0.5\n20,6,0.1\n30,7,0.9\n")
    w = make_workload(str(f), 3, 1.0, seed=0, use_trace_arrivals=True)
    assert w.arrival.tolist() == [0.0, 0.4, 0.8] or np.allclose(w.arrival, [0.0, 0.4, 0.8])
    assert w.prompt_tokens.tolist() == [20, 10, 30]
    w2 = make_workload(str(f), 50, 2.0, seed=0)
    assert set(w2.prompt_tokens.tolist()) <= {10, 20, 30}
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,decode\n1,2\n")
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        make_workload(str(bad), 5, 1.0, seed=0)
    with pytest.raises(FileNotFoundError, match="no trace named"):
        make_workload("no-such-workload", 5, 1.0, seed=0)


@pytest.mark.parametrize("policy", ["vllm-fcfs", "sarathi-edf", "qoserve", "slidingserve"])
def test_default_slos_are_met_at_low_load(policy: str) -> None:
    """The SLO defaults must not be so tight that a policy fails with no contention."""
    pred = fit_profile_predictor(PROFILE, n=1500, seed=0)
    w = make_workload("mixed-v1", 80, 0.25, seed=11)
    settings = AdapterSettings(policy=policy, profile=PROFILE)
    adapter = AdapterCore(InProcessBackend(settings, pred, refit=False), settings, pred)
    try:
        res = SimulatedEngine(w, load_ground_truth(PROFILE), PROFILES[PROFILE], adapter, EngineConfig()).run()
    finally:
        adapter.close()
    assert res.completed == len(w)
    assert res.violation_rate <= 0.0125, res.summary()


def test_code_workload_is_real_long_prompt_short_answer_pairs() -> None:
    share, arxiv = load_trace("sharegpt"), load_trace("arxiv")
    real = set(zip(share.prefill.tolist(), share.decode.tolist(), strict=True)) | set(
        zip(arxiv.prefill.tolist(), arxiv.decode.tolist(), strict=True))
    w = make_workload("code", 3000, 3.0, seed=1)
    pairs = list(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist(), strict=True))
    assert all(p in real for p in pairs)
    assert w.prompt_tokens.min() >= 1024 and w.prompt_tokens.max() <= 4096
    assert w.output_tokens.max() <= 64
    assert 2000 <= float(np.median(w.prompt_tokens)) <= 3000 and 20 <= float(np.median(w.output_tokens)) <= 60
    # both traces contribute, and the draw is seeded
    in_share = set(zip(share.prefill.tolist(), share.decode.tolist(), strict=True))
    in_arxiv = set(zip(arxiv.prefill.tolist(), arxiv.decode.tolist(), strict=True))
    assert any(p in in_share and p not in in_arxiv for p in pairs)
    assert any(p in in_arxiv and p not in in_share for p in pairs)
    np.testing.assert_array_equal(make_workload("code", 50, 3.0, seed=1).prompt_tokens,
                                  make_workload("code", 50, 3.0, seed=1).prompt_tokens)
    assert not np.array_equal(make_workload("code", 50, 3.0, seed=2).prompt_tokens,
                              make_workload("code", 50, 3.0, seed=1).prompt_tokens)
