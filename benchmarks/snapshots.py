"""Benchmark snapshots built from the real ShareGPT trace (shared by the benchmarks)."""

from __future__ import annotations

import numpy as np

from engine_adapter.data.traces import load_trace
from scheduler_service.core import Snapshot


def busy_snapshot(
    n_decode: int = 256, n_queued: int = 512, seed: int = 0, max_batch_tokens: int = 2048,
    ttft_slo: float = 2.0, tbt_slo: float = 0.2,
) -> Snapshot:
    """A loaded engine: ``n_decode`` running decodes and ``n_queued`` waiting or
    prefilling requests (a quarter part-way through their prompt), lengths
    from ShareGPT, arrivals over the last 10 s, mixed SLOs."""
    rng = np.random.default_rng(seed)
    trace = load_trace("sharegpt")
    n = n_decode + n_queued
    prompt, _ = trace.sample(n, seed)
    now = 100.0
    arrival = np.empty(n)
    computed = np.zeros(n, dtype=np.int64)
    output = np.zeros(n, dtype=np.int64)
    # decodes: arrived earlier, have produced some tokens
    # decodes: arrived earlier, each a little ahead of its next token deadline
    arrival[:n_decode] = now - rng.uniform(2.0, 10.0, n_decode)
    computed[:n_decode] = prompt[:n_decode]
    ttft = rng.choice([0.5 * ttft_slo, ttft_slo, 4 * ttft_slo], n)
    ahead = rng.uniform(0.6 * tbt_slo, 3 * tbt_slo, n_decode)
    k = np.ceil((now - arrival[:n_decode] - ttft[:n_decode] + ahead) / tbt_slo)
    output[:n_decode] = np.maximum(1, k).astype(np.int64)
    arrival[n_decode:] = now - rng.uniform(0.0, 3.0, n_queued)
    started = rng.uniform(0, 1, n_queued) < 0.25
    part = (rng.uniform(0, 1, n_queued) * prompt[n_decode:]).astype(np.int64)
    computed[n_decode:] = np.where(started, part, 0)
    return Snapshot.from_columns(
        now=now, max_batch_tokens=max_batch_tokens, max_num_seqs=1024, free_kv_tokens=400_000,
        ids=[f"r{i}" for i in range(n)], arrival=arrival, prompt_tokens=prompt,
        computed_tokens=computed, output_tokens=output, ttft_slo=ttft,
        tbt_slo=np.full(n, tbt_slo), protected=rng.uniform(0, 1, n) < 0.05,
    )
