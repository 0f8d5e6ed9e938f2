"""vLLM queues → :class:`~scheduler_service.core.Snapshot` (duck-typed; no vLLM import).

vLLM tracks a request as ``num_tokens`` known tokens (prompt + outputs) of
which ``num_computed_tokens`` are in the KV cache; with async scheduling the
in-flight step is already counted as computed and its sampled token is a
*placeholder* (``num_output_placeholders``).  The snapshot model (ARCHITECTURE
§3) has prompt/computed/output columns instead, so each request maps to:

* **decode** — it has (or is sampling) an output and needs exactly one more
  token: ``prompt = computed = P``, ``output = outputs + placeholders``;
* **prefill** — everything else needs ``known − computed`` tokens before it
  samples: ``prompt = known``, ``computed = num_computed_tokens``,
  ``output = 0``.  A preempted request (vLLM recomputes prompt *and* outputs)
  is therefore a prefill of all its known tokens; its TTFT deadline has long
  passed, so SLO-aware policies treat it as expired (served, not prioritised).

Requests vLLM would not schedule at all this step (async: the in-flight step
already reaches ``max_tokens``) are left out, so a plan cannot name them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_service.core import Snapshot

__all__ = ["RequestSlo", "SloDefaults", "SnapshotBuilder", "request_slo"]


@dataclass(frozen=True, slots=True)
class SloDefaults:
    #: TTFT for requests without one; 0 = ``ttft_base_s + ttft_per_token_s × prompt``.
    ttft_s: float = 0.0
    tbt_s: float = 0.05
    ttft_base_s: float = 0.3
    ttft_per_token_s: float = 0.00015


@dataclass(frozen=True, slots=True)
class RequestSlo:
    ttft_s: float
    tbt_s: float
    protected: bool


def _positive(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 and f == f and f != float("inf") else None


def request_slo(extra_args: Any, prompt_tokens: int, defaults: SloDefaults) -> RequestSlo:
    """SLOs from ``SamplingParams.extra_args`` (``slo_ttft_ms``, ``slo_tbt_ms``,
    ``slo_protected``; a nested ``{"slo": {"ttft_ms", "tbt_ms", "protected"}}`` works
    too), else the defaults.  Malformed values fall back to the defaults: a client
    must not be able to break the engine's scheduling with a bad field."""
    ttft = tbt = None
    protected: Any = False
    if isinstance(extra_args, dict) and extra_args:
        nested = extra_args.get("slo")
        src = nested if isinstance(nested, dict) else extra_args
        pre = "" if src is nested else "slo_"
        ttft = _positive(src.get(pre + "ttft_ms"))
        tbt = _positive(src.get(pre + "tbt_ms"))
        protected = src.get(pre + "protected", False)
    if ttft is None:
        ttft_s = defaults.ttft_s or defaults.ttft_base_s + defaults.ttft_per_token_s * prompt_tokens
    else:
        ttft_s = ttft / 1e3
    prot = protected in (True, 1, "1", "true", "True", "yes")
    return RequestSlo(ttft_s, (tbt / 1e3) if tbt is not None else defaults.tbt_s, prot)


class SnapshotBuilder:
    """Builds one snapshot per iteration; SLOs are parsed once per request and cached."""

    def __init__(self, defaults: SloDefaults, profile: str) -> None:
        self.defaults = defaults
        self.profile = profile
        self._slo: dict[str, RequestSlo] = {}

    def _slo_of(self, r: Any) -> RequestSlo:
        rid = r.request_id
        s = self._slo.get(rid)
        if s is None:
            sp = r.sampling_params
            s = request_slo(getattr(sp, "extra_args", None) if sp is not None else None,
                            r.num_prompt_tokens, self.defaults)
            self._slo[rid] = s
        return s

    def prune(self, live: Any) -> None:
        """Forget SLOs of finished requests (``live``: the scheduler's request map)."""
        if len(self._slo) > 2 * len(live) + 256:
            self._slo = {k: v for k, v in self._slo.items() if k in live}

    def build(self, running: Iterable[Any], waiting: Iterable[Any], *, max_batch_tokens: int,
              max_num_seqs: int, free_kv_tokens: int | None,
              now: float | None = None) -> tuple[Snapshot, list[Any]]:
        """The snapshot and, aligned with its rows, the vLLM request objects.

        Waiting requests that have not started (the bulk under load) take a row
        cached per request: their columns do not change while they wait."""
        reqs: list[Any] = []
        rows: list[tuple[str, float, int, int, int, float, float, bool]] = []
        for r in running:
            row = self._row(r)
            if row is not None:
                reqs.append(r)
                rows.append(row)
        cache = self._slo
        for r in waiting:
            if r.num_computed_tokens == 0 and r.num_output_placeholders == 0:
                s = cache.get(r.request_id)
                if s is None:
                    s = self._slo_of(r)
                known = r.num_tokens
                reqs.append(r)
                rows.append((r.request_id, r.arrival_time, known, 0, 0, s.ttft_s, s.tbt_s, s.protected))
            else:
                row = self._row(r)
                if row is not None:
                    reqs.append(r)
                    rows.append(row)
        cols: list[Any] = list(zip(*rows, strict=True)) if rows else [()] * 8
        snap = Snapshot.from_columns(
            now=time.time() if now is None else now,
            max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
            ids=cols[0], arrival=np.asarray(cols[1], np.float64), prompt_tokens=np.asarray(cols[2], np.int64),
            computed_tokens=np.asarray(cols[3], np.int64), output_tokens=np.asarray(cols[4], np.int64),
            ttft_slo=np.asarray(cols[5], np.float64), tbt_slo=np.asarray(cols[6], np.float64),
            protected=np.asarray(cols[7], np.bool_), free_kv_tokens=free_kv_tokens, profile=self.profile,
            max_requests=max(len(rows), 1),
        )
        return snap, reqs

    def _row(self, r: Any) -> tuple[str, float, int, int, int, float, float, bool] | None:
        ph = r.num_output_placeholders
        comp = r.num_computed_tokens
        p = r.num_prompt_tokens
        known = r.num_tokens + ph
        need = known - comp
        if need <= 0:
            return None
        out = r.num_output_tokens + ph
        if ph > 0 and comp + 2 - ph >= p + r.max_tokens:
            return None  # vLLM skips it: the in-flight step already finishes it
        s = self._slo_of(r)
        if out >= 1 and need == 1:
            return (r.request_id, r.arrival_time, p, p, out, s.ttft_s, s.tbt_s, s.protected)
        return (r.request_id, r.arrival_time, known, comp, 0, s.ttft_s, s.tbt_s, s.protected)
