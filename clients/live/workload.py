"""Requests of one live run: bundled trace lengths, clipped to the engine, Poisson arrivals.

Same ``(seed, rate)`` = same requests and same arrival times for every configuration, so
policies are compared seed by seed on identical arrivals.  The first ``warmup`` requests
run (at the same rate) but are not measured: they let a switched policy load and the
predictor see the engine before the measured requests arrive.

``shared_prefix`` > 0 puts the same tokens (a system prompt) before every prompt, for runs
with vLLM's prefix caching on: the requests are otherwise those of ``shared_prefix`` 0 (same
lengths after the prefix, same arrivals), and the prefix is the same for every seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_adapter.data.traces import load_trace

__all__ = ["LiveRequest", "WorkloadSpec", "make_requests"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    trace: str = "sharegpt"
    requests: int = 120
    warmup: int = 40
    max_prompt: int = 1024
    max_output: int = 128
    #: Outputs shorter than this are lengthened to it (TPOT needs two tokens).
    min_output: int = 2
    vocab_size: int = 2048
    #: Tokens of a common prefix (a system prompt) before every prompt; 0 = none.
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.warmup < 0:
            raise ValueError(f"requests must be >= 1 and warmup >= 0, got {self.requests}, {self.warmup}")
        if not 1 <= self.min_output <= self.max_output or self.max_prompt < 1:
            raise ValueError("need 1 <= min_output <= max_output and max_prompt >= 1")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be >= 0, got {self.shared_prefix}")


@dataclass(frozen=True, slots=True)
class LiveRequest:
    index: int
    #: Seconds after the run's start at which the request is sent.
    at_s: float
    prompt: tuple[int, ...]
    output_len: int
    #: Warm-up requests run but are not measured.
    warmup: bool


def make_requests(spec: WorkloadSpec, rate: float, seed: int) -> list[LiveRequest]:
    """``spec.warmup + spec.requests`` requests at Poisson ``rate`` req/s, seeded."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    n = spec.warmup + spec.requests
    prefill, decode = load_trace(spec.trace).sample(n, seed)
    rng = np.random.default_rng([seed, 7919])
    gaps = rng.exponential(1.0 / rate, n)
    at = np.cumsum(gaps) - gaps[0]
    prompts = np.clip(prefill, 1, spec.max_prompt).astype(int)
    outputs = np.clip(decode, spec.min_output, spec.max_output).astype(int)
    # token ids 3.. (0-2 are the tokenizer's special tokens); content is irrelevant to the
    # timing without prefix caching, and seeded so that runs repeat exactly
    ids = rng.integers(3, spec.vocab_size, int(prompts.sum()))
    # the system prompt: its own stream, so that the rest is as without it
    prefix = tuple(int(t) for t in np.random.default_rng(104729).integers(3, spec.vocab_size, spec.shared_prefix))
    out, pos = [], 0
    for i in range(n):
        p = int(prompts[i])
        out.append(LiveRequest(i, float(at[i]), prefix + tuple(int(t) for t in ids[pos:pos + p]), int(outputs[i]),
                               i < spec.warmup))
        pos += p
    return out
