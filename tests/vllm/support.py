"""Real vLLM 0.33 schedulers on CPU, driven by a fake model runner with ground-truth step times.

The schedulers, requests and fake model outputs are those of
:mod:`engine_adapter.vllm.testbed` (vLLM's own CPU scheduler tests' configuration: a
model folder with only ``config.json``, a hand-built ``KVCacheConfig``).  The driver plays
EngineCore's role: ``schedule()``, "execute" (a sampled token for every request whose
chunk reaches its last known token, the step's time taken from the simulated GPU's ground
truth on a fake clock), ``update_from_output()``; with async scheduling step k+1 is
scheduled before step k's output is applied, as vLLM's batch queue does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np

from engine_adapter.sim.groundtruth import load_ground_truth
from engine_adapter.vllm.testbed import (
    BLOCK,
    build_scheduler,
    fake_output,
    make_request,
    model_dir,
    scheduler_class,
)

__all__ = ["BLOCK", "Driver", "FakeClock", "RunResult", "batch_cu", "build_scheduler", "fake_output",
           "make_request", "model_dir", "scheduler_class", "workload"]


class FakeClock:
    """Advanced by the driver by each step's ground-truth time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


def workload(n: int, seed: int = 0, *, max_prompt: int = 600, max_out: int = 24) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(8, max_prompt)), int(rng.integers(1, max_out))) for _ in range(n)]


def batch_cu(so: Any) -> tuple[np.ndarray, np.ndarray]:
    computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    computed.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                        strict=False))
    c = np.array(list(so.num_scheduled_tokens.values()), np.int64)
    u = np.array([computed[r] for r in so.num_scheduled_tokens], np.int64)
    return c, u


@dataclass
class RunResult:
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # request -> output tokens
    scheduled: dict[str, int] = field(default_factory=dict)  # request -> tokens computed
    preempted: set[str] = field(default_factory=set)
    step_ms: list[float] = field(default_factory=list)
    plans: list[tuple[dict[str, int], dict[str, int]]] = field(default_factory=list)


class Driver:
    """EngineCore's loop, minus the model."""

    def __init__(self, sched: Any, clock: FakeClock | None = None, *, async_scheduling: bool, seed: int = 0,
                 wall_ms: float = 0.0) -> None:
        self.sched = sched
        self.clock = clock or FakeClock()
        self.async_ = async_scheduling
        self.truth = load_ground_truth("a100-tp2-llama2-7b")
        self.rng = np.random.default_rng(seed)
        self.res = RunResult()
        self.pending: tuple[Any, Any] | None = None
        #: also sleep this long per step (real time for the gRPC tests' fault injection)
        self.wall_ms = wall_ms

    def _execute(self, so: Any, out: Any) -> None:
        if so.total_num_scheduled_tokens:
            c, u = batch_cu(so)
            ms = self.truth.iteration_ms(c, u, self.rng)
            self.clock.advance(ms)
            self.res.step_ms.append(ms)
            if self.wall_ms:
                time.sleep(self.wall_ms / 1e3)
        eco = self.sched.update_from_output(so, out)
        for v in eco.values():
            for o in v.outputs:
                if o.finish_reason is not None:
                    self.res.finished[o.request_id] = self.sched_outputs.get(o.request_id, 0) + len(o.new_token_ids)
                else:
                    self.sched_outputs[o.request_id] = self.sched_outputs.get(o.request_id, 0) + len(o.new_token_ids)

    def step(self) -> Any:
        so = self.sched.schedule()
        self.res.steps += 1
        for r, n in so.num_scheduled_tokens.items():
            self.res.scheduled[r] = self.res.scheduled.get(r, 0) + n
        self.res.preempted |= set(so.preempted_req_ids)
        out = fake_output(self.sched, so)
        if self.async_:
            prev, self.pending = self.pending, (so, out)
            if prev is not None:
                self._execute(*prev)
        else:
            self._execute(so, out)
        return so

    sched_outputs: dict[str, int]

    def run(self, max_steps: int = 20_000, on_step: Callable[[int, Any], None] | None = None) -> RunResult:
        self.sched_outputs = {}
        idle = 0
        for k in range(max_steps):
            if not self.sched.has_requests() and self.pending is None:
                return self.res
            so = self.step()
            if on_step is not None:
                on_step(k, so)
            if so.total_num_scheduled_tokens == 0:
                if self.async_ and self.pending is not None:
                    prev, self.pending = self.pending, None
                    self._execute(*prev)
                idle += 1
                if idle > 50:
                    raise AssertionError("no progress for 50 steps")
            else:
                idle = 0
        raise AssertionError(f"not finished after {max_steps} steps")


def check_prepared_fits(s: Any, seen: dict[str, int]) -> None:
    """Check, at every step of scheduler ``s`` that keeps a fit prepared in the background
    (``engine_adapter.vllm.decision.reuse``), that it is the fit the step would have made
    itself on vLLM's KV state then and the view's prefix hits.  (Not the hits looked up
    again: a refit counts the blocks of a shared prefix that became evictable meanwhile once
    per admission, where vLLM takes them once; the kept fit is the closer one, and the
    callers check that vLLM executes it exactly.)  ``seen`` counts the steps that kept one
    ("reused") and those that fitted again ("refitted")."""
    from engine_adapter.vllm.decision import fit_answer, reuse

    take = s._take

    def checking_take(view: Any, decision: Any, last_error: str, free_blocks: int, *, stale: bool,
                      prepared: Any = None) -> Any:
        if prepared is not None:
            kv, finished = s._kv_rules(free_blocks), (s.finished_req_ids if stale else ())
            kept = reuse(prepared, kv, finished)
            if kept is not None:
                assert kept == fit_answer(prepared.answer, view, kv, finished)
            key = "refitted" if kept is None else "reused"
            seen[key] = seen.get(key, 0) + 1
        return take(view, decision, last_error, free_blocks, stale=stale, prepared=prepared)

    s._take = checking_take
