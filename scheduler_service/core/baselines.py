"""Baseline policies, on the same snapshot, predictor and limits as SlidingServe.

* ``vllm-fcfs`` — vLLM V1's default: running requests (decodes and started
  prefills, ``Snapshot.started``: a waiting request's prefix-cache hits do not
  start it) first, then waiting ones, each in arrival order, each taking what
  it still needs from a fixed ``max_batch_tokens`` budget (chunked prefill).
* ``vllm-priority`` — vLLM V1 with ``--scheduling-policy priority``: as
  ``vllm-fcfs``, each group ordered by (priority, arrival) — smaller priority
  first, as vLLM's waiting heap orders it.  vLLM keeps its running list in
  admission order, which a stateless snapshot does not carry; ordering the
  running requests by priority too is the closest stateless reading (it
  matters only when the budget runs out inside the running group).
* ``sarathi`` — fixed chunk budget (decode tokens count in it); decodes
  first, then started prefills, then waiting ones, FCFS.
* ``sarathi-edf`` — as ``sarathi``; prefills by TTFT deadline a + L^ttft.
* ``qoserve`` — the public QoServe/Niyama scheduler (microsoft/sarathi-serve,
  branch ``niyama_asplos2026``, commit 72339db5, ``deadline_scheduler.py``):
  decodes first; the total budget is the largest entry of a token search
  space whose predicted time × 1.2 fits the smallest decode slack (128 when
  none fits, the largest when there are no decodes); prefills by (relegated,
  a + L^ttft + 0.008 s × remaining tokens); a request that has not started
  is relegated when now + remaining / ρ passes its TTFT deadline.

QoServe keeps relegation sticky in per-request state.  The service is
stateless per iteration, so here the relegation test is re-evaluated on each
snapshot; a request that was relegated rarely becomes un-relegated because it
is not served in between.  ρ is the engine's measured prefill throughput
(QoServe's EMA) when the snapshot carries it, else the predictor's estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .assemble import assemble_plan
from .batch import CandidateQueue, kv_prefill_cap, select_decodes
from .params import param
from .plan import Plan
from .predictor import BatchLatencyPredictor
from .reasons import Facts
from .snapshot import Snapshot
from .sorter import edf_order, fcfs_order, ordered, prefill_indices

__all__ = [
    "QoServeParams",
    "QoServePolicy",
    "SarathiParams",
    "SarathiPolicy",
    "VllmFcfsParams",
    "VllmFcfsPolicy",
]

VERSION = "1.1.0"


# ----------------------------------------------------------------- vllm-fcfs
@dataclass(frozen=True, slots=True)
class VllmFcfsParams:
    kv_decode_reserve: int = param(
        0, lo=0, hi=1024, doc="KV tokens kept free per running decode (vLLM keeps none)"
    )


@dataclass(frozen=True, slots=True)
class VllmFcfsPolicy:
    #: ``plan(..., explain=True)`` explains from the decision (``reasons.plan_explained``).
    explains: ClassVar[bool] = True
    name: str
    version: str
    params: VllmFcfsParams
    #: ``vllm-priority``: each group by (priority, arrival) instead of arrival.
    by_priority: bool = False

    def _order(self, snap: Snapshot, idx: np.ndarray) -> np.ndarray:
        if self.by_priority and len(idx):
            return ordered(snap, idx, snap.priority[idx])
        return fcfs_order(snap, idx)

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, *, explain: bool = False) -> Plan:
        """Decide one iteration; with ``explain`` the plan carries its reasons
        (``reasons.plan_explained``)."""
        snap = snapshot
        t0 = time.perf_counter_ns()
        started = np.flatnonzero(snap.started)
        waiting = np.flatnonzero(~snap.started)
        order = np.concatenate([self._order(snap, started), self._order(snap, waiting)])
        n_dec_all = int(snap.is_decoding.sum())
        budget = snap.max_batch_tokens
        seqs = snap.max_num_seqs
        kv = kv_prefill_cap(snap, 0, n_dec_all, self.params.kv_decode_reserve)
        decodes: list[int] = []
        pre_rows: list[int] = []
        pre_toks: list[int] = []
        for i in order.tolist():
            if budget <= 0 or seqs <= 0 or kv <= 0:
                break
            need = 1 if snap.is_decoding[i] else int(snap.remaining_prefill[i])
            take = min(need, budget, kv)
            if snap.is_decoding[i]:
                decodes.append(i)
            else:
                pre_rows.append(i)
                pre_toks.append(take)
            budget -= take
            kv -= take
            seqs -= 1
        t1 = time.perf_counter_ns()
        return assemble_plan(
            self, snap, predictor, np.array(decodes, dtype=np.int64), np.array(pre_rows, dtype=np.int64),
            np.array(pre_toks, dtype=np.int64), self.name, t0,
            {"sorter": t1 - t0}, facts=self.facts(snap, predictor) if explain else None,
        )

    def facts(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan | None = None) -> Facts:
        """What a decision knows, for its plan's reasons: the engine's budget and the KV
        kept per decode (the same replayed for ``plan``)."""
        return Facts(snapshot.max_batch_tokens, self.params.kv_decode_reserve)


# ------------------------------------------------------------ sarathi (+EDF)
@dataclass(frozen=True, slots=True)
class SarathiParams:
    chunk_size: int = param(512, lo=1, hi=1 << 20, doc="fixed token budget per iteration, decodes included")
    kv_decode_reserve: int = param(1, lo=0, hi=1024, doc="KV tokens kept free per running decode")


@dataclass(frozen=True, slots=True)
class SarathiPolicy:
    #: ``plan(..., explain=True)`` explains from the decision (``reasons.plan_explained``).
    explains: ClassVar[bool] = True
    name: str
    version: str
    params: SarathiParams
    edf: bool

    def facts(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan | None = None) -> Facts:
        """What a decision knows, for its plan's reasons: the chunk as its budget and the KV
        kept per decode (the same replayed for ``plan``)."""
        return Facts(min(self.params.chunk_size, snapshot.max_batch_tokens), self.params.kv_decode_reserve)

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, *, explain: bool = False) -> Plan:
        """Decide one iteration; with ``explain`` the plan carries its reasons
        (``reasons.plan_explained``)."""
        snap = snapshot
        t0 = time.perf_counter_ns()
        dec_all = np.flatnonzero(snap.is_decoding)
        budget = min(self.params.chunk_size, snap.max_batch_tokens)
        dec_fcfs = fcfs_order(snap, dec_all)
        decodes = np.sort(dec_fcfs[: min(len(dec_fcfs), budget, snap.max_num_seqs,
                                         snap.free_kv_tokens if snap.free_kv_tokens is not None else budget)])
        pre = prefill_indices(snap)
        if self.edf:
            queue = edf_order(snap, pre)
        else:
            started = pre[snap.started[pre]]
            waiting = pre[~snap.started[pre]]
            queue = np.concatenate([fcfs_order(snap, started), fcfs_order(snap, waiting)])
        t1 = time.perf_counter_ns()
        cq = CandidateQueue.build(
            snap, predictor, decodes, queue, n_all_decodes=len(dec_all),
            kv_decode_reserve=self.params.kv_decode_reserve, budget=budget,
        )
        return assemble_plan(
            self, snap, predictor, decodes, *cq.fill_arrays(cq.first_cap), self.name, t0, {"sorter": t1 - t0},
            facts=self.facts(snap, predictor) if explain else None,
        )


# ------------------------------------------------------------------- qoserve
@dataclass(frozen=True, slots=True)
class QoServeParams:
    safety_factor: float = param(1.2, lo=0.0, hi=100.0, doc="predicted time is multiplied by this")
    hybrid_coef_s: float = param(
        0.008, lo=0.0, hi=10.0, doc="seconds added to the deadline per remaining prompt token"
    )
    min_chunk: int = param(128, lo=1, hi=1 << 20, doc="first and fallback entry of the search space")
    # >= 8: the search space is a list of budget/step candidates built every decision
    chunk_step: int = param(256, lo=8, hi=1 << 20, doc="step of the search space after min_chunk")
    kv_decode_reserve: int = param(1, lo=0, hi=1024, doc="KV tokens kept free per running decode")


@dataclass(frozen=True, slots=True)
class QoServePolicy:
    #: ``plan(..., explain=True)`` explains from the decision (``reasons.plan_explained``).
    explains: ClassVar[bool] = True
    name: str
    version: str
    params: QoServeParams

    def search_space(self, max_batch_tokens: int) -> np.ndarray:
        p = self.params
        pts = [p.min_chunk, *range(p.chunk_step * ((p.min_chunk // p.chunk_step) + 1), max_batch_tokens + 1,
                                   p.chunk_step), max_batch_tokens]
        return np.unique(np.minimum(np.array(pts, dtype=np.int64), max_batch_tokens))

    def total_budget(self, snap: Snapshot, cq: CandidateQueue) -> int:
        """The iteration's total token budget: the largest entry of the search space whose
        predicted time x the safety factor fits the smallest decode slack."""
        p = self.params
        n_dec = len(cq.decodes)
        space = self.search_space(snap.max_batch_tokens)
        if n_dec == 0:
            return int(space[-1])
        prefill = np.clip(space - n_dec, 0, cq.first_cap)
        min_slack_ms = float(snap.slack[cq.decodes].min()) * 1e3
        t = cq.prefix_time_ms(prefill) * p.safety_factor
        ok = np.flatnonzero(t <= min_slack_ms) if min_slack_ms > 0 else np.array([], dtype=np.int64)
        return int(space[ok[-1]]) if len(ok) else int(space[0])

    def facts(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan | None = None) -> Facts:
        """What :meth:`plan` knew, replayed for ``plan`` (``reasons.explain``): its budget, the
        KV kept per decode, the relegated prefills (given up on)."""
        snap = snapshot
        pre = prefill_indices(snap)
        return self._facts(snap, self.total_budget(snap, self.candidate_queue(snap, predictor)), pre,
                           self.relegated(snap, predictor, pre))

    def _facts(self, snap: Snapshot, total: int, pre: np.ndarray, relegated: np.ndarray) -> Facts:
        return Facts(min(total, snap.max_batch_tokens), self.params.kv_decode_reserve, lost_from=pre,
                     lost_mask=relegated, given_up=True)

    def candidate_queue(self, snap: Snapshot, predictor: BatchLatencyPredictor) -> CandidateQueue:
        """The decodes and prefill queue :meth:`plan` builds (for explaining a plan)."""
        dec_all = np.flatnonzero(snap.is_decoding)
        pre = prefill_indices(snap)
        key = snap.ttft_deadline[pre] + self.params.hybrid_coef_s * snap.remaining_prefill[pre]
        queue = ordered(snap, pre, self.relegated(snap, predictor, pre), key)
        return CandidateQueue.build(snap, predictor, select_decodes(snap, dec_all), queue,
                                    n_all_decodes=len(dec_all), kv_decode_reserve=self.params.kv_decode_reserve)

    def relegated(self, snap: Snapshot, predictor: BatchLatencyPredictor, pre: np.ndarray) -> np.ndarray:
        """Mask over ``pre``: not started, and now + remaining / rho passes the TTFT deadline."""
        rho = snap.prefill_throughput or predictor.prefill_throughput(snap.max_batch_tokens)
        return ~snap.started[pre] & (snap.now + snap.remaining_prefill[pre] / rho
                                                   > snap.ttft_deadline[pre])

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, *, explain: bool = False) -> Plan:
        """Decide one iteration; with ``explain`` the plan carries its reasons
        (``reasons.plan_explained``)."""
        p = self.params
        snap = snapshot
        t0 = time.perf_counter_ns()
        dec_all = np.flatnonzero(snap.is_decoding)
        decodes = select_decodes(snap, dec_all)
        pre = prefill_indices(snap)
        r = snap.remaining_prefill[pre]
        relegated = self.relegated(snap, predictor, pre)
        key = snap.ttft_deadline[pre] + p.hybrid_coef_s * r
        queue = ordered(snap, pre, relegated, key)
        t1 = time.perf_counter_ns()
        cq = CandidateQueue.build(
            snap, predictor, decodes, queue, n_all_decodes=len(dec_all),
            kv_decode_reserve=p.kv_decode_reserve,
        )
        n_dec = len(decodes)
        total = self.total_budget(snap, cq)
        p1 = int(np.clip(total - n_dec, 0, cq.first_cap))
        t2 = time.perf_counter_ns()
        return assemble_plan(
            self, snap, predictor, decodes, *cq.fill_arrays(p1), self.name, t0,
            {"sorter": t1 - t0, "chunker": t2 - t1},
            facts=self._facts(snap, total, pre, relegated) if explain else None,
        )
