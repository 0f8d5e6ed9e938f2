"""Workloads for the simulated engine: real request lengths, synthetic arrivals, SLOs.

Named workloads: ``sharegpt``, ``arxiv`` (the v2 trace here), ``mixed-v1``
(ShareGPT:arXiv 3:1), ``mixed-v2`` (5:1), and ``code``: a code-completion-like
shape (long prompts, short answers) made of the *real* (prompt, output) pairs
of both traces whose prompt has 1,024–4,096 tokens and whose output has at
most 64 (2,391 pairs: prompt median ≈ 2.6k, output median ≈ 47 tokens; no
length is synthetic, only the selection).  Any other name is read as a CSV
path with ``num_prefill_tokens,num_decode_tokens`` and an optional
``arrived_at`` column.

SLOs (formula (1)).  Every request gets

* TTFT SLO = ``ttft_base_s + ttft_per_token_s × prompt_tokens`` — a fixed part
  for queueing plus a part proportional to the prompt, because a long prompt
  cannot be prefilled as fast as a short one on any scheduler;
* TBT SLO = ``tbt_s``;
* a *protected* class (fraction ``protected_fraction``) flagged g_i = 1,
  with its TTFT SLO scaled by ``protected_ttft_scale`` (tighter).

With ``SLOConfig(definition="tpot")`` every request is judged instead the way
``vllm bench serve --goodput ttft:…,tpot:…`` judges it: TTFT within its TTFT SLO and the
mean time per output token after the first within ``tbt_s`` (its ``tpot_slo``).

How the defaults were chosen: on the default profile (A100 TP2 Llama-2-7B)
an unloaded engine prefills ≈ 20k tokens/s (0.05 ms/token) and runs a decode
iteration in ≈ 15–25 ms.  TTFT = 0.3 s + 0.15 ms/token gives a prompt three
times its unloaded prefill time plus 0.3 s of queueing (a 2,000-token prompt:
0.6 s); TBT = 50 ms (the paper's setting) is 2–3 loaded iterations.  Every
policy meets them at low load (checked by ``tests/test_workloads.py``).  With
looser SLOs (we first tried 0.5 s + 0.4 ms/token, 100 ms) every policy keeps
its SLOs up to the engine's raw capacity and then all fail together, so the
comparison only measures throughput; with these, chunk sizes and order
decide who meets the SLOs well below raw capacity.  Change them with
``SLOConfig``.

SLO classes (docs/usage.md).  ``classes=`` draws a class per request from a
:class:`ClassMix`: its priority (smaller is served first), whether it is
sheddable, scales on the TTFT and TBT SLOs above, and optionally an end-to-end
objective (``e2e_s``: the last token within that many seconds of arrival; 0 = none,
the default, as in every built-in mix).  The built-in mix
``interactive-batch`` (:data:`CLASS_MIXES`) is 20% *critical* interactive
(priority 0), 50% *standard* (priority 1) and 30% sheddable *batch* (priority
2, TTFT ×4 and TBT ×2); a met request counts 4, 2 and 1 in the weighted goodput.
The class draw uses its own random stream, so a workload with classes has the
same arrivals, lengths and base SLOs as without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine_adapter.data.traces import load_trace
from engine_adapter.sim.engine import Workload
from scheduler_service.core.snapshot import MAX_SECONDS

__all__ = ["CLASS_MIXES", "DEFINITIONS", "MIXES", "Burst", "ClassMix", "SLOClass", "SLOConfig", "make_workload", "workload_names"]

#: The SLO definitions a workload's requests can be judged by (:class:`SLOConfig`).
DEFINITIONS = ("formula1", "tpot")

#: Named mixes: trace → weight.
MIXES: dict[str, dict[str, float]] = {
    "sharegpt": {"sharegpt": 1.0},
    "arxiv": {"arxiv": 1.0},
    "mixed-v1": {"sharegpt": 3.0, "arxiv": 1.0},
    "mixed-v2": {"sharegpt": 5.0, "arxiv": 1.0},
}


#: Named selections of real requests: the pairs of these traces whose prompt
#: length lies in ``prompt`` (inclusive) and whose output is at most ``max_output``.
SHAPES: dict[str, dict[str, object]] = {
    "code": {"traces": ("sharegpt", "arxiv"), "prompt": (1024, 4096), "max_output": 64},
}
MIXES.update({name: {} for name in SHAPES})  # listed with the mixes; sampled by _shape


def workload_names() -> list[str]:
    return list(MIXES)


def _shape(name: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    spec = SHAPES[name]
    lo, hi = spec["prompt"]  # type: ignore[misc]
    ps, ds = [], []
    for tname in spec["traces"]:  # type: ignore[attr-defined]
        t = load_trace(tname)
        keep = (t.prefill >= lo) & (t.prefill <= hi) & (t.decode <= spec["max_output"])  # type: ignore[operator]
        ps.append(t.prefill[keep])
        ds.append(t.decode[keep])
    prompt, output = np.concatenate(ps), np.concatenate(ds)
    idx = np.random.default_rng(seed * 7919).integers(0, len(prompt), n)
    return prompt[idx], output[idx]


@dataclass(frozen=True, slots=True)
class SLOConfig:
    ttft_base_s: float = 0.3
    ttft_per_token_s: float = 0.00015
    tbt_s: float = 0.05
    protected_fraction: float = 0.1
    protected_ttft_scale: float = 0.5
    #: How a request is judged: ``"formula1"`` (every token by its cumulative deadline) or
    #: ``"tpot"`` (TTFT, then the mean time per output token: ``tbt_s`` is its TPOT objective).
    definition: str = "formula1"

    def __post_init__(self) -> None:
        if self.ttft_base_s <= 0 or self.ttft_per_token_s < 0 or self.tbt_s <= 0:
            raise ValueError("SLOs must be positive")
        if self.definition not in DEFINITIONS:
            raise ValueError(f"unknown SLO definition {self.definition!r}; valid: {', '.join(DEFINITIONS)}")
        if not 0 <= self.protected_fraction <= 1 or not 0 < self.protected_ttft_scale:
            raise ValueError("protected_fraction must be in [0, 1] and protected_ttft_scale > 0")


@dataclass(frozen=True, slots=True)
class SLOClass:
    """One request class of a :class:`ClassMix`."""

    name: str
    fraction: float
    priority: int = 0
    sheddable: bool = False
    ttft_scale: float = 1.0
    tbt_scale: float = 1.0
    #: Weight of a met request of this class in the weighted goodput.
    weight: float = 1.0
    #: End-to-end objective (seconds after arrival for the last token); 0 = none.
    e2e_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or self.fraction < 0 or self.ttft_scale <= 0 or self.tbt_scale <= 0 or self.weight < 0:
            raise ValueError(f"class {self.name!r}: a name, fraction >= 0, positive SLO scales and weight >= 0 "
                             "are needed")
        if not (math.isfinite(self.e2e_s) and 0 <= self.e2e_s <= MAX_SECONDS):
            raise ValueError(f"class {self.name!r}: e2e_s must be finite and >= 0 (0 = none), got {self.e2e_s!r}")


@dataclass(frozen=True, slots=True)
class ClassMix:
    """Request classes and their shares (fractions are normalised)."""

    classes: tuple[SLOClass, ...]

    def __post_init__(self) -> None:
        if not self.classes or sum(c.fraction for c in self.classes) <= 0:
            raise ValueError("a class mix needs at least one class with a positive fraction")
        if len({c.name for c in self.classes}) != len(self.classes):
            raise ValueError("class names must be unique")

    def draw(self, m: int, seed: int) -> np.ndarray:
        """The class index of each of ``m`` requests (its own stream: see the module)."""
        w = np.array([c.fraction for c in self.classes], dtype=np.float64)
        return np.random.default_rng([seed, 0x51A55]).choice(len(w), m, p=w / w.sum())


#: Named class mixes for ``make_workload(classes=...)`` and ``slidingserve bench --classes``.
CLASS_MIXES: dict[str, ClassMix] = {
    "interactive-batch": ClassMix((
        SLOClass("critical", 0.2, priority=0, weight=4.0),
        SLOClass("standard", 0.5, priority=1, weight=2.0),
        SLOClass("batch", 0.3, priority=2, sheddable=True, ttft_scale=4.0, tbt_scale=2.0, weight=1.0),
    )),
}


@dataclass(frozen=True, slots=True)
class Burst:
    """Transient overload: the rate is ``multiplier``× the base rate from
    ``start_s`` for ``duration_s`` seconds."""

    start_s: float = 20.0
    duration_s: float = 10.0
    multiplier: float = 3.0


def _arrivals(n: int, rate: float, rng: np.random.Generator, burst: Burst | None) -> np.ndarray:
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if burst is None:
        return np.cumsum(rng.exponential(1.0 / rate, n))
    # Piecewise-constant Poisson process: draw unit-rate gaps and map them
    # through the integrated rate Λ(t).
    lam = np.cumsum(rng.exponential(1.0, n))
    b0, b1, m = burst.start_s, burst.start_s + burst.duration_s, burst.multiplier
    at_b0, at_b1 = rate * b0, rate * b0 + m * rate * (b1 - b0)
    return np.where(
        lam <= at_b0,
        lam / rate,
        np.where(lam <= at_b1, b0 + (lam - at_b0) / (m * rate), b1 + (lam - at_b1) / rate),
    )


def make_workload(
    name: str,
    n: int,
    rate: float,
    seed: int,
    slo: SLOConfig | None = None,
    burst: Burst | None = None,
    use_trace_arrivals: bool = False,
    classes: ClassMix | str | None = None,
) -> Workload:
    """``n`` requests of workload ``name`` arriving at ``rate`` requests/s; ``classes``: a
    :class:`ClassMix` or a name in :data:`CLASS_MIXES` (None: every request priority 0)."""
    slo = slo or SLOConfig()
    if isinstance(classes, str):
        if classes not in CLASS_MIXES:
            raise ValueError(f"unknown class mix {classes!r}; known: {', '.join(sorted(CLASS_MIXES))}")
        classes = CLASS_MIXES[classes]
    rng = np.random.default_rng(seed)
    prompt, output, arrival = _lengths_and_arrivals(name, n, rate, seed, rng, burst, use_trace_arrivals)
    m = len(arrival)
    order = np.argsort(arrival, kind="stable")
    arrival, prompt, output = arrival[order], prompt[order], output[order]
    protected = rng.uniform(0, 1, m) < slo.protected_fraction
    ttft = slo.ttft_base_s + slo.ttft_per_token_s * prompt
    ttft = np.where(protected, ttft * slo.protected_ttft_scale, ttft)
    tbt = np.full(m, slo.tbt_s)
    priority = sheddable = e2e = None
    if classes is not None:
        ttft, tbt, priority, sheddable, e2e = _class_columns(classes, seed, ttft, tbt)
    return Workload(
        arrival=arrival.astype(np.float64),
        prompt_tokens=prompt.astype(np.int64),
        output_tokens=output.astype(np.int64),
        ttft_slo=ttft.astype(np.float64),
        tbt_slo=tbt,
        protected=protected,
        name=name,
        priority=priority,
        sheddable=sheddable,
        e2e_slo=e2e,
        tpot_slo=tbt.copy() if slo.definition == "tpot" else None,
    )


def _lengths_and_arrivals(name: str, n: int, rate: float, seed: int, rng: np.random.Generator,
                          burst: Burst | None, use_trace_arrivals: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt and output lengths and arrival times of a shape, a CSV trace or a mix of traces."""
    mix = MIXES.get(name)
    if name in SHAPES:
        prompt, output = _shape(name, n, seed)
        return prompt, output, _arrivals(n, rate, rng, burst)
    if mix is None:  # a CSV path
        trace = load_trace(name)
        idx = rng.integers(0, len(trace), n) if not use_trace_arrivals else np.arange(min(n, len(trace)))
        if not use_trace_arrivals:
            return trace.prefill[idx], trace.decode[idx], _arrivals(len(idx), rate, rng, burst)
        if trace.arrived_at is None:
            raise ValueError(f"{name} has no arrived_at column")
        return trace.prefill[idx], trace.decode[idx], trace.arrived_at[idx] - trace.arrived_at[idx].min()
    names = list(mix)
    weights = np.array([mix[k] for k in names])
    which = rng.choice(len(names), n, p=weights / weights.sum())
    prompt = np.empty(n, dtype=np.int64)
    output = np.empty(n, dtype=np.int64)
    for k, tname in enumerate(names):
        sel = np.flatnonzero(which == k)
        p, d = load_trace(tname).sample(len(sel), seed * 7919 + k)
        prompt[sel], output[sel] = p, d
    return prompt, output, _arrivals(n, rate, rng, burst)


def _class_columns(classes: ClassMix, seed: int, ttft: np.ndarray, tbt: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each request's class drawn from ``classes``: its scaled TTFT and TBT objectives, its
    priority, whether it may be shed, and its end-to-end objective."""
    k = classes.draw(len(ttft), seed)
    table = classes.classes
    return (ttft * np.array([c.ttft_scale for c in table])[k], tbt * np.array([c.tbt_scale for c in table])[k],
            np.array([c.priority for c in table], np.int64)[k], np.array([c.sheddable for c in table], np.bool_)[k],
            np.array([c.e2e_s for c in table], np.float64)[k])
