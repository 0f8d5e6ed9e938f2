"""The SlidingServe policy and the Table-4 ablations.

One decision (docs/policies.md):

1. decodes get one token each (the most urgent when limits force fewer);
2. MLPS orders waiting + prefilling requests, expired ones last;
3. the violation check fills that queue greedily to TimeToBudget(T_cur) and
   predicts T̂_full; live prefills with slack below it are risky;
4. risky → BatchConstructor; no risky or no feasible anchor → SlidingChunker
   with window k, then a greedy fill of its budget;
5. nothing to trade: when vLLM's own choice (first come first served, the
   full token budget) is predicted to keep every promise (each live prefill's
   first token at the prefill rate, each decode's tokens over the window), the
   plan is that choice;
6. starvation bound: while the live prefills' spare slack holds the work of
   every prefill waiting ``starve_after`` × its TTFT, those go first, oldest
   first, on the SlidingChunker path, and the oldest gets its tokens even
   beyond the decode windows; decodes that late no longer sit out.  When it
   does not (sustained overload), the bound waits: the plan is the one
   without it, so the given-up requests never take the engine from live ones.

The ablations switch parts off: ``sarathi-edf+sc`` (EDF order, chunker only),
``sarathi-edf+sc+mlps`` (MLPS order, chunker only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from . import kernels
from .assemble import assemble_plan, in_queue_order
from .batch import CandidateQueue, fit_class_decodes, select_decodes
from .chunker import sliding_chunk
from .columns import COLUMNS
from .constructor import construct_batch
from .features import DECODE
from .params import param
from .plan import Plan, Reasons, Rejection
from .predictor import BatchLatencyPredictor
from .reasons import Facts, allocated_rows, classify, classify_fill, reserve_ms
from .reasons import explain as with_reasons
from .rule_codes import reason_tokens
from .snapshot import Snapshot
from .sorter import edf_order, fcfs_order, late_set, mlps_order, ordered, prefill_indices

__all__ = ["SlidingServeParams", "SlidingServePolicy"]

VERSION = "1.4.1"
#: Paths whose plan gives tokens to a prefill.
_PREFILL_PATHS = ("batch_constructor", "sliding_chunker")


@dataclass(frozen=True, slots=True)
class SlidingServeParams:
    window: int = param(2, lo=1, hi=4, doc="SlidingChunker window k (1 = greedy, 2 = paper)")
    alpha: float = param(1.0, lo=0.0, hi=1e6, doc="MLPS urgency threshold α of formula (14)")
    epsilon_s: float = param(1e-3, lo=1e-9, hi=10.0, doc="MLPS slack floor ε in seconds (13)")
    granularity: int = param(16, lo=1, hi=4096, doc="token grid of the window search")
    # Bounded because the window DP's memory and time grow with (window x grid)^2: 2,000
    # took 1.3 GB and 4 s per decision at window 4; 256 stays under ~25 MB.
    max_grid: int = param(
        32, lo=2, hi=256, doc="most grid positions per iteration; the step widens beyond"
    )
    margin: float = param(
        1.1, lo=1.0, hi=10.0,
        doc="predicted times count this many times over against slacks (QoServe uses 1.2)",
    )
    learned_margin: bool = param(
        False, doc="use the predictor's margin learned from its residuals when it is larger than margin "
                   "(off: on the live CPU engine it kept 90% of plans within prediction and lost goodput)",
    )
    tie_tolerance_ms: float = param(
        2.0, lo=0.0, hi=1e4,
        doc="window splits within this many ms of the least predicted total tie; the larger b1 wins",
    )
    max_candidates: int = param(64, lo=1, hi=100_000, doc="BatchConstructor candidate pool size")
    kv_decode_reserve: int = param(
        1, lo=0, hi=1024, doc="KV tokens kept free per running decode for its next tokens"
    )
    kv_growth_iters: int = param(
        64, lo=0, hi=4096,
        doc="admit a new request only if every request holding KV can still grow this many tokens",
    )
    hopeless_factor: float = param(
        1.0, lo=0.0, hi=100.0,
        doc="a prefill whose remaining tokens at the full-budget prefill rate take more than this "
            "many times its slack is served like an expired one (0 = off)",
    )
    decode_skip_tbts: float = param(
        6.0, lo=0.0, hi=1000.0,
        doc="while live prefills wait, a decode more than this many TBTs ahead of its next token's "
            "deadline sits out the iteration (0 = every decode runs every iteration)",
    )
    lost_rule: str = param(
        "moore", choices=("alone", "moore"),
        doc="prefills given up on (served last, never anchors): 'alone' = those hopeless_factor "
            "marks; 'moore' = also those Moore-Hodgson drops at the observed prefill rate",
    )
    sit_out_when: str = param(
        "needed", choices=("needed", "waiting"),
        doc="when the decode sit-out rules (decode_skip_tbts, skip_late_decodes) apply: 'waiting' = "
            "whenever a live prefill waits; 'needed' = only when Moore-Hodgson on the live prefills at "
            "the prefill pace left beside every decode (each keeping its TBT) would give up a first token",
    )
    skip_late_decodes: bool = param(
        True,
        doc="while live prefills wait, decodes already past their next token's deadline (their "
            "request has missed its SLO) sit out the iteration",
    )
    starve_after: float = param(
        3.0, lo=0.0, hi=1000.0,
        doc="starvation bound: a prefill whose age reaches this many times its TTFT SLO goes first, "
            "oldest first, with tokens every iteration; a decode this many TBTs late no longer sits "
            "out (0 = off)",
    )
    fcfs_when_safe: bool = param(
        True,
        doc="when first come first served with the full token budget (vLLM's own choice) is predicted to "
            "keep every promise (live first tokens at the prefill rate, decode tokens over the window), "
            "plan exactly that: there is nothing to trade",
    )
    class_sit_out: bool = param(
        True,
        doc="request classes: lower-class decodes sit out an iteration when the decodes alone "
            "would make a higher-class decode miss its token",
    )
    preempt: bool = param(
        True,
        doc="request classes: when KV keeps out a live request, free the KV of lower-class "
            "requests given up part-way through their prefill (the plan's preemptions)",
    )
    shed: bool = param(
        True,
        doc="reject sheddable requests whose first token is already late or that the lost rule "
            "gives up on (the plan's rejections); requests that are not sheddable are never rejected",
    )
    class_reserve: float = param(
        0.95, lo=0.0, hi=10.0,
        doc="request classes: the k-th class below the top class present admits new requests only "
            "while the decodes and partial prefills are predicted to take at most this to the power "
            "k times the tightest higher-class TBT per iteration (0 = off)",
    )
    class_rescue: bool = param(
        True,
        doc="request classes: when the top class's prefills lose more first tokens at the pace left "
            "beside every decode than with lower-class decodes sitting out, the fewest lower-class "
            "decodes that close the gap sit out",
    )
    order: str = param("mlps", choices=("mlps", "edf"), doc="prefill queue order")
    batch_constructor: bool = param(True, doc="route risky batches to BatchConstructor")


@dataclass(frozen=True, slots=True)
class SlidingServePolicy:
    #: ``plan(..., explain=True)`` explains from the decision (``reasons.plan_explained``).
    explains: ClassVar[bool] = True
    name: str
    version: str
    params: SlidingServeParams
    #: This policy without the starvation bound (``starve_after`` 0), built on first use:
    #: it plans while the bound's backlog does not fit (:meth:`_bound_fits`).
    unbounded: list[SlidingServePolicy | None] = field(default_factory=lambda: [None], repr=False, compare=False)

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, *, explain: bool = False) -> Plan:
        """Decide one iteration; with ``explain`` the plan also carries a reason for every
        request it does not fully serve (``reasons.explain``, fed what this decision knew:
        the same plan, with ``reasons`` set)."""
        p = self.params
        if p.learned_margin and predictor.margin > p.margin:
            return replace(self, params=replace(p, margin=predictor.margin)).plan(snapshot, predictor,
                                                                                   explain=explain)
        if not explain:
            return self._decide(snapshot, predictor, None)
        plan = self._decide(snapshot, predictor, {})
        if isinstance(plan.reasons, Reasons):  # classified as it was assembled
            return plan
        return with_reasons(self, snapshot, predictor, plan)  # it preempted (planned a smaller snapshot): replayed

    def _decide(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, trace: dict[str, Any] | None) -> Plan:
        """:meth:`plan`; with ``trace`` (explaining only: it receives what the class rules
        held back and the rejections it shed) the plan is classified as it is assembled, unless it preempts."""
        p = self.params
        snap = snapshot
        t0 = time.perf_counter_ns()
        dec_all = np.flatnonzero(snap.is_decoding)
        pre = prefill_indices(snap)
        rho = snap.prefill_throughput or predictor.prefill_throughput(snap.max_batch_tokens)
        lost = self._lost(snap, predictor, pre, rho)
        starving = self._starving(snap, pre)
        if starving.any():
            if not _spare_holds(snap, pre, starving, lost, rho):  # the bound waits: plan without it
                return self._unbounded().plan(snapshot, predictor, explain=trace is not None)
            lost = lost & ~starving  # no longer given up on
        if p.preempt and not snap.one_class and snap.free_kv_tokens is not None and len(pre):
            victims = _kv_victims(snap, pre, lost, len(dec_all), p.kv_growth_iters, p.kv_decode_reserve, p.shed)
            if len(victims):
                gone = np.zeros(len(snap), dtype=bool)
                gone[victims] = True
                sub = _without(snap, gone)  # plan on the snapshot without them, their KV counted as free
                plan = replace(self, params=replace(p, preempt=False)).plan(sub, predictor)
                return replace(plan, preemptions=tuple(snap.ids[i] for i in victims.tolist()),
                               decision_us=(time.perf_counter_ns() - t0) // 1000)
        if p.shed and snap.any_sheddable and len(pre) and bool(snap.sheddable[pre].any()):
            pre, lost, rejections = _shed(snap, pre, lost)
            if trace is not None and rejections:
                trace["rejections"] = rejections  # verdicts: they come before every rule
            plan = self._choose(_Decision(snap, predictor, t0, dec_all, pre, lost, rho, trace))
            return replace(plan, rejections=rejections) if rejections else plan
        return self._choose(_Decision(snap, predictor, t0, dec_all, pre, lost, rho, trace))

    def held_back(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, preempted: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For explaining a plan (``reasons.explain``), the rules of :meth:`plan` replayed
        on ``snapshot`` without the plan's ``preempted`` rows (a mask), as :meth:`plan`
        planned: the rows of the prefills given up on (the lost rule, after the starvation
        bound, shedding and the class rescue), of the new requests the class reserve holds
        back, and of the decodes the class rescue sits out.  Never called by :meth:`plan`."""
        if preempted.any():
            keep = np.flatnonzero(~preempted)
            return tuple(keep[m] for m in self._held_back(_without(snapshot, preempted), predictor))  # type: ignore[return-value]
        return tuple(np.flatnonzero(m) for m in self._held_back(snapshot, predictor))  # type: ignore[return-value]

    def _held_back(self, snap: Snapshot, predictor: BatchLatencyPredictor
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`held_back` as masks over ``snap``'s rows."""
        p = self.params
        n = len(snap)
        lost_rows, held, rescued = (np.zeros(n, dtype=bool) for _ in range(3))
        pre = prefill_indices(snap)
        if not len(pre):
            return lost_rows, held, rescued
        dec_all = np.flatnonzero(snap.is_decoding)
        rho = snap.prefill_throughput or predictor.prefill_throughput(snap.max_batch_tokens)
        lost = self._lost(snap, predictor, pre, rho)
        if p.starve_after > 0:
            lost = lost & ~self._starving(snap, pre)
        if p.shed and snap.any_sheddable and bool(snap.sheddable[pre].any()):
            pre, lost, _ = _shed(snap, pre, lost)
        if not snap.one_class and len(pre):
            if p.class_reserve > 0:
                kept, lost = _reserve(snap, predictor, dec_all, pre, lost, p.class_reserve)
                held[pre] = True
                held[kept] = False
                pre = kept
            if p.class_rescue and len(dec_all):
                lost, mask = _rescue(snap, predictor, dec_all, pre, lost, p.margin)
                if mask is not None:
                    rescued[dec_all[mask]] = True
        lost_rows[pre[lost]] = True
        return lost_rows, held, rescued

    def _choose(self, d: _Decision) -> Plan:
        """The plan with decodes that need no token now sitting out, when a prefill can use
        their room; else with every decode."""
        p = self.params
        snap, predictor, dec_all, pre, lost, trace = d.snap, d.predictor, d.dec_all, d.pre, d.lost, d.trace
        rescued = None
        if not snap.one_class and len(pre):
            if p.class_reserve > 0:
                before = pre
                pre, lost = _reserve(snap, predictor, dec_all, pre, lost, p.class_reserve)
                if trace is not None and len(pre) < len(before):
                    trace["held"] = before[~np.isin(before, pre)]
                    trace["reserve_ms"] = reserve_ms(snap, predictor)
            if p.class_rescue and len(dec_all):
                lost, rescued = _rescue(snap, predictor, dec_all, pre, lost, p.margin)
                if trace is not None and rescued is not None:
                    trace["rescued"] = dec_all[rescued]
        d.pre, d.lost = pre, lost
        d.holders = int(np.count_nonzero(snap.started))
        d.starving = self._starving(snap, pre)
        d.fcfs = None if d.starving.any() else self._nothing_to_trade(snap, pre, lost, d.rho)
        d.live, out = self._sit_out(snap, dec_all, pre, lost)
        if out.any() and p.sit_out_when == "needed" and not _room_needed(snap, predictor, dec_all, d.live, p.margin):
            out[:] = False  # every live prefill makes its TTFT beside every decode: no decode waits
        if rescued is not None:
            out |= rescued
        batch = self._batch(d, dec_all[~out]) if out.any() else None
        if batch is None or batch.path not in _PREFILL_PATHS:
            # Nothing sits out, or no prefill could use the room (KV, limits) and sitting out
            # would only idle decodes: every decode runs but the rescued ones (the
            # higher-class decodes catch up without them).
            batch = self._batch(d, dec_all if rescued is None else dec_all[~rescued])
        return assemble_plan(self, d.snap, d.predictor, batch.decodes, batch.pre_rows, batch.pre_toks, batch.path,
                             d.t0, batch.laps, batch.predicted, reasons=batch.reasons)

    def _sit_out(self, snap: Snapshot, dec_all: np.ndarray, pre: np.ndarray,
                 lost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The live prefills (slack left, not lost) and the mask over ``dec_all`` of the
        decodes that sit this iteration out.

        While prefills that can still make it wait, decodes whose token is not needed now
        sit out, and their time goes to the prefills: those far ahead of their next
        deadline (deadlines are cumulative, formula (1)), and those already late but by
        less than ``starve_after`` TBTs (a decode later than that is starving and runs).

        A paced decode (TPOT objective) sits out only ahead of its pace, by more than
        ``decode_skip_tbts`` times its ``tpot_slo``: behind it, its mean can still be made
        by running, never by waiting."""
        p = self.params
        live, out = kernels.ops().sit_out(snap, dec_all, pre, lost, p.decode_skip_tbts, p.skip_late_decodes,
                                          p.starve_after)
        if snap.any_tpot and out.any():
            out &= ~(snap.paced[dec_all] & (snap.slack[dec_all] <= 0))
        return live, out

    def _starving(self, snap: Snapshot, pre: np.ndarray) -> np.ndarray:
        """Mask over ``pre`` of the starving prefills: waiting for their first token for at
        least ``starve_after`` times their TTFT SLO (age = now − arrival, however much of
        the prompt is computed or cached).  With request classes only the highest class in
        the snapshot starves: a lower class never costs a higher one its tokens."""
        a = self.params.starve_after
        if a <= 0 or len(pre) == 0:
            return np.zeros(len(pre), dtype=bool)
        out = snap.now - snap.arrival[pre] >= a * snap.ttft_slo[pre]
        if not snap.one_class:
            out &= snap.priority[pre] == snap.priority.min()
        return out

    def _bound_fits(self, snap: Snapshot, predictor: BatchLatencyPredictor) -> bool:
        """Whether the starvation bound holds on ``snap`` (:func:`_spare_holds`; true when
        nothing starves)."""
        pre = prefill_indices(snap)
        starving = self._starving(snap, pre)
        if not starving.any():
            return True
        rho = snap.prefill_throughput or predictor.prefill_throughput(snap.max_batch_tokens)
        return _spare_holds(snap, pre, starving, self._lost(snap, predictor, pre, rho), rho)

    def _planned_unbounded(self, snap: Snapshot, predictor: BatchLatencyPredictor, gone: np.ndarray) -> bool:
        """Whether :meth:`plan` planned ``snap`` without the starvation bound (its backlog did
        not fit, :meth:`_bound_fits`): on the whole snapshot, or, for a plan that preempted the
        rows ``gone``, on the snapshot without them (where the plan was made)."""
        if self.params.starve_after <= 0:
            return False
        if not self._bound_fits(snap, predictor):
            return True
        return bool(gone.any()) and not self._bound_fits(_without(snap, gone), predictor)

    def _unbounded(self) -> SlidingServePolicy:
        """This policy without the starvation bound, for the decisions where it waits."""
        off = self.unbounded[0]
        if off is None:
            off = self.unbounded[0] = replace(self, params=replace(self.params, starve_after=0.0),
                                              unbounded=[None])
        return off

    def _lost(self, snap: Snapshot, predictor: BatchLatencyPredictor, pre: np.ndarray,
              rho: float) -> np.ndarray:
        """Mask over ``pre`` of the live prefills given up on (expired ones are handled by
        the sorter and the constructor themselves)."""
        p = self.params
        lost = np.zeros(len(pre), dtype=bool)
        if len(pre) == 0:
            return lost
        classes = not snap.one_class and bool(snap.priority[pre].min() != snap.priority[pre].max())
        # Optimistic: the request alone with the whole budget, at the predictor's rate.
        rho_max = predictor.prefill_throughput(snap.max_batch_tokens) if p.hopeless_factor > 0 else 0.0
        return kernels.ops().lost_mask(snap, pre, rho, rho_max, p.hopeless_factor, p.lost_rule == "moore", classes)

    def _windows(self, snap: Snapshot, decodes: np.ndarray) -> np.ndarray | None:
        """W_1..W_k over the decodes, divided by the margin; None without a safe decode."""
        p = self.params
        return kernels.ops().window_limits(snap, decodes, p.window, p.margin)

    def _queue(self, snap: Snapshot, pre: np.ndarray, lost: np.ndarray, rho: float,
               starving: np.ndarray) -> np.ndarray:
        """The prefill queue (MLPS or EDF); the ``starving`` prefills (a mask over
        ``pre``) head it, oldest first (the starvation bound)."""
        p = self.params
        if p.order == "mlps":
            queue = mlps_order(snap, pre, rho, p.alpha, p.epsilon_s, lost=lost)
        else:
            queue = edf_order(snap, pre, expired_last=False)
        if starving.any():
            queue = np.concatenate([ordered(snap, pre[starving]), queue[np.isin(queue, pre[~starving])]])
        return queue

    def _nothing_to_trade(self, snap: Snapshot, pre: np.ndarray, lost: np.ndarray, rho: float) -> np.ndarray | None:
        """vLLM's own prefill queue (first come first served) when it keeps every live
        prefill's first token, served one after another at ``rho`` (expired ones included,
        where they come) with every time counted ``margin`` times over, and nothing is given
        up on; else None.  The decodes' side of the rule is checked on the queue's budget
        curve (:func:`_keeps_decodes`)."""
        if not self.params.fcfs_when_safe or not len(pre) or lost.any():
            return None
        queue = fcfs_order(snap, pre)
        slack = snap.slack[queue]
        done = np.cumsum(snap.remaining_prefill[queue]) * (self.params.margin / rho)
        return queue if bool(((done <= slack) | (slack <= 0)).all()) else None  # expired ones: nothing to keep

    def _batch(self, d: _Decision, runnable: np.ndarray) -> _Batch:
        """The batch of decision ``d`` with the decodes ``runnable`` (those not sitting out):
        the decodes that fit, the prefill queue, then BatchConstructor's batch when the
        queue is at risk, else the sliding chunker's (or the queue's first-come fill when
        there is nothing to trade)."""
        p = self.params
        snap, predictor, trace, starving, fcfs = d.snap, d.predictor, d.trace, d.starving, d.fcfs
        watch = _Stopwatch(d.t0)
        with watch.lap("sorter"):
            decodes = select_decodes(snap, runnable, starve_tbts=p.starve_after)
            if p.class_sit_out and not snap.one_class:
                decodes = fit_class_decodes(snap, predictor, decodes, p.margin)
            queue = self._trading_queue(d) if fcfs is None else fcfs
        with watch.lap("predictor"):
            W = self._windows(snap, decodes)
            cq, curve = self._candidates(snap, predictor, decodes, queue, len(d.dec_all), d.holders)
            if fcfs is not None and not _keeps_decodes(curve, cq.first_cap, W):
                fcfs = None  # vLLM's choice would cost a decode its token: back to the trade-offs
                queue = self._trading_queue(d)
                cq, curve = self._candidates(snap, predictor, decodes, queue, len(d.dec_all), d.holders)
        with watch.lap("constructor"):
            chosen = None
            if p.batch_constructor and cq.first_cap > 0 and not starving.any() and fcfs is None:
                cand = cq.first_cap if W is None else max(curve.prefill_tokens_within(W[0], cq.first_cap), 0)
                chosen = construct_batch(
                    snap, d.live, curve, len(decodes), float(curve.times[cand]),
                    token_cap=min(cq.iter_cap, cq.kv_cap),
                    seq_cap=max(0, snap.max_num_seqs - len(decodes)),
                    max_candidates=p.max_candidates,
                    margin=p.margin,
                    predictor=predictor,
                    decodes=decodes,
                )
        with watch.lap("chunker"):
            predicted: float | None = None
            filled = None
            if chosen is not None:
                pre_rows = in_queue_order(chosen.chosen, queue)
                pre_toks = snap.remaining_prefill[pre_rows]
                path = "batch_constructor"
                if trace is not None and len(snap):
                    facts = self._facts(d, W, chosen=len(pre_rows))
                    filled = Reasons(snap.ids, *classify(snap, facts, decodes, pre_rows, pre_toks))
            else:
                p1 = self._chunk(cq, curve, W, fcfs is not None, bool(starving.any()))
                if trace is None or not len(snap):
                    pre_rows, pre_toks = cq.fill_arrays(p1)
                else:  # filled and explained in one compiled call
                    pre_rows, pre_toks, filled = classify_fill(snap, self._facts(d, W), cq, p1)
                predicted = float(curve.times[p1])  # the curve holds exactly this batch
                path = "sliding_chunker" if len(pre_rows) else ("decode_only" if len(decodes) else "idle")
        return _Batch(decodes, pre_rows, pre_toks, path, predicted, filled, watch.laps)

    def _trading_queue(self, d: _Decision) -> np.ndarray:
        """Decision ``d``'s prefill queue (:meth:`_queue`), built once for every batch it tries."""
        if d.queue is None:
            d.queue = self._queue(d.snap, d.pre, d.lost, d.rho, d.starving)
        return d.queue

    def _chunk(self, cq: CandidateQueue, curve: Any, W: np.ndarray | None, fcfs: bool, starving: bool) -> int:
        """The first iteration's prompt tokens: all the first iteration may take (no decode
        window, or the first-come queue keeps everyone), TimeToBudget(W_1) (window 1), else
        the sliding chunker's b_1; the starving head of the queue gets its room."""
        p = self.params
        if W is None or fcfs:
            p1 = cq.first_cap
        elif p.window == 1:
            p1 = max(curve.prefill_tokens_within(W[0], cq.first_cap), 0)
        else:
            p1 = sliding_chunk(cq, W, p.granularity, p.max_grid, curve, p.tie_tolerance_ms)
        if starving:  # the oldest starving prefill (the queue's head) gets its room
            p1 = max(p1, min(int(cq.r[0]), cq.first_cap))
        return p1

    def _candidates(self, snap: Snapshot, predictor: BatchLatencyPredictor, decodes: np.ndarray, queue: np.ndarray,
                    n_decoding: int, holders: int) -> tuple[CandidateQueue, Any]:
        p = self.params
        cq = CandidateQueue.build(
            snap, predictor, decodes, queue,
            n_all_decodes=n_decoding, kv_decode_reserve=p.kv_decode_reserve,
            kv_growth_reserve=p.kv_growth_iters * holders,
        )
        return cq, cq.budget_curve()

    def _facts(self, d: _Decision, W: np.ndarray | None, chosen: int | None = None) -> Facts:
        """What decision ``d`` knew, for its plan's reasons: ``W`` the decode windows,
        ``chosen`` the prefills BatchConstructor chose (None: not its plan); the class rules'
        rows and the rejections from its trace."""
        t = d.trace or {}
        return self._rule_facts(d.snap, d.holders, W, chosen, lost_from=d.pre, lost_mask=d.lost, held=t.get("held"),
                                reserve_ms=t.get("reserve_ms", 0.0), rescued=t.get("rescued"),
                                rejections=t.get("rejections", ()))

    def facts(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, plan: Plan) -> Facts:
        """The facts of :meth:`_facts` for ``plan``, made by this policy for ``snapshot``,
        its rules replayed (``reasons.explain``): the prefills given up on, the rows the class
        rules held back, as :meth:`held_back` replays them, and the windows of the decodes
        the plan runs."""
        p = self.params
        snap = snapshot
        gone = np.zeros(len(snap), dtype=bool)
        if plan.preemptions:
            gone[[snap.index_of[r] for r in plan.preemptions]] = True
        if self._planned_unbounded(snap, predictor, gone):  # so was the plan: its rules, not the bound's
            return self._unbounded().facts(snapshot, predictor, plan)
        lost, held, rescued = self.held_back(snap, predictor, gone)
        got = reason_tokens(len(snap), _NO_ROWS, *allocated_rows(snap, plan))
        chosen = int(np.count_nonzero((got > 0) & ~snap.is_decoding)) if plan.path == "batch_constructor" else None
        W = kernels.ops().window_limits(snap, np.flatnonzero(snap.is_decoding & (got > 0)), p.window, p.margin)
        holders = int(np.count_nonzero(snap.started)) - len(plan.preemptions)
        return self._rule_facts(snap, holders, W, chosen, lost_from=lost, lost_mask=np.ones(len(lost), dtype=bool),
                                held=held if len(held) else None,
                                reserve_ms=reserve_ms(snap, predictor) if len(held) else 0.0,
                                rescued=rescued if len(rescued) else None, rejections=plan.rejections,
                                preemptions=plan.preemptions)

    def _rule_facts(self, snap: Snapshot, holders: int, W: np.ndarray | None, chosen: int | None,
                    **sets: Any) -> Facts:
        """The facts this policy's parameters fix (the budget, the KV it keeps with
        ``holders`` requests holding KV, which of its rules apply, the batch the plan was not
        in), with the decision's ``sets`` (lost set, class rules' rows, verdicts)."""
        p = self.params
        mlps = p.order == "mlps"
        return Facts(budget=snap.max_batch_tokens, kv_decode_reserve=p.kv_decode_reserve,
                     kv_watermark=p.kv_growth_iters * holders, given_up=mlps, expired=mlps,
                     sit_out=(p.starve_after, p.decode_skip_tbts), class_sit_out=not snap.one_class, chosen=chosen,
                     window_ms=None if W is None or chosen is not None else float(W[0]), **sets)


#: No rows, no mask (a _Decision's fields until the decision sets them).
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_MASK = np.zeros(0, dtype=bool)


@dataclass(slots=True)
class _Decision:
    """What one decision knows before it plans: the snapshot and predictor, when it began
    (``t0``, ns), every decode, the prefills it considers and those it gave up on (a mask
    over them), the prefill rate, the trace it explains into (None: not explaining) and,
    once the class rules and the sit-out rules ran, the live prefills, the requests holding
    KV, the starving prefills (a
    mask over ``pre``), vLLM's first-come queue when there is nothing to trade (else None)
    and the trading queue once built: every batch the decision tries shares them."""

    snap: Snapshot
    predictor: BatchLatencyPredictor
    t0: int
    dec_all: np.ndarray
    pre: np.ndarray
    lost: np.ndarray
    rho: float
    trace: dict[str, Any] | None
    live: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    holders: int = 0
    starving: np.ndarray = field(default_factory=lambda: _NO_MASK)
    fcfs: np.ndarray | None = None
    queue: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class _Batch:
    """One batch a decision tried (:meth:`SlidingServePolicy._batch`): the decodes, the
    prefill rows and their tokens, the path that chose them, the predicted time when the
    chunker's curve holds exactly this batch, the reasons classified with it (explaining),
    and the time each stage took (ns, from the decision's start)."""

    decodes: np.ndarray
    pre_rows: np.ndarray
    pre_toks: np.ndarray
    path: str
    predicted: float | None
    reasons: Reasons | None
    laps: dict[str, int]


class _Stopwatch:
    """A plan's time by stage (``laps``, ns, the plan's breakdown): each ``with
    watch.lap(name):`` block counts from the end of the one before (the first from the
    decision's start)."""

    __slots__ = ("_last", "_name", "laps")

    def __init__(self, t0: int) -> None:
        self.laps: dict[str, int] = {}
        self._last = t0
        self._name = ""

    def lap(self, name: str) -> _Stopwatch:
        self._name = name
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        now = time.perf_counter_ns()
        self.laps[self._name] = now - self._last
        self._last = now


def _spare_holds(snap: Snapshot, pre: np.ndarray, starving: np.ndarray, lost: np.ndarray, rho: float) -> bool:
    """Whether the starvation bound costs no live first token: the ``starving`` prefills'
    remaining work (masks over ``pre``, as ``lost``), served first at the prefill rate ρ,
    fits the spare slack of the live prefills that are kept (not expired, not ``lost``,
    served after them in deadline order at ρ).  Under sustained overload it does not, and
    the given-up requests wait until it does, so that they never take the engine from live
    ones (the collapse of 1.3.0, where every request soon starved)."""
    kept = pre[~starving & (snap.slack[pre] > 0) & ~lost]
    if not len(kept):
        return False  # nothing live waits: the given-up ones are served without the bound's help
    need = float(snap.remaining_prefill[pre[starving]].sum()) / rho
    kept = kept[np.argsort(snap.ttft_deadline[kept], kind="stable")]
    spare = snap.slack[kept] - np.cumsum(snap.remaining_prefill[kept]) / rho
    return need <= float(spare.min())


def _keeps_decodes(curve: Any, first_cap: int, W: np.ndarray | None) -> bool:
    """Whether the full first-iteration room, taken in each of the window's iterations,
    keeps every decode's tokens: m × T̂(decodes + ``first_cap``) within W_m for each m
    (W already divided by the margin; None: no decode has a token to keep)."""
    if W is None:
        return True
    t = float(curve.times[first_cap])
    return bool((t * np.arange(1, len(W) + 1) <= W).all())


def _reserve(snap: Snapshot, predictor: BatchLatencyPredictor, dec_all: np.ndarray, pre: np.ndarray,
             lost: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Request classes, class reserve (docs/policies.md): ``pre`` and ``lost`` without the
    new requests (not started: nothing computed but prefix-cache hits, ``Snapshot.started``)
    of the classes that wait this iteration.

    T̂_dec is the decode-only time of the decodes plus the partial prefills (each with its
    whole prompt as context: they decode next).  Walking the classes present from the
    second highest down, the k-th waits, with every class below it, when
    T̂_dec > beta^k × the tightest TBT of the classes above it.  The top class and the
    requests already partly prefilled never wait."""
    new = ~snap.started[pre]
    if not new.any():
        return pre, lost
    partial = pre[~new]
    n = len(dec_all) + len(partial)
    u = float(snap.kv_tokens[dec_all].sum() + snap.prompt_tokens[partial].sum())
    t_ms = predictor.model(DECODE).base_ms(n, u) if n else 0.0
    prio = snap.priority
    hold = np.zeros(len(pre), dtype=bool)
    for k, level in enumerate(np.unique(prio)[1:].tolist(), start=1):
        if t_ms > beta ** k * float(snap.tbt_slo[prio < level].min()) * 1e3:
            hold = new & (snap.priority[pre] >= level)
            break
    if not hold.any():
        return pre, lost
    return pre[~hold], lost[~hold]


def _rescue(snap: Snapshot, predictor: BatchLatencyPredictor, dec_all: np.ndarray, pre: np.ndarray,
            lost: np.ndarray, margin: float) -> tuple[np.ndarray, np.ndarray | None]:
    """Request classes, class rescue (docs/policies.md): (``lost`` with the top-class
    prefills the rescue keeps no longer given up, the mask over ``dec_all`` of the
    lower-class decodes that sit out), or (``lost``, None) when there is nothing to rescue.

    The top class c is the highest class with a live prefill.  Its pace with m lower-class
    decodes sitting out is :func:`_pace`.  When Moore-Hodgson on class c's prefills (and the
    higher classes' expired ones) gives up more at the pace beside every decode than with
    every lower-class decode out, the fewest decodes in drop order (already late first,
    then the lowest class, then the most slack) that give up no more than that sit out."""
    prio_pre = snap.priority[pre]
    live = snap.slack[pre] > 0
    if not live.any():
        return lost, None
    c = int(prio_pre[live].min())
    pr = snap.priority[dec_all]
    lower = np.flatnonzero(pr > c)
    if not len(lower):
        return lost, None
    s = snap.slack[dec_all[lower]]
    drop = lower[np.lexsort((-s, -pr[lower], s > 0))]
    top = np.flatnonzero(prio_pre <= c)
    idx = pre[top]
    u = snap.kv_tokens[dec_all].astype(np.float64)
    kept_u = float(u.sum()) - np.concatenate([[0.0], np.cumsum(u[drop])])
    tbt_ms = float(snap.tbt_slo[snap.priority <= c].min()) * 1e3

    def given_up(m: int) -> np.ndarray:
        rate = _pace(snap, predictor, len(dec_all) - m, float(kept_u[m]), tbt_ms, margin)
        return late_set(snap, idx, rate)

    n_best = int(given_up(len(drop)).sum())
    if int(given_up(0).sum()) <= n_best:
        return lost, None
    lo, hi = 1, len(drop)  # the fewest drops that give up no more than all of them
    while lo < hi:
        mid = (lo + hi) // 2
        if int(given_up(mid).sum()) <= n_best:
            hi = mid
        else:
            lo = mid + 1
    out = lost.copy()
    out[top] &= given_up(lo)
    mask = np.zeros(len(dec_all), dtype=bool)
    mask[drop[:lo]] = True
    return out, mask


def _room_needed(snap: Snapshot, predictor: BatchLatencyPredictor, dec_all: np.ndarray, live: np.ndarray,
                 margin: float) -> bool:
    """Whether Moore-Hodgson on the live prefills gives up a first token at the pace left
    beside every decode keeping the tightest decode TBT (:func:`_pace`): only then does a
    decode sitting out buy a prefill anything (``sit_out_when="needed"``)."""
    if not len(live) or not len(dec_all):
        return bool(len(live))
    tbt_ms = float(snap.tbt_slo[dec_all].min()) * 1e3
    rate = _pace(snap, predictor, len(dec_all), float(snap.kv_tokens[dec_all].sum()), tbt_ms, margin)
    return bool(late_set(snap, live, rate).any())


def _pace(snap: Snapshot, predictor: BatchLatencyPredictor, n_dec: int, dec_u: float, tbt_ms: float,
          margin: float) -> float:
    """Prefill tokens/s beside ``n_dec`` decodes of total context ``dec_u`` that keep one
    token per ``tbt_ms``: each iteration of T̂(decodes + P) ≤ tbt_ms / margin takes the P
    tokens the time left holds at the marginal cost of a full-budget chunk."""
    chunk = max(1, snap.max_batch_tokens - n_dec)
    t_dec = predictor.model(DECODE).base_ms(n_dec, dec_u) if n_dec else 0.0
    room = tbt_ms / margin - t_dec
    if room <= 0:
        return 1e-3  # the decodes alone fill the TBT: no pace to speak of
    c = np.ones(n_dec + 1, np.int64)
    c[-1] = chunk
    uu = np.full(n_dec + 1, dec_u / max(n_dec, 1))
    uu[-1] = 0.0
    per_token = max(predictor.predict_batch_ms(c, uu) - t_dec, 1e-9) / chunk
    tokens = min(float(chunk), room / per_token)
    return tokens / max(tbt_ms, t_dec + per_token * tokens) * 1e3


def _shed(snap: Snapshot, pre: np.ndarray, lost: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, tuple[Rejection, ...]]:
    """Split the sheddable prefills that cannot meet their TTFT (or end-to-end deadline)
    any more off the queue: (the rest of ``pre``, its ``lost`` mask, the rejections).
    Expired ones first (``e2e_expired`` where the end-to-end deadline is the earlier one,
    else ``ttft_expired``), then those the lost rule gives up on (``e2e_unreachable`` or
    ``ttft_unreachable``, by the same test), each in queue (row) order."""
    expired = snap.slack[pre] <= 0
    out = snap.sheddable[pre] & (expired | lost)
    if not out.any():
        return pre, lost, ()
    rej = _rejections(snap, pre[out & expired], "expired")
    rej += _rejections(snap, pre[out & ~expired], "unreachable")
    return pre[~out], lost[~out], rej


def _rejections(snap: Snapshot, rows: np.ndarray, why: str) -> tuple[Rejection, ...]:
    """``ttft_<why>`` for each row, ``e2e_<why>`` where the end-to-end deadline is the
    earlier one (then it is what the slack, and so the verdict, came from)."""
    ids = snap.ids
    if not snap.any_e2e:
        return tuple(Rejection(ids[i], f"ttft_{why}") for i in rows.tolist())
    by_e2e = (snap.e2e_deadline[rows] < snap.ttft_deadline[rows]).tolist()
    return tuple(Rejection(ids[i], f"e2e_{why}" if e else f"ttft_{why}")
                 for i, e in zip(rows.tolist(), by_e2e, strict=True))


def _kv_victims(snap: Snapshot, pre: np.ndarray, lost: np.ndarray, n_dec: int, growth_iters: int,
                decode_reserve: int, shed: bool) -> np.ndarray:
    """Snapshot indices of the requests to preempt so that KV admits the highest class's
    live new prefills (docs/policies.md, Request classes); empty when KV already does.

    c is the highest class with a live new prefill (not started, slack left, not given
    up); it needs min(their remaining tokens, max_batch_tokens) of KV beyond what
    the KV-growth watermark keeps.  Victims are requests of a lower class than c that were
    given up, or whose TTFT passed, part-way through their prefill: they hold KV and
    wait behind every live request (sheddable ones are rejected instead when ``shed``).
    Lowest class first, then the most KV first, until the need is met (each also frees
    its share of the watermark); all of them when that is not enough."""
    started = snap.started[pre]
    live = (snap.slack[pre] > 0) & ~lost
    new = live & ~started
    if not new.any():
        return np.zeros(0, np.int64)
    prio = snap.priority[pre]
    c = prio[new].min()
    parked = started & (lost | (snap.slack[pre] <= 0)) & (prio > c)
    if shed and snap.any_sheddable:
        parked &= ~snap.sheddable[pre]
    if not parked.any():
        return np.zeros(0, np.int64)
    assert snap.free_kv_tokens is not None
    need = int(min(snap.remaining_prefill[pre][new & (prio == c)].sum(), snap.max_batch_tokens))
    holders = int(np.count_nonzero(snap.started))
    avail = snap.free_kv_tokens - growth_iters * holders - decode_reserve * n_dec
    if avail >= need:
        return np.zeros(0, np.int64)
    cand = pre[parked]
    cand = ordered(snap, cand, -snap.priority[cand], -snap.kv_tokens[cand])
    gain = np.cumsum(snap.kv_tokens[cand] + growth_iters)
    m = min(int(np.searchsorted(gain, need - avail)) + 1, len(cand))
    return np.sort(cand[:m])


def _without(snap: Snapshot, gone: np.ndarray) -> Snapshot:
    """``snap`` without the rows ``gone`` (a mask: the requests a plan preempts), their KV
    counted as free: every per-request column is cut the same way, whichever columns the
    snapshot has."""
    keep = ~gone
    free = int(snap.free_kv_tokens or 0) + int(snap.kv_tokens[gone].sum())
    cols = {c.name: getattr(snap, c.name)[keep] for c in COLUMNS}
    ids = tuple(r for r, k in zip(snap.ids, keep.tolist(), strict=True) if k)
    return replace(snap, ids=ids, free_kv_tokens=free, **cols)
