"""Check a plan against the snapshot it answers.

Engines run this on every plan they receive (a plan from a remote service is
untrusted input) and the property tests run it on every plan a policy makes.
"""

from __future__ import annotations

import numpy as np

from .plan import CODES, Plan, Reasons
from .snapshot import Snapshot

__all__ = ["plan_violations"]


def plan_violations(snapshot: Snapshot, plan: Plan, *, limit: int = 10) -> list[str]:
    """Every way ``plan`` breaks the snapshot's limits (empty when valid).

    A valid plan names only known requests, each at most once, with
    1 ≤ tokens ≤ what the request still needs (1 for a decode), and stays
    within ``max_batch_tokens``, ``max_num_seqs`` and ``free_kv_tokens``.  A rejection
    names a known, sheddable request, at most once, that the plan does not also run; its
    reason is not checked (``REJECT_REASONS`` lists today's, a later service may add one).
    Reasons (when the plan has any): each names a known request, at most once, that the
    plan does not fully serve, with a code of ``REASON_CODES``; and every request the plan
    does not fully serve has one.
    """
    problems: list[str] = []
    seen, total = _check_allocations(snapshot, plan, limit, problems)
    if total != plan.token_budget:
        problems.append(f"token_budget {plan.token_budget} != sum of allocations {total}")
    if total > snapshot.max_batch_tokens:
        problems.append(f"{total} tokens exceed max_batch_tokens {snapshot.max_batch_tokens}")
    if len(plan.allocations) > snapshot.max_num_seqs:
        problems.append(f"{len(plan.allocations)} requests exceed max_num_seqs {snapshot.max_num_seqs}")
    preempted, freed = _check_preemptions(snapshot, plan, seen, problems)
    if snapshot.free_kv_tokens is not None and total > snapshot.free_kv_tokens + freed:
        extra = f" + {freed} freed by preemption" if freed else ""
        problems.append(f"{total} tokens exceed free_kv_tokens {snapshot.free_kv_tokens}{extra}")
    _check_rejections(snapshot, plan, seen, preempted, problems)
    if plan.reasons:
        _check_reasons(snapshot, plan, problems)
    return problems[:limit]


def _check_allocations(snapshot: Snapshot, plan: Plan, limit: int, problems: list[str]) -> tuple[set[str], int]:
    """Each allocation on its own (appended to ``problems``, stopping at ``limit``): the ids
    allocated and the tokens they add up to."""
    index = snapshot.index_of
    seen: set[str] = set()
    total = 0
    for a in plan.allocations:
        if len(problems) >= limit:
            break
        i = index.get(a.id)
        if i is None:
            problems.append(f"unknown request {a.id!r}")
            continue
        if a.id in seen:
            problems.append(f"request {a.id!r} allocated twice")
            continue
        seen.add(a.id)
        need = 1 if snapshot.is_decoding[i] else int(snapshot.remaining_prefill[i])
        if not 1 <= a.tokens <= need:
            problems.append(f"request {a.id!r} gets {a.tokens} tokens, allowed 1..{need}")
        total += a.tokens
    return seen, total


def _check_preemptions(snapshot: Snapshot, plan: Plan, seen: set[str],
                       problems: list[str]) -> tuple[set[str], int]:
    """Each preemption (appended to ``problems``): the ids preempted and the KV tokens freed."""
    index = snapshot.index_of
    freed = 0
    preempted: set[str] = set()
    for rid in plan.preemptions:
        i = index.get(rid)
        if i is None:
            problems.append(f"preempts unknown request {rid!r}")
        elif not snapshot.started[i]:
            problems.append(f"preempts request {rid!r}, which holds no KV")
        elif rid in seen:
            problems.append(f"preempts request {rid!r} and also allocates it tokens")
        elif rid in preempted:
            problems.append(f"preempts request {rid!r} twice")
        else:
            freed += int(snapshot.kv_tokens[i])
        preempted.add(rid)
    return preempted, freed


def _check_rejections(snapshot: Snapshot, plan: Plan, seen: set[str], preempted: set[str],
                      problems: list[str]) -> None:
    """Each rejection (appended to ``problems``)."""
    index = snapshot.index_of
    rejected: set[str] = set()
    for r in plan.rejections:
        i = index.get(r.id)
        if i is None:
            problems.append(f"rejects unknown request {r.id!r}")
        elif not snapshot.sheddable[i]:
            problems.append(f"rejects request {r.id!r}, which is not sheddable")
        elif r.id in seen:
            problems.append(f"rejects request {r.id!r} and also allocates it tokens")
        elif r.id in rejected:
            problems.append(f"rejects request {r.id!r} twice")
        elif r.id in preempted:
            problems.append(f"rejects request {r.id!r} and also preempts it")
        rejected.add(r.id)


def _check_reasons(snapshot: Snapshot, plan: Plan, problems: list[str]) -> None:
    """Each reason (appended to ``problems``), then the requests left without one."""
    if _reason_arrays_hold(snapshot, plan):
        return  # the common case, on arrays; any problem is found and named below
    index = snapshot.index_of
    got = plan.tokens_by_id()
    codes = set(CODES)
    explained: set[str] = set()
    for r in plan.reasons:
        i = index.get(r.id)
        if i is None:
            problems.append(f"reason for unknown request {r.id!r}")
            continue
        need = 1 if snapshot.is_decoding[i] else int(snapshot.remaining_prefill[i])
        if r.id in explained:
            problems.append(f"two reasons for request {r.id!r}")
        elif got.get(r.id, 0) >= need:
            problems.append(f"reason {r.code!r} for request {r.id!r}, which the plan fully serves")
        if r.code not in codes:
            problems.append(f"unknown reason code {r.code!r} for request {r.id!r}")
        explained.add(r.id)
    for i, rid in enumerate(snapshot.ids):
        need = 1 if snapshot.is_decoding[i] else int(snapshot.remaining_prefill[i])
        if got.get(rid, 0) < need and rid not in explained:
            problems.append(f"request {rid!r} waits without a reason")


def _reason_arrays_hold(snapshot: Snapshot, plan: Plan) -> bool:
    """Whether reasons kept as arrays over this snapshot's rows (decoded from the compact
    wire form, or classified here) pass every check of :func:`_check_reasons` — on numpy,
    without a :class:`~.plan.Reason` per request, so that an engine can check a reason in
    every plan.  False when they are not such arrays, or when something is wrong (the
    per-reason loop then names it)."""
    rs = plan.reasons
    if not isinstance(rs, Reasons) or (rs.ids is not snapshot.ids and list(rs.ids) != list(snapshot.ids)):
        return False
    rows, codes, _ = rs.arrays()
    n = len(snapshot)
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n):
        return False
    if not set(rs.names[int(c)] for c in np.unique(codes)) <= set(CODES):
        return False
    need = np.where(snapshot.is_decoding, 1, snapshot.remaining_prefill)
    got = np.zeros(n, np.int64)
    index = snapshot.index_of
    for a in plan.allocations:
        i = index.get(a.id)
        if i is not None:
            got[i] = a.tokens
    waiting = np.zeros(n, np.int64)
    np.add.at(waiting, rows, 1)
    # each waiting request exactly once, and nothing else
    return bool(np.array_equal(waiting, (got < need).astype(np.int64)))
