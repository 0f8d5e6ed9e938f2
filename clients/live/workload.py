"""Requests of one live run: bundled trace lengths, clipped to the engine, Poisson arrivals.

Same ``(seed, rate)`` = same requests and same arrival times for every configuration, so
policies are compared seed by seed on identical arrivals.  The first ``warmup`` requests
run (at the same rate) but are not measured: they let a switched policy load and the
predictor see the engine before the measured requests arrive.

``shared_prefix`` > 0 puts the same tokens (a system prompt) before every prompt, for runs
with vLLM's prefix caching on: the requests are otherwise those of ``shared_prefix`` 0 (same
lengths after the prefix, same arrivals), and the prefix is the same for every seed.

``turns`` > 1 makes the requests multi-turn chats: conversations start at Poisson rate
``rate / turns`` (so that requests still come at about ``rate`` req/s), each of ``turns``
requests.  A conversation's first request is sent at its start; each later one is sent a
seeded think time (exponential, mean ``think_s``) after the one before it finished, with the
whole history as its prompt: the previous prompt, the tokens the engine returned for it,
then the new user message (a trace prompt length, clipped to ``max_prompt``).  With prefix
caching on, the history is what the cache may hold.  The conversations and think times are
the same for every configuration; when each later turn is sent depends on how fast the
engine answered the one before, as it does for a chat user.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    #: Requests per conversation (multi-turn chat); 1 = independent requests.
    turns: int = 1
    #: Mean think time (s) between a turn's last token and the conversation's next request.
    think_s: float = 1.0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.warmup < 0:
            raise ValueError(f"requests must be >= 1 and warmup >= 0, got {self.requests}, {self.warmup}")
        if not 1 <= self.min_output <= self.max_output or self.max_prompt < 1:
            raise ValueError("need 1 <= min_output <= max_output and max_prompt >= 1")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be >= 0, got {self.shared_prefix}")
        if self.turns < 1 or not self.think_s >= 0:
            raise ValueError(f"turns must be >= 1 and think_s >= 0, got {self.turns}, {self.think_s}")

    def longest_request(self) -> int:
        """The most tokens one request can hold, prompt and output: the shared prefix, then
        every turn's user message and output."""
        return self.shared_prefix + self.turns * (self.max_prompt + self.max_output)


@dataclass(frozen=True, slots=True)
class LiveRequest:
    index: int
    #: Seconds after the run's start at which the request is sent (a later turn of a
    #: conversation: when its conversation started).
    at_s: float
    #: The prompt; a later turn's new user message only (the client puts the history first).
    prompt: tuple[int, ...]
    output_len: int
    #: Warm-up requests run but are not measured.
    warmup: bool
    #: A later turn: the index of its conversation's previous request (-1: none), sent
    #: ``think_s`` after that one finished.
    prev: int = -1
    think_s: float = 0.0


def make_requests(spec: WorkloadSpec, rate: float, seed: int) -> list[LiveRequest]:
    """``spec.warmup + spec.requests`` requests at Poisson ``rate`` req/s, seeded."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if spec.turns > 1:
        return _chats(spec, rate, seed)
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


def _chats(spec: WorkloadSpec, rate: float, seed: int) -> list[LiveRequest]:
    """Multi-turn conversations (module docstring): request ``c * turns + k`` is turn k of
    conversation c, so that the warm-up requests are the first conversations' turns.  The
    lengths and tokens are those of the single-turn requests of the same seed."""
    one = make_requests(replace(spec, turns=1), rate, seed)
    rng = np.random.default_rng([seed, 15485863])
    n_conv = -(-len(one) // spec.turns)
    gaps = rng.exponential(spec.turns / rate, n_conv)
    starts = np.cumsum(gaps) - gaps[0]
    think = rng.exponential(spec.think_s, len(one)) if spec.think_s > 0 else np.zeros(len(one))
    out = []
    for i, r in enumerate(one):
        first = i % spec.turns == 0
        # a later turn's message goes without the system prompt: its history starts with it
        out.append(LiveRequest(r.index, float(starts[i // spec.turns]),
                               r.prompt if first else r.prompt[spec.shared_prefix:], r.output_len, r.warmup,
                               -1 if first else i - 1, 0.0 if first else float(think[i])))
    return out
