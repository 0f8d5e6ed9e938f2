"""The plan a policy returns: the batch allocation A* for one iteration."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["PATHS", "REJECT_REASONS", "Allocation", "Plan", "Rejection"]

#: Paths of the SlidingServe policy; baselines report their own name.
PATHS = ("sliding_chunker", "batch_constructor", "decode_only", "idle")


class Allocation(NamedTuple):
    """(request id, tokens this iteration); a tuple because plans carry hundreds."""

    id: str
    tokens: int


#: Why a plan rejects a request (docs/usage.md, Plan): its TTFT deadline has passed, its
#: end-to-end deadline has passed (and comes before its TTFT deadline), the prediction says
#: its TTFT cannot be met any more, or the same of its end-to-end deadline (where that one
#: comes first).
REJECT_REASONS = ("ttft_expired", "e2e_expired", "ttft_unreachable", "e2e_unreachable")


class Rejection(NamedTuple):
    """A sheddable request the plan gives up on: the engine finishes it now (aborted, with
    ``reason``) instead of spending the GPU on a request that will miss its SLO."""

    id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    """Invariants: ``token_budget == sum(a.tokens for a in allocations)``;
    every ``tokens >= 1``; ids unique and present in the snapshot.

    ``decision_us`` and ``breakdown_us`` are measurements, not decisions: two
    plans for the same snapshot compare equal by :meth:`decision_key`.
    """

    policy: str
    policy_version: str
    predictor_version: str
    path: str
    token_budget: int
    predicted_latency_ms: float
    allocations: tuple[Allocation, ...]
    decision_us: int = 0
    #: Decision time per component (sorter, predictor, chunker, constructor).
    breakdown_us: Mapping[str, int] = field(default_factory=dict)
    #: The deployment (a named entry of the service's policy config) that decided ("" = a
    #: registry policy named directly); set by the service, not by policies.  Not to be
    #: confused with ``policy_version``, the version of the policy's code and parameters.
    deployment: str = ""
    #: Sheddable requests to finish now (overload control); never an allocated one.
    rejections: tuple[Rejection, ...] = ()
    #: Requests holding KV whose KV the engine frees now, to recompute them later (vLLM's
    #: recompute preemption): the plan already counts their KV as free.  Never an
    #: allocated or rejected one.
    preemptions: tuple[str, ...] = ()

    def decision_key(self) -> tuple[Any, ...]:
        key: tuple[Any, ...] = (
            self.policy,
            self.policy_version,
            self.predictor_version,
            self.path,
            self.token_budget,
            self.predicted_latency_ms,
            self.allocations,
        )
        # a plan without rejections or preemptions keeps the key it had before they existed
        if self.rejections:
            key = (*key, self.rejections)
        return (*key, ("preempt", self.preemptions)) if self.preemptions else key

    def tokens_by_id(self) -> dict[str, int]:
        """Request id → tokens this iteration (what an engine executes; ``to_dict`` is the
        whole plan in its JSON form)."""
        return {a.id: a.tokens for a in self.allocations}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "policy_version": self.policy_version,
            "predictor_version": self.predictor_version,
            "path": self.path,
            "token_budget": self.token_budget,
            "predicted_latency_ms": round(self.predicted_latency_ms, 6),
            "allocations": [{"id": a.id, "tokens": a.tokens} for a in self.allocations],
            "decision_us": self.decision_us,
        }
        if self.breakdown_us:
            out["breakdown_us"] = dict(self.breakdown_us)
        if self.deployment:
            out["deployment"] = self.deployment
        if self.rejections:
            out["rejections"] = [{"id": r.id, "reason": r.reason} for r in self.rejections]
        if self.preemptions:
            out["preemptions"] = list(self.preemptions)
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        return cls(
            policy=str(d["policy"]),
            policy_version=str(d.get("policy_version", "")),
            predictor_version=str(d.get("predictor_version", "")),
            path=str(d["path"]),
            token_budget=int(d["token_budget"]),
            predicted_latency_ms=float(d.get("predicted_latency_ms", 0.0)),
            allocations=tuple(Allocation(str(a["id"]), int(a["tokens"])) for a in d["allocations"]),
            decision_us=int(d.get("decision_us", 0)),
            breakdown_us={str(k): int(v) for k, v in d.get("breakdown_us", {}).items()},
            deployment=str(d.get("deployment", "")),
            rejections=tuple(Rejection(str(r["id"]), str(r["reason"])) for r in d.get("rejections", ())),
            preemptions=tuple(str(r) for r in d.get("preemptions", ())),
        )
