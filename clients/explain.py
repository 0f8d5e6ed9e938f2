"""``slidingserve explain``: why each request of a snapshot waits (issue 24).

Decides one iteration for a snapshot JSON file, with its reasons, and prints a table, one
row per request: its state (``decode`` / ``prefill`` part-way through its prompt /
``waiting`` for its first token), the remaining prefill tokens, its slack (ms), the
tokens the plan gives it, and the reason code and value of every request the plan
does not fully serve (blank for the fully served ones).  The waiting ones come first,
in :data:`~scheduler_service.core.reasons.REASON_CODES` order, then by slack.
``--json`` prints the explained plan (``reasons: [{id, code, value}]``).  The codes:
docs/reasons.md.

Offline (the default) the plan is
:func:`scheduler_service.core.reasons.plan_explained` of a local policy and predictor.
With ``--server`` a running service decides and explains it (``ScheduleRequest.explain``),
with its own deployed policy version and its learned predictor for the snapshot's engine
profile (``--profile`` names another); a line above the table names the deployment,
policy version and predictor version that decided.  TLS and a token come from the
``SLIDINGSERVE_TLS_*`` / ``SLIDINGSERVE_TOKEN*`` variables, as for the other commands that
talk to a server.  Asking does not touch the service's
``slidingserve_requests_waiting_by_reason`` gauge, which follows the engines' sampled plans.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from clients.errors import CliError
from scheduler_service.client import ClientSecurity, EngineProfile, SchedulerClient
from scheduler_service.core import BatchLatencyPredictor, Plan, Snapshot, registry
from scheduler_service.core.reasons import CODES, plan_explained, reason_counts
from scheduler_service.wire.convert import snapshot_to_pb

__all__ = ["add_subcommand", "cmd_explain", "decided_by", "rows", "table"]

HEADER = ("id", "state", "remaining", "slack_ms", "tokens", "reason", "value")


def _state(snap: Snapshot) -> list[str]:
    dec = snap.is_decoding
    part = ~dec & snap.started
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


def decided_by(server: str, plan: Plan) -> str:
    """The line naming what decided a service's plan: its deployment (when the service has
    a policy config), policy and version, and predictor version."""
    who = [f"deployment {plan.deployment}"] if plan.deployment else []
    who += [f"policy {plan.policy} version {plan.policy_version}", f"predictor version {plan.predictor_version}"]
    return f"decided by {server}: " + ", ".join(who)


def _waiting(snap: Snapshot, plan: Plan) -> bool:
    """Does ``plan`` leave a request of ``snap`` not fully served?"""
    got = plan.tokens_by_id()
    need = np.where(snap.is_decoding, 1, snap.remaining_prefill).tolist()
    return any(got.get(rid, 0) < n for rid, n in zip(snap.ids, need, strict=True))


def _remote(args: argparse.Namespace, snap: Snapshot, params: dict[str, str]) -> Plan:
    """The service's explained plan for ``snap``."""
    if args.predictor:
        raise CliError("--predictor applies offline only; a server explains with its own predictor")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CliError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    sent = snap if args.profile is None else snapshot_to_pb(snap, profile=EngineProfile.parse(args.profile))
    with SchedulerClient(args.server, timeout_s=args.timeout, security=ClientSecurity.from_env()) as client:
        plan = client.schedule(sent, policy=args.policy, params=params, explain=True)
    if not plan.reasons and _waiting(snap, plan):
        raise CliError(f"the service at {args.server} sent no reasons (a release before "
                       "ScheduleRequest.explain, or a plan it could not explain)")
    return plan


def cmd_explain(args: argparse.Namespace, read_json: Callable[[str, str], Any],
                params: Callable[[Sequence[str] | None], dict[str, str]],
                load_predictor: Callable[[str | None], BatchLatencyPredictor]) -> int:
    """``slidingserve explain``; the helpers are the CLI's own (clients/cli.py), so that the
    snapshot, parameters and predictor are read exactly as ``plan`` reads them."""
    snap = Snapshot.from_json(read_json(args.snapshot, "snapshot"))
    if args.server:
        plan = _remote(args, snap, params(args.param))
    else:
        if args.profile is not None:
            raise CliError("--profile applies with --server only")
        policy = registry.create(args.policy or "slidingserve", params(args.param))
        plan = plan_explained(policy, snap, load_predictor(args.predictor))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        if args.server:
            print(decided_by(args.server, plan))
        print(table(snap, plan))
    return 0


def add_subcommand(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    """Register ``explain`` on the CLI's subparsers (``func`` runs it)."""
    s = sub.add_parser("explain", help="why each request of a snapshot waits: the plan's reason codes")
    s.add_argument("--snapshot", required=True, help="snapshot JSON (docs/usage.md), '-' for stdin")
    s.add_argument("--policy", help="policy name (default slidingserve; with --server a deployment or policy "
                                    "name, default the server's; see `slidingserve policies`)")
    s.add_argument("--predictor", help="predictor JSON (default: the built-in one; offline only)")
    s.add_argument("--param", action="append", metavar="KEY=VALUE", help="policy parameter override")
    s.add_argument("--json", action="store_true", help="print the explained plan as JSON")
    s.add_argument("--server", metavar="HOST:PORT",
                   help="ask a running service to decide and explain (its policy version and learned predictor)")
    s.add_argument("--profile", metavar="MODEL|HARDWARE|tpN",
                   help="with --server: the engine profile whose predictor decides (default: the snapshot's)")
    s.add_argument("--timeout", type=float, default=5.0, help="per-call deadline in seconds (with --server)")
    s.set_defaults(func=func)
