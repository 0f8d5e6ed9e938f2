"""``slidingserve explain``: why each request of a snapshot waits (issue 24).

Decides one iteration for a snapshot JSON file offline, with its reasons
(:func:`scheduler_service.core.reasons.plan_explained`), and prints a table, one row
per request: its state (``decode`` / ``prefill`` part-way through its prompt /
``waiting`` for its first token), the remaining prefill tokens, its slack (ms), the
tokens the plan gives it, and the reason code and value of every request the plan
does not fully serve (blank for the fully served ones).  The waiting ones come first,
in :data:`~scheduler_service.core.reasons.REASON_CODES` order, then by slack.
``--json`` prints the explained plan (``reasons: [{id, code, value}]``).

Offline only: a live service explains only one plan in ``explain_every`` (its
``slidingserve_requests_waiting_by_reason`` gauge), so asking it for one snapshot's
reasons is not a service call (yet).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from scheduler_service.core import BatchLatencyPredictor, Plan, Snapshot, registry
from scheduler_service.core.reasons import CODES, plan_explained, reason_counts

__all__ = ["add_subcommand", "cmd_explain", "rows", "table"]

HEADER = ("id", "state", "remaining", "slack_ms", "tokens", "reason", "value")


def _state(snap: Snapshot) -> list[str]:
    dec = snap.is_decoding
    part = ~dec & (snap.computed_tokens > 0)
    return np.where(dec, "decode", np.where(part, "prefill", "waiting")).tolist()


def rows(snap: Snapshot, plan: Plan) -> list[tuple[str, str, int, float, int, str, str]]:
    """One row per request (:data:`HEADER`), the waiting ones first (by code order, then
    slack), then the fully served ones (by slack)."""
    got = plan.tokens_by_id()
    why = {r.id: (r.code, r.value) for r in plan.reasons}
    order = {c: k for k, c in enumerate(CODES)}
    state = _state(snap)
    remaining = snap.remaining_prefill.tolist()
    slack = (snap.slack * 1e3).tolist()
    out = []
    for i, rid in enumerate(snap.ids):
        code, value = why.get(rid, ("", None))
        out.append((rid, state[i], int(remaining[i]), float(slack[i]), int(got.get(rid, 0)), code,
                    "" if value is None else f"{value:g}"))
    out.sort(key=lambda r: (r[5] == "", order.get(r[5], len(order)), r[3]))
    return out


def table(snap: Snapshot, plan: Plan) -> str:
    """The table :func:`cmd_explain` prints, with a summary line of the reason counts."""
    body = [(r[0], r[1], str(r[2]), f"{r[3]:.1f}", str(r[4]), r[5], r[6]) for r in rows(snap, plan)]
    widths = [max(len(h), *(len(b[k]) for b in body)) if body else len(h) for k, h in enumerate(HEADER)]
    right = {2, 3, 4, 6}

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if k in right else c.ljust(w)
                         for k, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    counts = reason_counts(plan.reasons)
    waiting = sum(counts.values())
    summary = f"{plan.policy} ({plan.path}): {len(snap) - waiting} of {len(snap)} requests fully served"
    if counts:
        summary += "; waiting: " + ", ".join(f"{c} {n}" for c, n in counts.items())
    return "\n".join([summary, fmt(HEADER), *(fmt(b) for b in body)])


def cmd_explain(args: argparse.Namespace, read_json: Callable[[str, str], Any],
                params: Callable[[Sequence[str] | None], dict[str, str]],
                load_predictor: Callable[[str | None], BatchLatencyPredictor]) -> int:
    """``slidingserve explain``; the helpers are the CLI's own (clients/cli.py), so that the
    snapshot, parameters and predictor are read exactly as ``plan`` reads them."""
    snap = Snapshot.from_json(read_json(args.snapshot, "snapshot"))
    policy = registry.create(args.policy or "slidingserve", params(args.param))
    plan = plan_explained(policy, snap, load_predictor(args.predictor))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(table(snap, plan))
    return 0


def add_subcommand(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    """Register ``explain`` on the CLI's subparsers (``func`` runs it)."""
    s = sub.add_parser("explain", help="why each request of a snapshot waits: the plan's reason codes")
    s.add_argument("--snapshot", required=True, help="snapshot JSON (docs/usage.md), '-' for stdin")
    s.add_argument("--policy", help="policy name (default slidingserve; see `slidingserve policies`)")
    s.add_argument("--predictor", help="predictor JSON (default: the built-in one)")
    s.add_argument("--param", action="append", metavar="KEY=VALUE", help="policy parameter override")
    s.add_argument("--json", action="store_true", help="print the explained plan as JSON")
    s.set_defaults(func=func)
