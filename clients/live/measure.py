"""What one live run measured, under the two SLO definitions users meet.

* **formula (1)** (the paper's, what the policies plan for): token k of request i is due
  at ``a_i + TTFT + k * TBT``; a request is within SLO when every token is on time.
* **TTFT+TPOT** (``vllm bench serve --goodput ttft:X tpot:Y``, AIPerf): a request is good
  when its TTFT <= X and its mean time per output token after the first,
  ``(t_last - t_first) / (n - 1)``, is <= Y.

A request that failed or returned fewer tokens than asked misses under both.  Goodput over
a rate sweep is the highest rate whose attainment is at least a threshold, interpolated
linearly between the two swept rates around the crossing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestResult", "RunSummary", "Slo", "goodput", "summarize"]


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 1000.0
    tbt_ms: float = 50.0

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tbt_ms > 0):
            raise ValueError(f"SLOs must be > 0, got ttft {self.ttft_ms} ms, tbt {self.tbt_ms} ms")


@dataclass(slots=True)
class RequestResult:
    index: int
    #: monotonic time the request was sent (its arrival)
    sent: float
    output_len: int
    #: monotonic time of every output token (tokens of one chunk share its time)
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    #: monotonic time it was due (``sent`` minus this: how late the client's event loop sent it)
    due: float = math.nan
    #: What went and came back, kept for a multi-turn chat's next turn (its history).
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.error is None and len(self.token_times) >= self.output_len

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent if self.token_times else math.inf

    @property
    def tpot_s(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    def ok_formula1(self, slo: Slo) -> bool:
        if not self.complete:
            return False
        k = np.arange(len(self.token_times))
        due = self.sent + slo.ttft_ms / 1e3 + k * (slo.tbt_ms / 1e3)
        return bool(np.all(np.asarray(self.token_times) <= due))

    def ok_tpot(self, slo: Slo) -> bool:
        return self.complete and self.ttft_s <= slo.ttft_ms / 1e3 and self.tpot_s <= slo.tbt_ms / 1e3


@dataclass(frozen=True, slots=True)
class RunSummary:
    requests: int
    completed: int
    errors: int
    attain_f1: float
    attain_tpot: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    tpot_max_ms: float
    duration_s: float
    #: good requests (TTFT+TPOT) per second of the run: the figure `vllm bench serve` calls goodput
    good_rps_tpot: float
    first_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if len(values) else math.nan


def summarize(results: Sequence[RequestResult], slo: Slo) -> RunSummary:
    """The summary of one run's measured requests."""
    if not results:
        raise ValueError("no measured requests")
    done = [r for r in results if r.complete]
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for r in done if len(r.token_times) > 1]
    start = min(r.sent for r in results)
    end = max((r.token_times[-1] for r in results if r.token_times), default=start)
    duration = max(end - start, 1e-9)
    good_tpot = sum(r.ok_tpot(slo) for r in results)
    errors = [r for r in results if r.error is not None]
    return RunSummary(
        requests=len(results), completed=len(done), errors=len(errors),
        attain_f1=sum(r.ok_formula1(slo) for r in results) / len(results),
        attain_tpot=good_tpot / len(results),
        ttft_p50_ms=_pct(ttft, 50), ttft_p99_ms=_pct(ttft, 99), ttft_max_ms=_pct(ttft, 100),
        tpot_p50_ms=_pct(tpot, 50), tpot_p99_ms=_pct(tpot, 99), tpot_max_ms=_pct(tpot, 100),
        duration_s=duration, good_rps_tpot=good_tpot / duration,
        first_error=errors[0].error if errors else None,
    )


def goodput(rates: Sequence[float], attainment: Sequence[float], threshold: float) -> float:
    """The highest rate at which attainment >= ``threshold``, linearly interpolated at the
    first crossing; 0 when the lowest rate already misses it, the highest rate when none does."""
    if len(rates) != len(attainment) or not rates:
        raise ValueError("need one attainment per rate")
    order = np.argsort(rates)
    r = np.asarray(rates, dtype=float)[order]
    a = np.asarray(attainment, dtype=float)[order]
    if a[0] < threshold:
        return 0.0
    for j in range(1, len(r)):
        if a[j] < threshold:
            return float(r[j - 1] + (r[j] - r[j - 1]) * (a[j - 1] - threshold) / (a[j - 1] - a[j]))
    return float(r[-1])
