"""A discrete-event simulated LLM engine.

It behaves like a continuous-batching engine with chunked prefill (vLLM V1):
each iteration it builds a snapshot of every arrived, unfinished request,
asks the :class:`~engine_adapter.core.AdapterCore` for a plan (the same code
path a real engine uses), advances its clock by the ground-truth latency of
the executed batch, and reports that latency back.

Semantics:

* A prefill chunk of t tokens adds t tokens to the KV cache; the first output
  token appears at the end of the iteration that computes the last prompt
  token.  A decode step adds one token to the KV cache and emits one token.
* KV is kept in blocks of the profile's block size.  The snapshot reports
  ``free_kv_tokens = free_blocks·B − (B − 1)·n`` for n requests that may be
  scheduled: a request given t tokens needs at most ⌈t/B⌉ new blocks, so a
  plan that respects the reported headroom can always be placed.
* When the headroom cannot hold one more token per running decode, the
  engine preempts the most recently arrived running request (recompute, as
  vLLM does): its blocks are freed and its prompt and generated tokens are
  prefilled again, after which generation continues.
* Token k (1-based) of request i is due at a_i + L_i^ttft + (k − 1)·L_i^tbt
  (formula (1)); a request violates its SLO when any token is late, or, with an
  end-to-end objective (``e2e_slo > 0``), when its last token comes after a_i + e2e_slo_i.
* The simulated clock does not include the policy's own decision time (it is
  measured and reported separately); the ground truth's fixed CPU overhead
  stands for the engine's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler_service.core import BatchLatencyPredictor, Plan, Policy, Snapshot, registry
from scheduler_service.core.columns import COLUMNS, Column
from scheduler_service.core.plan import CODES, Reasons
from scheduler_service.core.reasons import explain

from ..core import AdapterCore, Decision, IterationSample
from .groundtruth import GPUProfile, GroundTruth

__all__ = ["EngineConfig", "Explainer", "SimResult", "SimulatedEngine", "Workload", "adapter_explainer",
           "policy_explainer"]

#: Explains a plan: the same plan with ``reasons`` set (``scheduler_service.core.reasons``).
Explainer = Callable[[Snapshot, Plan], Plan]


def policy_explainer(policy: Policy, predictor: Callable[[], BatchLatencyPredictor]) -> Explainer:
    """Explain the plans ``policy`` made by the reasons post-pass, against the predictor
    ``predictor()`` returns when the plan is explained (the one the plan was made with)."""
    return lambda snapshot, plan: explain(policy, snapshot, predictor(), plan)


def adapter_explainer(adapter: AdapterCore) -> Explainer:
    """The explainer of an adapter whose backend plans in process: a fresh instance of its
    policy (a policy keeps no state between plans) with the backend's current predictor."""
    backend: Any = adapter.backend
    if not hasattr(backend, "predictor"):
        raise ValueError("keep_reasons needs an in-process backend (its predictor) or an explainer")
    policy = registry.create(adapter.settings.policy or "slidingserve", adapter.settings.params)
    return policy_explainer(policy, lambda: backend.predictor)


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Requests to replay, sorted by arrival (columns of equal length)."""

    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_slo: np.ndarray
    tbt_slo: np.ndarray
    protected: np.ndarray
    name: str = ""
    #: Request classes (docs/usage.md): priority (smaller first) and sheddable; None = the
    #: default class for every request (priority 0, not sheddable).
    priority: np.ndarray | None = None
    sheddable: np.ndarray | None = None
    #: End-to-end objective (seconds after arrival for the last token); None or 0 = none.
    e2e_slo: np.ndarray | None = None
    #: Objective on the mean time per output token after the first (seconds); None or 0 =
    #: none.  A request with one is judged by TTFT and mean TPOT instead of formula (1).
    tpot_slo: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.priority is None:
            object.__setattr__(self, "priority", np.zeros(n, np.int64))
        if self.sheddable is None:
            object.__setattr__(self, "sheddable", np.zeros(n, np.bool_))
        for f in ("e2e_slo", "tpot_slo"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, np.zeros(n, np.float64))
        for f in ("prompt_tokens", "output_tokens", "ttft_slo", "tbt_slo", "protected", "priority", "sheddable",
                  "e2e_slo", "tpot_slo"):
            if len(getattr(self, f)) != n:
                raise ValueError(f"workload column {f} has {len(getattr(self, f))} rows, expected {n}")
        if n and np.any(np.diff(self.arrival) < 0):
            raise ValueError("workload arrivals must be sorted")
        if np.any(self.prompt_tokens < 1) or np.any(self.output_tokens < 1):
            raise ValueError("prompt and output lengths must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival)


def _workload_column(w: Workload, c: Column, act: np.ndarray) -> np.ndarray | None:
    """The workload's column ``c`` for the rows ``act`` (None where the workload does not
    carry it: the snapshot's default)."""
    col = getattr(w, c.name, None)
    return None if col is None else col[act]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_tokens: int = 2048
    max_num_seqs: int = 256
    #: Stop as soon as more than this fraction of *all* requests has violated
    #: its SLO (the run can no longer pass a goodput test); None = run to the end.
    stop_violation_fraction: float | None = None
    #: Hard stop on simulated time (seconds), a guard against runaway overload.
    max_sim_time_s: float = 3600.0
    #: Seed of the ground truth's latency noise.
    noise_seed: int = 0
    #: Keep every token's time per request (``SimulatedEngine.token_times``), for judges
    #: that need more than the first and last token.
    keep_token_times: bool = False
    #: Keep each request's reason history (``SimResult.reason_seconds``): every plan is
    #: explained (the plan itself is unchanged) and each iteration's duration is charged to
    #: the reason of every request it leaves waiting.
    keep_reasons: bool = False


@dataclass(slots=True)
class SimResult:
    n_requests: int
    completed: int
    violated: np.ndarray
    ttft_s: np.ndarray
    tbt_s: np.ndarray
    sim_time_s: float
    wall_time_s: float
    iterations: int
    preemptions: int
    stopped_early: bool
    decision_us: np.ndarray
    breakdown_us: dict[str, float]
    paths: dict[str, int]
    adapter: dict[str, Any]
    output_tokens: int
    max_kv_used_blocks: int
    kv_total_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)
    #: Requests a plan rejected (finished early, counted as violated).
    rejected: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: ``EngineConfig.keep_reasons``: reason code → seconds each request spent waiting for
    #: it (an array over requests; only codes some request waited for); else None.
    reason_seconds: dict[str, np.ndarray] | None = None
    #: ``EngineConfig.keep_reasons``: the last code each request waited for ("" = never).
    last_reason: list[str] | None = None

    @property
    def violation_rate(self) -> float:
        """Violations over all requests; unfinished requests count as violated."""
        return float(self.violated.sum()) / max(self.n_requests, 1)

    def summary(self) -> dict[str, Any]:
        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if len(a) else float("nan")

        return {
            "requests": self.n_requests,
            "completed": self.completed,
            "rejected": int(self.rejected.sum()),
            "violation_rate": self.violation_rate,
            "stopped_early": self.stopped_early,
            "ttft_p50_s": pct(self.ttft_s, 50),
            "ttft_p90_s": pct(self.ttft_s, 90),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "ttft_max_s": pct(self.ttft_s, 100),
            "tbt_p50_s": pct(self.tbt_s, 50),
            "tbt_p90_s": pct(self.tbt_s, 90),
            "tbt_p99_s": pct(self.tbt_s, 99),
            "throughput_rps": self.completed / self.sim_time_s if self.sim_time_s > 0 else 0.0,
            "output_tokens_per_s": self.output_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0,
            "iterations": self.iterations,
            "iterations_per_wall_s": self.iterations / self.wall_time_s if self.wall_time_s > 0 else 0.0,
            "preemptions": self.preemptions,
            "decision_us_p50": pct(self.decision_us, 50),
            "decision_us_p99": pct(self.decision_us, 99),
            "breakdown_us_mean": self.breakdown_us,
            "paths": self.paths,
            "adapter": self.adapter,
        }


@dataclass(slots=True)
class _RunTally:
    """What :meth:`SimulatedEngine.run` accumulates over its iterations."""

    decision_us: list[int] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    paths: dict[str, int] = field(default_factory=dict)
    tbt: list[np.ndarray] = field(default_factory=list)
    iterations: int = 0
    completed: int = 0
    rejected: int = 0
    out_tokens: int = 0
    empty_streak: int = 0


class SimulatedEngine:
    def __init__(self, workload: Workload, truth: GroundTruth, profile: GPUProfile,
                 adapter: AdapterCore, config: EngineConfig | None = None, *,
                 explainer: Explainer | None = None) -> None:
        """``explainer`` (with ``config.keep_reasons``): how plans are explained; default
        :func:`adapter_explainer`."""
        self.w = workload
        self.truth = truth
        self.profile = profile
        self.adapter = adapter
        self.cfg = config or EngineConfig()
        n = len(workload)
        self.ids = [f"r{i}" for i in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.block = int(profile.block_size)
        self.total_blocks = int(profile.kv_capacity_tokens) // self.block
        # per-request state
        self.prompt_eff = workload.prompt_tokens.astype(np.int64).copy()  # grows on preemption
        self.computed = np.zeros(n, dtype=np.int64)
        self.generated = np.zeros(n, dtype=np.int64)  # tokens emitted so far (SLO counter)
        self.gen_at_prefill = np.zeros(n, dtype=np.int64)  # generated when the last prefill began
        self.kv = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros(n, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)
        self.violated = np.zeros(n, dtype=bool)
        #: finished by a plan's rejection (overload control): done, and violated
        self.rejected = np.zeros(n, dtype=bool)
        self.first_token = np.full(n, np.nan)
        #: when each request was first given tokens (vLLM's "scheduled" time, from which its
        #: prefill time counts to the first token)
        self.first_scheduled = np.full(n, np.nan)
        #: a token came after its formula (1) deadline (whatever the request is judged by)
        self.late_f1 = np.zeros(n, dtype=bool)
        #: every output token's time per request (``EngineConfig.keep_token_times``), else None
        self.token_times: list[list[float]] | None = [[] for _ in range(n)] if self.cfg.keep_token_times else None
        self.last_token = np.full(n, np.nan)
        self.clock = 0.0
        self.preemptions = 0
        self.used_blocks = 0
        self.max_used_blocks = 0
        self.prefill_ema: float | None = None
        self.on_iteration: Callable[[SimulatedEngine, Snapshot, Any], None] | None = None
        self._init_reasons(n, explainer)

    def _init_reasons(self, n: int, explainer: Explainer | None) -> None:
        """The reason history (``EngineConfig.keep_reasons``): seconds per (request, code)."""
        keep = self.cfg.keep_reasons
        self.explainer = (explainer or adapter_explainer(self.adapter)) if keep else None
        self.reason_s = np.zeros((n, len(CODES))) if keep else None
        self.last_code = np.full(n, -1, dtype=np.int16)
        #: the last plan's waiting requests, their codes, and the time it was made
        self._waiting: tuple[np.ndarray, np.ndarray, float] | None = None
        #: plans not explained (fallback decisions: another policy made them)
        self.unexplained_plans = 0

    # --------------------------------------------------------------- helpers
    def _snapshot(self, act: np.ndarray) -> Snapshot:
        w = self.w
        dec = self.computed[act] == self.prompt_eff[act]
        out = np.where(dec, self.generated[act] - self.gen_at_prefill[act], 0)
        n_sched = min(self.cfg.max_num_seqs, len(act))
        free = (self.total_blocks - self.used_blocks) * self.block - (self.block - 1) * n_sched
        ids = self.ids
        # the token counters are the engine's state; every other column of the schema is a
        # per-request constant of the workload (a column the workload does not carry: the
        # schema's default)
        state = {"prompt_tokens": self.prompt_eff[act], "computed_tokens": self.computed[act], "output_tokens": out,
                 "first_token_time": self._pace_origin(act)}
        return Snapshot.from_columns(
            now=self.clock,
            max_batch_tokens=self.cfg.max_batch_tokens,
            max_num_seqs=self.cfg.max_num_seqs,
            ids=[ids[i] for i in act.tolist()],
            free_kv_tokens=max(0, int(free)),
            prefill_throughput=self.prefill_ema,
            profile=self.profile.key,
            **{c.name: state[c.name] if c.name in state else _workload_column(w, c, act) for c in COLUMNS},
        )

    def _pace_origin(self, act: np.ndarray) -> np.ndarray | None:
        """The snapshot's ``first_token_time``: the first token's time, plus one TPOT
        objective per output token a recompute folded into the prompt (the snapshot counts
        ``output_tokens`` from there); None when no request has a TPOT objective."""
        tpot = self.w.tpot_slo[act]
        if not tpot.any():
            return None
        first = self.first_token[act]
        return np.where(np.isnan(first), self.w.arrival[act], first + self.gen_at_prefill[act] * tpot)

    def _headroom(self, n_active: int) -> int:
        n_sched = min(self.cfg.max_num_seqs, n_active)
        return (self.total_blocks - self.used_blocks) * self.block - (self.block - 1) * n_sched

    def _preempt_if_needed(self, act: np.ndarray) -> None:
        """Recompute-preempt the newest running requests until every running
        decode has room for its next token."""
        while True:
            running = act[self.computed[act] > 0]
            n_dec = int(np.count_nonzero(self.computed[running] == self.prompt_eff[running]))
            if self._headroom(len(act)) >= n_dec or len(running) <= 1:
                return
            self._preempt(int(running[np.argmax(self.w.arrival[running] + 1e-12 * running)]))

    def _preempt(self, victim: int) -> None:
        self.used_blocks -= int(self.blocks[victim])
        self.blocks[victim] = 0
        self.kv[victim] = 0
        self.computed[victim] = 0
        self.prompt_eff[victim] = self.w.prompt_tokens[victim] + self.generated[victim]
        self.gen_at_prefill[victim] = self.generated[victim]
        self.preemptions += 1

    def _late_count(self, act: np.ndarray) -> int:
        """Requests already known to violate: recorded ones plus active ones
        whose next token is overdue."""
        w = self.w
        nxt = w.arrival[act] + w.ttft_slo[act] + self.generated[act] * w.tbt_slo[act]
        nxt = np.where((w.tpot_slo[act] > 0) & (self.generated[act] > 0), np.inf, nxt)  # judged at the end
        e2e = w.e2e_slo[act]
        overdue = ((nxt < self.clock) | ((e2e > 0) & (w.arrival[act] + e2e < self.clock))) & ~self.violated[act]
        return int(self.violated.sum() + overdue.sum())

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        w, cfg = self.w, self.cfg
        n = len(w)
        rng = np.random.default_rng(cfg.noise_seed)
        tally = _RunTally()
        stopped = False
        wall0 = time.perf_counter()
        stop_at = None if cfg.stop_violation_fraction is None else math.floor(cfg.stop_violation_fraction * n)
        while tally.completed + tally.rejected < n:
            arrived = int(np.searchsorted(w.arrival, self.clock, side="right"))
            act = np.flatnonzero(~self.done[:arrived])
            if len(act) == 0:
                if arrived >= n:
                    break
                self.clock = float(w.arrival[arrived])
                continue
            if self.clock > cfg.max_sim_time_s:
                stopped = True
                break
            plan = self._plan_iteration(act, tally)
            if plan.rejections:
                self._reject(plan, tally)
            for rid in plan.preemptions:  # the plan counts their KV as free
                self._preempt(self.index[rid])
            if not plan.allocations:
                self._no_plan(act, arrived, tally)
                continue
            tally.empty_streak = 0
            self._execute(plan, rng, tally)
            if progress is not None and tally.iterations % 256 == 0:
                progress(tally.completed, n)
            if stop_at is not None and tally.iterations % 16 == 0 and self._late_count(act) > stop_at:
                stopped = True
                break
        wall = time.perf_counter() - wall0
        return self._result(tally, wall, stopped)

    def _plan_iteration(self, act: np.ndarray, tally: _RunTally) -> Plan:
        """Preempt if KV is short, ask the adapter for a plan and record the decision."""
        self._preempt_if_needed(act)
        snap = self._snapshot(act)
        decision = self.adapter.decide(snap)
        if self.explainer is not None:
            decision = self._explained(act, snap, decision)
        plan = decision.plan
        tally.decision_us.append(decision.elapsed_us)
        tally.paths[plan.path] = tally.paths.get(plan.path, 0) + 1
        for k, v in plan.breakdown_us.items():
            tally.breakdown[k] = tally.breakdown.get(k, 0.0) + v
        if self.on_iteration is not None:
            self.on_iteration(self, snap, decision)
        return plan

    def _charge_waiting(self) -> None:
        """Charge the time since the last plan to the reason of each request it left
        waiting and that is still in the system."""
        if self._waiting is None or self.reason_s is None:
            return
        idx, codes, since = self._waiting
        self._waiting = None
        live = ~self.done[idx]
        self.reason_s[idx[live], codes[live]] += self.clock - since

    def _explained(self, act: np.ndarray, snap: Snapshot, decision: Decision) -> Decision:
        """The decision with its plan explained; its waiting requests noted (charged when
        the next plan is made, or at the end)."""
        self._charge_waiting()
        if decision.source != "remote" or decision.plan is None or self.explainer is None:
            self.unexplained_plans += 1
            return decision
        plan = self.explainer(snap, decision.plan)
        reasons = plan.reasons
        if isinstance(reasons, Reasons):
            rows, codes = reasons.arrays()[:2]  # classified now: the predictor may refit later
        else:
            rows = np.array([snap.index_of[r.id] for r in reasons], dtype=np.int64)
            codes = np.array([CODES.index(r.code) for r in reasons], dtype=np.int64)
        idx = act[rows]
        self.last_code[idx] = codes
        self._waiting = (idx, codes.astype(np.intp), self.clock)
        return dataclasses.replace(decision, plan=plan)

    def _reason_history(self) -> tuple[dict[str, np.ndarray] | None, list[str] | None]:
        """(code → seconds per request, each request's last code) or (None, None)."""
        if self.reason_s is None:
            return None, None
        self._charge_waiting()
        secs = {c: self.reason_s[:, k].copy() for k, c in enumerate(CODES) if self.reason_s[:, k].any()}
        return secs, [CODES[c] if c >= 0 else "" for c in self.last_code.tolist()]

    def _reject(self, plan: Plan, tally: _RunTally) -> None:
        """Finish the rejected requests now, as an engine aborts them: their KV is freed
        and they count as violated (a rejection never meets an SLO; it saves the GPU
        time the request would have taken for the requests that can still meet theirs)."""
        idx = np.fromiter((self.index[r.id] for r in plan.rejections), np.int64, len(plan.rejections))
        idx = idx[~self.done[idx]]
        self.rejected[idx] = True
        self.violated[idx] = True
        self.done[idx] = True
        self.used_blocks -= int(self.blocks[idx].sum())
        self.blocks[idx] = 0
        self.kv[idx] = 0
        tally.rejected += len(idx)

    def _no_plan(self, act: np.ndarray, arrived: int, tally: _RunTally) -> None:
        """An empty plan: free KV held by stuck partial prefills, or let time pass."""
        w = self.w
        n = len(w)
        running = act[self.computed[act] > 0]
        if len(running) > 1:
            # KV is held by partial prefills that cannot finish: free some.
            self._preempt(int(running[np.argmax(w.arrival[running] + 1e-12 * running)]))
            return
        # Nothing runnable: wait for the next arrival, or a millisecond.
        tally.empty_streak += 1
        nxt = float(w.arrival[arrived]) if arrived < n else self.clock + 1e-3
        self.clock = max(self.clock + 1e-3, min(nxt, self.clock + 0.05))
        if tally.empty_streak > 10_000:
            raise RuntimeError("the engine made no progress for 10,000 iterations")

    def _execute(self, plan: Plan, rng: np.random.Generator, tally: _RunTally) -> None:
        """Run one plan: advance the clock by its true latency, grow KV, advance
        prefills, emit tokens and report the latency to the adapter."""
        idx = np.fromiter((self.index[a.id] for a in plan.allocations), dtype=np.int64,
                          count=len(plan.allocations))
        tok = np.fromiter((a.tokens for a in plan.allocations), dtype=np.int64,
                          count=len(plan.allocations))
        u = self.kv[idx].copy()
        new = idx[np.isnan(self.first_scheduled[idx])]
        self.first_scheduled[new] = self.clock
        latency_ms = self.truth.iteration_ms(tok, u, rng)
        self.clock += latency_ms / 1e3
        tally.iterations += 1
        is_dec = self.computed[idx] == self.prompt_eff[idx]
        self._grow_kv(idx, tok)
        emit = self._advance_prefills(idx, tok, is_dec, latency_ms)
        if len(emit):
            self._emit(emit, tally)
        self.adapter.report(IterationSample(tok, u, latency_ms))

    def _grow_kv(self, idx: np.ndarray, tok: np.ndarray) -> None:
        """Add the scheduled tokens to the KV cache, in blocks."""
        self.kv[idx] += tok
        new_blocks = -(-self.kv[idx] // self.block)
        self.used_blocks += int((new_blocks - self.blocks[idx]).sum())
        self.blocks[idx] = new_blocks
        self.max_used_blocks = max(self.max_used_blocks, self.used_blocks)
        if self.used_blocks > self.total_blocks:
            raise AssertionError("KV cache over capacity: the plan check should make this impossible")

    def _advance_prefills(self, idx: np.ndarray, tok: np.ndarray, is_dec: np.ndarray,
                          latency_ms: float) -> np.ndarray:
        """Count prefill progress, update the prefill-throughput estimate and
        return the requests that emit a token: decodes and finished prefills."""
        pre = idx[~is_dec]
        self.computed[pre] += tok[~is_dec]
        finished_prefill = pre[self.computed[pre] == self.prompt_eff[pre]]
        emit = np.concatenate([idx[is_dec], finished_prefill])
        prefill_tokens = int(tok[~is_dec].sum())
        if prefill_tokens:
            obs = prefill_tokens / (latency_ms / 1e3)
            self.prefill_ema = obs if self.prefill_ema is None else 0.995 * self.prefill_ema + 0.005 * obs
        return emit

    def _emit(self, emit: np.ndarray, tally: _RunTally) -> None:
        """Emit one token each: check it against its deadline, record TTFT/TBT,
        and retire the requests that are done (their KV blocks are freed)."""
        w = self.w
        k = self.generated[emit]  # tokens before this one
        due = w.arrival[emit] + w.ttft_slo[emit] + k * w.tbt_slo[emit]
        late = self.clock > due + 1e-9
        self.late_f1[emit] |= late
        # a request with a TPOT objective: its first token by TTFT, then its mean (at the end)
        self.violated[emit] |= late & ((k == 0) | (w.tpot_slo[emit] <= 0))
        first = k == 0
        self.first_token[emit[first]] = self.clock
        if self.token_times is not None:
            for i in emit.tolist():
                self.token_times[i].append(self.clock)
        gaps = self.clock - self.last_token[emit[~first]]
        tally.tbt.append(gaps)
        self.last_token[emit] = self.clock
        self.generated[emit] += 1
        tally.out_tokens += len(emit)
        fin = emit[self.generated[emit] >= w.output_tokens[emit]]
        if len(fin):
            e2e = w.e2e_slo[fin]  # the last token against the end-to-end deadline, where set
            self.violated[fin] |= (e2e > 0) & (self.clock > w.arrival[fin] + e2e + 1e-9)
            tpot, n_out = w.tpot_slo[fin], w.output_tokens[fin]
            mean = (self.clock - self.first_token[fin]) / np.maximum(n_out - 1, 1)
            self.violated[fin] |= (tpot > 0) & (n_out > 1) & (mean > tpot + 1e-9)
            self.done[fin] = True
            self.used_blocks -= int(self.blocks[fin].sum())
            self.blocks[fin] = 0
            tally.completed += len(fin)

    def _result(self, tally: _RunTally, wall: float, stopped: bool) -> SimResult:
        w = self.w
        n = len(w)
        violated = self.violated | ~self.done
        ttft = self.first_token - w.arrival
        reason_seconds, last_reason = self._reason_history()
        return SimResult(
            n_requests=n,
            completed=tally.completed,
            violated=violated,
            ttft_s=ttft[~np.isnan(ttft)],
            tbt_s=np.concatenate(tally.tbt) if tally.tbt else np.zeros(0),
            sim_time_s=self.clock - (float(w.arrival[0]) if n else 0.0),
            wall_time_s=wall,
            iterations=tally.iterations,
            preemptions=self.preemptions,
            stopped_early=stopped,
            decision_us=np.array(tally.decision_us, dtype=np.float64),
            breakdown_us={k: v / max(len(tally.decision_us), 1) for k, v in tally.breakdown.items()},
            paths=tally.paths,
            adapter=self.adapter.stats(),
            output_tokens=tally.out_tokens,
            max_kv_used_blocks=self.max_used_blocks,
            kv_total_blocks=self.total_blocks,
            rejected=self.rejected.copy(),
            reason_seconds=reason_seconds,
            last_reason=last_reason,
        )
