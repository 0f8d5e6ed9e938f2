"""Keyword-default factories for policy-core tests (in the spirit of vLLM's
``create_requests``).  Everything is deterministic; random helpers take a seed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scheduler_service.core import BatchLatencyPredictor, LinearModel, Request, Snapshot

ZERO7 = (0.0,) * 7


def waiting(id: str, prompt: int = 100, *, arrival: float = 0.0, ttft: float = 1.0, tbt: float = 0.1,
            protected: bool = False) -> Request:
    return Request(id=id, arrival=arrival, prompt_tokens=prompt, computed_tokens=0, output_tokens=0,
                   ttft_slo=ttft, tbt_slo=tbt, protected=protected)


def prefilling(id: str, prompt: int = 100, computed: int = 50, *, arrival: float = 0.0, ttft: float = 1.0,
               tbt: float = 0.1, protected: bool = False) -> Request:
    assert 0 < computed < prompt
    return Request(id=id, arrival=arrival, prompt_tokens=prompt, computed_tokens=computed, output_tokens=0,
                   ttft_slo=ttft, tbt_slo=tbt, protected=protected)


def decoding(id: str, prompt: int = 100, output: int = 1, *, arrival: float = 0.0, ttft: float = 1.0,
             tbt: float = 0.1, protected: bool = False) -> Request:
    assert output >= 1
    return Request(id=id, arrival=arrival, prompt_tokens=prompt, computed_tokens=prompt, output_tokens=output,
                   ttft_slo=ttft, tbt_slo=tbt, protected=protected)


def create_requests(num_requests: int, *, prompt_tokens: int | Sequence[int] = 100, arrival: float = 0.0,
                    arrival_step: float = 0.001, ttft_slo: float = 1.0, tbt_slo: float = 0.1,
                    prefix: str = "r") -> list[Request]:
    """``num_requests`` waiting requests arriving ``arrival_step`` apart."""
    prompts = [prompt_tokens] * num_requests if isinstance(prompt_tokens, int) else list(prompt_tokens)
    assert len(prompts) == num_requests
    return [waiting(f"{prefix}{i}", p, arrival=arrival + i * arrival_step, ttft=ttft_slo, tbt=tbt_slo)
            for i, p in enumerate(prompts)]


def make_snapshot(requests: Sequence[Request] = (), *, now: float = 0.0, max_batch_tokens: int = 2048,
                  max_num_seqs: int = 256, free_kv_tokens: int | None = None,
                  prefill_throughput: float | None = None, **kw: Any) -> Snapshot:
    return Snapshot.from_requests(requests, now=now, max_batch_tokens=max_batch_tokens,
                                  max_num_seqs=max_num_seqs, free_kv_tokens=free_kv_tokens,
                                  prefill_throughput=prefill_throughput, **kw)


def linear_model(intercept_ms: float = 0.0, **w: float) -> LinearModel:
    """``linear_model(1.0, x4=0.5, x6=0.01)``: named weights x1..x7, others 0."""
    weights = [0.0] * 7
    for k, v in w.items():
        weights[int(k[1:]) - 1] = float(v)
    return LinearModel(float(intercept_ms), tuple(weights))


def make_predictor(global_model: LinearModel | None = None, *, decode: LinearModel | None = None,
                   prefill: LinearModel | None = None, mixed: LinearModel | None = None) -> BatchLatencyPredictor:
    g = global_model if global_model is not None else linear_model(1.0, x4=0.05, x6=0.01)
    return BatchLatencyPredictor(scenarios={"decode": decode, "prefill": prefill, "mixed": mixed},
                                 global_model=g)


def token_predictor(intercept_ms: float = 1.0, per_token_ms: float = 0.01, per_decode_ms: float = 0.05
                    ) -> BatchLatencyPredictor:
    """Monotone, easy to compute by hand: t = a + per_decode·|D| + per_token·Σ_P c."""
    return make_predictor(linear_model(intercept_ms, x4=per_decode_ms, x6=per_token_ms))


def random_predictor(seed: int, *, allow_negative: bool = False) -> BatchLatencyPredictor:
    """Per-scenario random models; with ``allow_negative`` they are non-monotone."""
    rng = np.random.default_rng(seed)
    scale = np.array([1e-6, 1e-6, 1e-5, 0.05, 1e-5, 0.01, 0.002])

    def one() -> LinearModel:
        w = rng.uniform(-1.0 if allow_negative else 0.0, 1.0, 7) * scale
        return LinearModel(float(rng.uniform(0.5, 5.0)), tuple(float(x) for x in w))

    return BatchLatencyPredictor(scenarios={"decode": one(), "prefill": one(), "mixed": one()},
                                 global_model=one())


def random_snapshot(seed: int, *, n: int = 8, now: float = 10.0, max_prompt: int = 40,
                    max_batch_tokens: int = 48, max_num_seqs: int = 256, free_kv_tokens: int | None = None,
                    decode_frac: float = 0.4, prefill_throughput: float | None = 1000.0) -> Snapshot:
    """A small random valid snapshot; slacks spread around zero."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        p = int(rng.integers(1, max_prompt + 1))
        arrival = float(now - rng.uniform(0.0, 1.0))
        ttft = float(rng.uniform(0.05, 1.5))
        tbt = float(rng.uniform(0.01, 0.2))
        kind = rng.random()
        if kind < decode_frac:
            reqs.append(decoding(f"q{i}", p, int(rng.integers(1, 20)), arrival=arrival, ttft=ttft, tbt=tbt))
        elif kind < decode_frac + 0.2 and p > 1:
            reqs.append(prefilling(f"q{i}", p, int(rng.integers(1, p)), arrival=arrival, ttft=ttft, tbt=tbt))
        else:
            reqs.append(waiting(f"q{i}", p, arrival=arrival, ttft=ttft, tbt=tbt,
                                protected=bool(rng.random() < 0.15)))
    return make_snapshot(reqs, now=now, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                         free_kv_tokens=free_kv_tokens, prefill_throughput=prefill_throughput)


def brute_batch_features(cu: Sequence[tuple[float, float]]) -> np.ndarray:
    """Formulas (4)–(6) by a plain loop (the oracle for vectorised code)."""
    x = [0.0] * 7
    for c, u in cu:
        if c > 1:
            x[0] += c * (u + c)
            x[1] += c * c
            x[5] += c
            x[6] = max(x[6], c)
        else:
            x[3] += 1
            x[4] += u
        x[2] += u
    return np.array(x)


def explicit_segment(snap: Snapshot, decodes: Sequence[int] | np.ndarray, queue: Sequence[int] | np.ndarray,
                     X: int, Y: int, step: int = 0) -> list[tuple[int, int]]:
    """(c, u) of every request of the batch "decodes (``step`` tokens longer)
    + stream segment [X, Y)" of ``queue``, built request by request."""
    cu = [(1, int(snap.kv_tokens[d]) + step) for d in np.asarray(decodes).tolist()]
    start = 0
    for i in np.asarray(queue).tolist():
        r = int(snap.prompt_tokens[i] - snap.computed_tokens[i])
        lo, hi = max(X, start), min(Y, start + r)
        if hi > lo:
            cu.append((hi - lo, int(snap.computed_tokens[i]) + (lo - start)))
        start += r
    return cu


def predict_cu(pred: BatchLatencyPredictor, cu: Sequence[tuple[int, int]]) -> float:
    """Predicted ms of an explicit batch; 0 for the empty batch."""
    if not cu:
        return 0.0
    return pred.predict_batch_ms(np.array([c for c, _ in cu]), np.array([u for _, u in cu]))


def dyadic_predictor(seed: int, *, allow_negative: bool = False) -> BatchLatencyPredictor:
    """Coefficients that are small dyadic rationals: every prediction of an
    integer batch is exact in float64, so two ways of summing agree bit for bit
    and ties are real ties."""
    rng = np.random.default_rng(seed)
    denom = np.array([2.0**16, 2.0**16, 2.0**12, 8.0, 2.0**12, 64.0, 64.0])

    def one() -> LinearModel:
        k = rng.integers(-4 if allow_negative else 0, 9, 7)
        return LinearModel(float(rng.integers(1, 5)) / 2, tuple(float(v) for v in k / denom))

    return BatchLatencyPredictor(scenarios={"decode": one(), "prefill": one(), "mixed": one()},
                                 global_model=one())
