"""What the vLLM adapter counts and reports, as plain objects (no vLLM import).

* :class:`AdapterStats`: the scheduler's counters (iterations, fallbacks by reason,
  deviations, rejections, engine-thread time) and the ``slidingserve_stats()`` dict;
* :func:`deviations`: how many requests of an executed plan vLLM scheduled otherwise
  (deviations vLLM makes by design — spec-decode tokens, prefix-cache hits — excepted);
* :func:`iteration_sample`: the (c, u, latency) sample of one executed step, from vLLM's
  ``SchedulerOutput``.

Tests: tests/test_vllm_pipeline.py (no vLLM needed).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from engine_adapter.core import DECISION_BUCKETS, IterationSample

__all__ = ["CORE_TOTALS", "LOCAL_REASONS", "AdapterStats", "core_totals", "deviations", "iteration_sample"]

log = logging.getLogger("engine_adapter.vllm")

#: Reasons counted besides AdapterCore's (deadline, error, invalid_plan, circuit_open).
LOCAL_REASONS = ("kv_pressure", "empty_plan", "unallocatable", "snapshot_error", "unsupported")
#: Counters of the adapter cores summed over settings reloads.
CORE_TOTALS = ("remote_decisions", "reports_sent", "reports_dropped", "report_errors")


class AdapterStats:
    """The counters of one scheduler.  ``counts`` holds the plain counters and the
    accumulated microseconds (``decide_us``, ``wait_us``, ``ahead_us``, ``own_us``,
    ``snap_wait_us``); the rest are named attributes."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.rejects: collections.Counter[str] = collections.Counter()
        self.last_reason = ""
        self.deviated_requests = 0

    def fallback(self, reason: str, detail: str, log_every: int) -> None:
        """An iteration scheduled natively for ``reason``; logged the first time and every
        ``log_every``-th time after."""
        self.fallbacks[reason] += 1
        self.last_reason = f"{reason}: {detail}"
        n = self.fallbacks[reason]
        if n == 1 or n % max(1, log_every) == 0:
            log.warning("slidingserve: native scheduling (%s, %d so far): %s", reason, n, detail)

    def deviated(self, requests: int) -> None:
        """One planned iteration where ``requests`` requests got other token counts (0: none)."""
        if requests:
            self.counts["deviating_iterations"] += 1
            self.deviated_requests += requests

    def report_failed(self, e: BaseException) -> None:
        self.counts["report_errors"] += 1
        self.last_reason = f"report: {type(e).__name__}: {e}"

    def as_dict(self, core: dict[str, Any], retired: Iterable[Mapping[str, Any]] = (), **live: Any) -> dict[str, Any]:
        """``slidingserve_stats()``: these counters, the current core's stats (``core``), the
        final stats of the cores settings reloads retired (``retired``; in ``core_totals``)
        and ``live`` (settings_reloads, settings_errors, policy, address, profile)."""
        c = self.counts
        iters = max(1, c["iterations"])
        return {
            "iterations": c["iterations"], "planned": c["planned"], "native": c["native"],
            "fallbacks": dict(self.fallbacks), "fallback_total": sum(self.fallbacks.values()),
            "deviating_iterations": c["deviating_iterations"], "deviated_requests": self.deviated_requests,
            "trimmed_admissions": c["trimmed_admissions"],
            "rejected": dict(self.rejects), "rejected_total": sum(self.rejects.values()),
            "plan_preemptions": c["plan_preemptions"], "reports": c["reports"], "report_errors": c["report_errors"],
            "mean_decide_us": c["decide_us"] / iters,
            "pipelined": c["pipelined"], "prefitted": c["prefitted"],
            "mean_wait_us": c["wait_us"] / max(1, c["pipelined"]),
            "mean_ahead_us": c["ahead_us"] / iters,
            #: the adapter's own engine-thread time per iteration (schedule() and
            #: update_from_output() minus vLLM's own work in them)
            "mean_own_us": c["own_us"] / iters, "own_us": c["own_us"], "decide_us": c["decide_us"],
            "snap_waits_us": c["snap_wait_us"], "resyncs": c["resyncs"], "last_reason": self.last_reason,
            **live, "core": core, "core_totals": core_totals([*retired, core]),
        }


def core_totals(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The :data:`CORE_TOTALS` counters summed over several cores' stats, and their
    decision-time histograms (``decision_counts`` per :data:`~engine_adapter.core.DECISION_BUCKETS`
    bucket, ``decision_seconds``)."""
    totals: dict[str, Any] = dict.fromkeys(CORE_TOTALS, 0)
    counts = [0] * (len(DECISION_BUCKETS) + 1)
    seconds = 0.0
    for st in stats:
        for k in CORE_TOTALS:
            totals[k] += int(st.get(k, 0))
        for i, n in enumerate(st.get("decision_counts") or ()):
            counts[i] += int(n)
        seconds += float(st.get("decision_seconds", 0.0))
    totals["decision_counts"], totals["decision_seconds"] = counts, seconds
    return totals


def deviations(plan: Mapping[str, int], scheduled: Mapping[str, int], requests: Mapping[str, Any]) -> int:
    """Planned requests vLLM scheduled other token counts for (``scheduled``: vLLM's
    ``num_scheduled_tokens``), except a decode that got its speculative tokens too and a
    prefill shortened by a prefix-cache hit (``requests``: vLLM's requests by id, with
    ``is_prefill_chunk``, ``num_computed_tokens`` and ``num_tokens``)."""
    bad = 0
    for rid, n in plan.items():
        g = scheduled.get(rid, 0)
        if g == n:
            continue
        r = requests.get(rid)
        if r is not None and g > 0:
            if g > n and n == 1 and not r.is_prefill_chunk:
                continue  # a decode with spec tokens
            if g < n and r.num_computed_tokens >= r.num_tokens:
                continue  # the prefix cache held the rest
        bad += 1
    return bad


def iteration_sample(so: Any, latency_ms: float) -> IterationSample:
    """c = tokens each request got, u = its tokens in KV before the step, of vLLM's
    ``SchedulerOutput`` ``so``."""
    # Only the multiset of (c, u) pairs matters: walk the cached and new request lists,
    # which carry u, and look c up (no per-request dict to build).
    nst = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    ids: list[str] = cached.req_ids
    u_list: list[int] = cached.num_computed_tokens
    new = so.scheduled_new_reqs
    if new:
        ids = [*ids, *(nr.req_id for nr in new)]
        u_list = [*u_list, *(nr.num_computed_tokens for nr in new)]
    n = len(nst)
    if len(ids) == n:
        c = np.fromiter(map(nst.__getitem__, ids), np.int64, n)
        u = np.array(u_list, np.int64)
    else:  # not expected: fall back to the general mapping (unknown u = 0)
        computed = dict(zip(ids, u_list, strict=False))
        c = np.fromiter(nst.values(), np.int64, n)
        u = np.fromiter((computed.get(rid, 0) for rid in nst), np.int64, n)
    return IterationSample(c, u, latency_ms)
