"""The adapter's decisions on vLLM's queues, as pure functions (no vLLM import).

:class:`~engine_adapter.vllm.scheduler.SlidingServeMixin` keeps only vLLM's hooks; what it
decides about a plan lives here, where tests run without vLLM (tests/test_vllm_fit.py):

* :func:`fit_plan`: the plan vLLM can execute — vLLM's KV block arithmetic and admission
  control applied to a policy's plan (running requests first, as vLLM places them);
* :func:`decodes_needing_block`: how many running decodes need a new KV block for their
  next token (when there are more than free blocks only vLLM's preemption can help);
* :func:`execution_order`: the running and waiting queues ``schedule()`` sees to execute
  a fitted plan, and :func:`restored_order`: vLLM's own queue order again afterwards;
* :func:`kv_headroom`, :func:`decodes_at_block_boundary`, :func:`kv_short`: the KV room a
  snapshot reports and whether only vLLM's preemption can let every decode advance;
* :func:`split_blocked`: the waiting requests a plan may name, and the blocked ones.

A request is anything with vLLM's ``request_id``, ``num_computed_tokens`` and
``num_tokens`` attributes.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler_service.core import Snapshot

__all__ = [
    "Fit", "KvRules", "View", "admission_blocks", "decodes_at_block_boundary", "decodes_needing_block",
    "execution_order", "fit_plan", "kv_headroom", "kv_short", "restored_order", "split_blocked",
]


@dataclass(frozen=True, slots=True)
class KvRules:
    """vLLM's KV and admission state a plan must fit."""

    block_size: int
    #: speculative lookahead tokens every scheduled request reserves room for
    lookahead: int
    free_blocks: int
    #: sequence slots left: min(max_num_running_reqs, max_num_active_reqs) − running
    slots: int
    #: blocks an admission must leave free (vLLM's watermark; 0 while nothing runs)
    watermark: int = 0
    #: ``scheduler_reserve_full_isl``: an admission needs room for its whole prompt
    full_isl: bool = False


@dataclass(slots=True)
class View:
    """One snapshot of vLLM's queues with what executing a plan on it needs."""

    snap: Snapshot
    #: vLLM request objects aligned with the snapshot's rows
    rows: list[Any]
    #: vLLM's ``num_computed_tokens`` per row, and how many leading rows are running
    computed: np.ndarray
    running_rows: int
    #: requests left out because they are blocked (remote KV, grammar, streaming input)
    blocked: set[str]
    #: running requests whose next token needs a new KV block (:func:`decodes_needing_block`);
    #: counted for projected views only
    kv_need: int = 0
    #: per row: the prefix-cache hit (tokens) a waiting row shows as computed, and how many of
    #: its blocks are evictable (cached, held by no request: taking them uses free blocks);
    #: None = no hits (all 0)
    hits: np.ndarray | None = None
    evictable: np.ndarray | None = None
    #: a projected view's KV and admission state, as the next ``schedule()`` should find it
    #: (None: not read); a plan is fitted on it ahead (:func:`.decision.prepare`) and the fit
    #: kept when the state then is no tighter (:func:`.decision.reuse`)
    kv: KvRules | None = None


@dataclass(slots=True)
class Fit:
    """What vLLM can execute of a plan."""

    #: request id → tokens, without what vLLM would refuse (a new dict)
    plan: dict[str, int]
    #: planned running requests, in plan order
    run_order: list[Any] = field(default_factory=list)
    #: planned waiting requests vLLM will admit, in plan order
    admit: list[Any] = field(default_factory=list)
    #: chunks shrunk and admissions dropped
    trimmed: int = 0
    #: non-empty: the running requests need more blocks than are free (vLLM would preempt)
    why: str = ""


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


def fit_plan(view: View, plan: dict[str, int], kv: KvRules, finished: Collection[str] = ()) -> Fit:
    """Mirror vLLM's KV rules on ``plan``: running prefill chunks the free blocks cannot hold
    are shrunk (last planned first), admissions vLLM's own admission control would refuse are
    dropped (free sequence slots; the whole prompt when ``full_isl``; the watermark), and
    ``why`` is set when even then the running requests need more blocks than are free.
    A waiting request's allocation is the tokens beyond its prefix-cache hit (``view.hits``):
    its blocks are the hit's (no new ones, but the evictable ones come out of the free
    blocks, as in vLLM's ``allocate_slots``) and new ones for the allocation.
    ``finished``: requests finished since the view was taken (dropped first)."""
    plan = {k: v for k, v in plan.items() if k not in finished} if finished else dict(plan)
    fit = Fit(plan)
    idx, n, is_run = _rows(view, plan)
    b, la = kv.block_size, kv.lookahead
    comp = view.computed[idx[is_run]]
    need_run = np.maximum(0, _ceil_div(comp + n[is_run] + la, b) + (-comp // b))
    free = kv.free_blocks - int(need_run.sum())
    if free < 0:
        free = _shrink_running(fit, [k for k, r in zip(plan, is_run.tolist(), strict=True) if r],
                               comp, n[is_run], need_run, free, kv)
        if free < 0:
            fit.why = f"running requests need {kv.free_blocks - free} KV blocks, {kv.free_blocks} free"
            return fit
        idx, n, is_run = _rows(view, plan)
    fit.run_order = list(map(view.rows.__getitem__, idx[is_run].tolist()))
    free = _admit(fit, view, list(plan), idx, n, is_run, free, kv)
    if not plan and fit.trimmed:
        # Only admissions were planned (running decodes ahead of their deadlines sat out
        # for them) and vLLM refuses them all: run those decodes rather than nothing.
        _decodes_instead(fit, view, free, kv, finished)
    return fit


def _rows(view: View, plan: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Snapshot row, tokens and whether running, of each planned request (plan order)."""
    idx = np.fromiter(map(view.snap.index_of.__getitem__, plan), np.int64, len(plan))
    n = np.fromiter(plan.values(), np.int64, len(plan))
    return idx, n, idx < view.running_rows


def _shrink_running(fit: Fit, run_keys: list[str], comp: np.ndarray, n_run: np.ndarray, need_run: np.ndarray,
                    free: int, kv: KvRules) -> int:
    """The headroom counts the free tail of every running request's last block, which only
    that request can use; a plan that leaves some running decodes out (they are ahead of
    their deadlines) can ask for more.  Shrink the running prefill chunks, last planned
    first, by the missing blocks; the blocks still missing (negative) or left."""
    b, la = kv.block_size, kv.lookahead
    for j in range(len(run_keys) - 1, -1, -1):
        if free >= 0:
            break
        if n_run[j] <= 1:
            continue  # a decode
        held = _ceil_div(int(comp[j]), b)
        keep = max(0, int(need_run[j]) + free)  # blocks this chunk may still take
        n_new = min(int(n_run[j]), (held + keep) * b - int(comp[j]) - la)
        free += int(need_run[j]) - keep
        if n_new <= 0:
            del fit.plan[run_keys[j]]
        else:
            fit.plan[run_keys[j]] = n_new
        fit.trimmed += 1
    return free


def _admit(fit: Fit, view: View, keys: list[str], idx: np.ndarray, n: np.ndarray, is_run: np.ndarray,
           free: int, kv: KvRules) -> int:
    """Admit the planned waiting requests in plan order while vLLM would; the free blocks left."""
    b, la = kv.block_size, kv.lookahead
    slots = kv.slots
    hits, evictable = view.hits, view.evictable
    for j in np.flatnonzero(~is_run).tolist():
        row = int(idx[j])
        r = view.rows[row]
        comp = r.num_computed_tokens
        if comp == 0 and hits is not None and hits[row] > 0:
            need, full = admission_blocks(int(hits[row]), int(n[j]), r.num_tokens, b, la,
                                          int(evictable[row]) if evictable is not None else 0)
            if not kv.full_isl:
                full = 0
        else:
            held = _ceil_div(comp, b)
            need = max(0, _ceil_div(comp + int(n[j]) + la, b) - held)
            full = max(0, _ceil_div(r.num_tokens, b) - held) if kv.full_isl else 0
        if slots <= 0 or max(need, full) + kv.watermark > free:
            del fit.plan[keys[j]]
            fit.trimmed += 1
            continue
        slots -= 1
        free -= need
        fit.admit.append(r)
    return free


def admission_blocks(hit: int, n: int, num_tokens: int, block_size: int, lookahead: int,
                     evictable: int) -> tuple[int, int]:
    """Free KV blocks vLLM's ``allocate_slots`` takes to admit a waiting request with a
    prefix-cache hit of ``hit`` tokens and ``n`` new tokens, and (``full``) the blocks its
    ``full_sequence_must_fit`` check asks for its whole ``num_tokens``.  The hit's blocks are
    the request's without new allocations, but ``evictable`` of them (held by no request)
    leave the free queue; a hit that ends inside a block needs one more (vLLM's
    copy-on-write of the shared tail)."""
    b = block_size
    local = hit // b  # whole hit blocks; a partial tail block is counted as new below
    need = max(0, _ceil_div(hit + n + lookahead, b) - local) + evictable
    full = max(0, _ceil_div(num_tokens, b) - local) + evictable
    return need, full


def _decodes_instead(fit: Fit, view: View, free: int, kv: KvRules, finished: Collection[str] = ()) -> None:
    """Every running decode whose next token's block is free, in queue order, but those
    ``finished`` since the view was taken (no longer in vLLM's running queue)."""
    b, la = kv.block_size, kv.lookahead
    fit.run_order = []
    for row, r in enumerate(view.rows[:view.running_rows]):
        comp = int(view.computed[row])
        if comp < r.num_tokens - 1 or r.request_id in finished:
            continue  # still prefilling, or gone
        need = max(0, _ceil_div(comp + 1 + la, b) + (-comp // b))
        if need <= free:
            free -= need
            fit.plan[r.request_id] = 1
            fit.run_order.append(r)


def decodes_needing_block(snap: Snapshot, computed: np.ndarray, running_rows: int, block_size: int) -> int:
    """Running requests of a (projected) snapshot whose next token needs a new KV block:
    one token left to compute (a decode, or the last prompt token) at a block boundary."""
    rr = running_rows
    left = snap.prompt_tokens[:rr] - snap.computed_tokens[:rr]
    one = (left == 1) | ((left == 0) & (snap.output_tokens[:rr] >= 1))
    return int(np.count_nonzero(one & (computed[:rr] % block_size == 0)))


def execution_order(running: Sequence[Any], fit: Fit, *, holding: Collection[Any] = (),
                    blocked: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
    """The running and waiting queues ``schedule()`` executes a fitted plan on: planned
    running requests in plan order, then the unplanned ones in their order; only the planned
    waiting requests (plan order) that are not in ``holding`` (vLLM's KV-holding queue, which
    it schedules itself), then the ``blocked`` ones, so that vLLM still promotes them when
    they are ready.  Compared by identity: vLLM's requests are not hashable by value."""
    order = list(fit.run_order)
    if len(order) != len(running):
        planned = set(map(id, order))
        order += [r for r in running if id(r) not in planned]
    if holding:
        held = set(map(id, holding))
        admit = [r for r in fit.admit if id(r) not in held]
    else:
        admit = list(fit.admit)
    return order, admit + list(blocked)


def restored_order(running0: Sequence[Any], waiting0: Sequence[Any], running: Sequence[Any], waiting: Sequence[Any],
                   holding: Collection[Any], shown: Sequence[Any] | None = None) -> tuple[list[Any], list[Any]]:
    """vLLM's own queue order again after a planned ``schedule()`` (``running0``/``waiting0``:
    the queues before it, ``running``/``waiting``: after it, ``holding``: vLLM's KV-holding
    queue now): survivors in their old order, newcomers where vLLM put them (admitted
    requests at the end of running, preempted or promoted ones at the front of waiting).
    ``shown``: the part of ``waiting0`` vLLM saw (default all)."""
    was_running = set(running0)
    now_running = set(running)
    newcomers = [r for r in running if r not in was_running]
    if len(now_running) - len(newcomers) == len(running0):  # nothing left running
        survivors = list(running0)
    else:
        survivors = [r for r in running0 if r in now_running]
    seen = set(waiting0 if shown is None else shown)
    # preempted (from running) or promoted (from kv_holding_waiting) in this step
    front = [r for r in waiting if r not in seen]
    gone = set(newcomers)  # admitted from waiting0 (nothing in waiting0 ran before)
    gone.update(holding)
    rest = [r for r in waiting0 if r not in gone] if gone else list(waiting0)
    return survivors + newcomers, front + rest


def kv_headroom(running: Sequence[Any], block_size: int, free_blocks: int) -> int:
    """Free KV room in tokens: the free blocks plus the unused tail of every running
    request's last block."""
    tail = 0
    for r in running:
        tail += -r.num_computed_tokens % block_size
    return free_blocks * block_size + tail


def decodes_at_block_boundary(running: Sequence[Any], block_size: int) -> int:
    """Running requests (vLLM's, now) whose next token needs a new KV block: at most one
    token left to compute (counting async scheduling's in-flight placeholders) at a block
    boundary."""
    need = 0
    for r in running:
        comp = r.num_computed_tokens
        if comp % block_size == 0 and r.num_tokens + r.num_output_placeholders - comp <= 1:
            need += 1
    return need


def kv_short(need: int, free_blocks: int) -> str:
    """Non-empty when ``need`` decodes need a new KV block and fewer are free: then only
    vLLM's preemption can make progress (the simulator's rule, docs/simulator.md)."""
    return f"{need} decodes need a new KV block, {free_blocks} free" if need > free_blocks else ""


_status_of = operator.attrgetter("status")


def split_blocked(waiting: list[Any], schedulable: frozenset[Any]) -> tuple[list[Any], set[str]]:
    """The waiting requests whose status is in ``schedulable``, and the ids of the others
    (blocked: remote KV load, grammar, streaming input), which a plan cannot know about."""
    if schedulable.issuperset(map(_status_of, waiting)):
        return waiting, set()
    return ([r for r in waiting if r.status in schedulable],
            {r.request_id for r in waiting if r.status not in schedulable})
