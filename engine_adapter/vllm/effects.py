"""Which requests a plan's rejections and preemptions still apply to (no vLLM import).

A plan is decided on a view of vLLM's queues that may be a step old (pipelining): by
the time it is executed, requests it rejects may have finished and requests it preempts
may no longer run.  These functions pick the ones the scheduler still acts on; vLLM's
own calls (``finish_requests``, ``_preempt_request``) stay in the scheduler class.
Tests: tests/test_vllm_pipeline.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_service.core import Rejection

__all__ = ["live_rejections", "preemptible"]


def live_rejections(rejections: Sequence[Rejection], requests: Mapping[str, Any]) -> dict[str, str]:
    """Request id → rejection reason, for the rejected requests that are still live
    (known to vLLM and not finished)."""
    reason = {r.id: r.reason for r in rejections}
    return {rid: why for rid, why in reason.items()
            if (q := requests.get(rid)) is not None and not q.is_finished()}


def preemptible(ids: Sequence[str], requests: Mapping[str, Any], running: Sequence[Any], running_status: Any) -> list[Any]:
    """The requests named in ``ids`` that still run (status ``running_status`` and in the
    ``running`` queue), each once, in ``ids`` order."""
    queued = set(map(id, running))
    out: list[Any] = []
    for rid in ids:
        req = requests.get(rid)
        if req is None or req.status != running_status or id(req) not in queued:
            continue
        queued.discard(id(req))
        out.append(req)
    return out
