"""Ground-truth GPU model: fidelity checks (issue 3, (1) and (2)), monotonicity, sanity."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_adapter.sim.fidelity import predictor_fidelity, qoserve_gap, qoserve_reference_ms
from engine_adapter.sim.groundtruth import (
    PROFILES,
    GPUProfile,
    UnknownProfileError,
    load_ground_truth,
)
from engine_adapter.sim.profiling import fit_profile_predictor, profiling_sweep, random_batches


def _batch(decodes: int, dctx: int, chunks: list[int], pctx: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([1] * decodes + chunks), np.array([dctx] * decodes + pctx)


# ------------------------------------------------------------------ fidelity
def test_fidelity_1_qoserve_linear_model() -> None:
    r = qoserve_gap()
    print(f"\nground truth a100-tp1-llama3-8b vs QoServe model: median |gap| {r.median_abs_gap:.1%} "
          f"(signed {r.median_signed_gap:+.1%}, p90 {r.p90_abs_gap:.1%}, n={r.n}, by bin {r.by_bin})")
    assert r.median_abs_gap <= 0.25


def test_qoserve_reference_formula() -> None:
    # One decode of context 100, no prefill: the <=512 bin by hand (seconds -> ms).
    want = (5.882475e-05 + 3.634519e-05 + 1.111258e-07 * 100 + 0.014936) * 1e3
    assert qoserve_reference_ms(np.array([1]), np.array([100])) == pytest.approx(want)
    # 1024-token prefill after 10 cached: the >512 bin; prefill context counts.
    want = (2.719050e-05 * 1024 + 6.863043e-05 * 1024 + 2.727223e-06 * 10 + 0.005004) * 1e3
    assert qoserve_reference_ms(np.array([1024]), np.array([10])) == pytest.approx(want)


def test_fidelity_2_predictor_learns_ground_truth() -> None:
    res = predictor_fidelity("a100-tp2-llama2-7b", n_train=3000, n_test=1500, seed=0)
    print()
    for name, m in res.items():
        print(f"  {name:8s} n={m['n']:5d}  MAE {m['mae_ms']:.2f} ms  RMSE {m['rmse_ms']:.2f} ms  R2 {m['r2']:.4f}")
    assert res["all"]["r2"] > 0.95
    for name in ("decode", "prefill", "mixed"):
        assert res[name]["r2"] > 0.9, name


def test_sweep_is_seeded_and_covers_scenarios() -> None:
    a = profiling_sweep("a100-tp2-llama2-7b", n=300, seed=3)
    b = profiling_sweep("a100-tp2-llama2-7b", n=300, seed=3)
    np.testing.assert_array_equal(a.latency_ms, b.latency_ms)
    np.testing.assert_array_equal(a.features, b.features)
    assert set(np.unique(a.scenario)) == {0, 1, 2}
    assert a.features[:, 3].max() <= 256 and a.features[:, 5].max() <= 4096
    p = fit_profile_predictor("a100-tp2-llama2-7b", n=300, seed=3)
    assert p.meta["profile"] == "a100-tp2-llama2-7b"


# ------------------------------------------------------------ monotonicity
@pytest.mark.parametrize("key", sorted(PROFILES))
def test_more_tokens_or_context_never_faster(key: str) -> None:
    gt = load_ground_truth(key)
    rng = np.random.default_rng(1)
    for c, u in random_batches(300, rng):
        base = gt.iteration_ms(c, u)
        i = int(rng.integers(len(c)))
        more_ctx = u.copy()
        more_ctx[i] += int(rng.integers(1, 512))
        assert gt.iteration_ms(c, more_ctx) >= base
        more_tok = c.copy()
        more_tok[i] += int(rng.integers(1, 512))
        assert gt.iteration_ms(more_tok, u) >= base
        extra = gt.iteration_ms(np.append(c, 1), np.append(u, int(rng.integers(0, 4096))))
        assert extra >= base


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_token_curve_monotone_and_extrapolates(key: str) -> None:
    gt = load_ground_truth(key)
    n = np.arange(1, 20_000, 7)
    y = gt.token_curve(n)
    assert np.all(np.diff(y) >= 0)
    assert gt.iteration_ms(np.array([16384]), np.array([0])) > gt.iteration_ms(np.array([4096]), np.array([0]))


def test_batch_ms_matches_iteration_ms() -> None:
    gt = load_ground_truth("a100-tp2-llama2-7b")
    batches = random_batches(200, np.random.default_rng(2))
    batches.append((np.array([1, 0, 7]), np.array([10, 99, 0])))  # c = 0 entries are ignored
    batches.append((np.array([0]), np.array([5])))
    vec = gt.batch_ms(batches)
    one = [gt.iteration_ms(c, u) for c, u in batches]
    np.testing.assert_allclose(vec, one, rtol=1e-12)
    assert vec[-1] == 0.0
    parts = gt.components_ms(*batches[0])
    assert sum(parts.values()) == pytest.approx(one[0])


def test_tp2_faster_than_tp1_for_large_batches() -> None:
    tp1, tp2 = load_ground_truth("a100-tp1-llama3-8b"), load_ground_truth("a100-tp2-llama3-8b")
    for b in (_batch(0, 0, [2048], [0]), _batch(256, 2048, [], []), _batch(128, 1024, [1024], [512])):
        assert tp2.iteration_ms(*b) < 0.75 * tp1.iteration_ms(*b)


def test_h100_faster_than_a100() -> None:
    a100, h100 = load_ground_truth("a100-tp2-llama2-7b"), load_ground_truth("h100-tp2-llama2-7b")
    for c, u in random_batches(200, np.random.default_rng(4)):
        assert h100.iteration_ms(c, u) < a100.iteration_ms(c, u)


def test_tp1_has_no_allreduce_and_tp2_has() -> None:
    b = _batch(32, 1024, [512], [0])
    assert load_ground_truth("a100-tp1-llama3-8b").components_ms(*b)["allreduce"] == 0.0
    assert load_ground_truth("a100-tp2-llama3-8b").components_ms(*b)["allreduce"] > 0.0


# ------------------------------------------------------------------- noise
def test_noise_is_seeded_and_mean_one() -> None:
    gt = load_ground_truth("a100-tp2-llama2-7b")
    c, u = _batch(64, 1024, [256], [0])
    clean = gt.iteration_ms(c, u)
    a = [gt.iteration_ms(c, u, np.random.default_rng(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2] != clean
    rng = np.random.default_rng(8)
    noisy = np.array([gt.iteration_ms(c, u, rng) for _ in range(4000)])
    assert noisy.mean() == pytest.approx(clean, rel=0.005)
    assert np.std(np.log(noisy)) == pytest.approx(gt.noise_sigma, rel=0.1)
    assert gt.iteration_ms(c, u) == clean  # noise-free stays deterministic


# ----------------------------------------------------------------- profiles
def test_unknown_profile_lists_valid_keys() -> None:
    with pytest.raises(UnknownProfileError) as ei:
        load_ground_truth("tpu-v5-llama")
    msg = str(ei.value)
    assert "tpu-v5-llama" in msg and all(k in msg for k in PROFILES)
    assert isinstance(ei.value, KeyError)


def test_profiles_and_kv_capacity() -> None:
    assert set(PROFILES) >= {"a100-tp2-llama2-7b", "a100-tp1-llama3-8b", "a100-tp2-llama3-8b",
                             "h100-tp2-llama2-7b"}
    for key, p in PROFILES.items():
        assert isinstance(p, GPUProfile) and p.key == key and p.layers == 32
        assert p.block_size == 16 and p.kv_capacity_tokens % p.block_size == 0
        assert p.kv_capacity_tokens > 8 * p.max_model_len
    # GQA (8 kv heads) stores 4x fewer bytes per token than Llama-2's 32.
    assert PROFILES["a100-tp2-llama3-8b"].kv_capacity_tokens > 3 * PROFILES["a100-tp2-llama2-7b"].kv_capacity_tokens
    assert PROFILES["a100-tp2-llama3-8b"].kv_capacity_tokens > PROFILES["a100-tp1-llama3-8b"].kv_capacity_tokens
    assert load_ground_truth("a100-tp2-llama2-7b") is load_ground_truth("a100-tp2-llama2-7b")


def test_iteration_ms_is_fast() -> None:
    gt = load_ground_truth("a100-tp2-llama2-7b")
    rng = np.random.default_rng(0)
    c = np.array([1] * 96 + [300, 512, 64, 1000])
    u = rng.integers(0, 3000, 100)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(2000):
            gt.iteration_ms(c, u, rng)
        best = max(best, 2000 / (time.perf_counter() - t0))
    print(f"\niteration_ms: {best:,.0f} calls/s (batch of 100)")
    assert best >= 10_000
