"""The plan a policy returns: the batch allocation A* for one iteration."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

import numpy as np

__all__ = ["PATHS", "REASON_CODES", "REJECT_REASONS", "Allocation", "Plan", "Reason", "Reasons", "Rejection"]

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


#: Why a plan does not fully serve a request (docs/policies.md, "Why a request waited:
#: reason codes"): (code, one-line description with the unit of the reason's value).
REASON_CODES: tuple[tuple[str, str], ...] = (
    ("max_num_seqs", "the plan already holds max_num_seqs requests; value: the limit (requests)"),
    ("token_budget", "the plan's token budget is used up; value: the budget (tokens)"),
    ("time_budget", "the decode windows' time budget (TimeToBudget(T_cur), the k-window split) ends "
                    "before this request in the queue; value: the first window W_1 (ms)"),
    ("kv", "no free KV left for its next token; value: free KV tokens left after the plan (tokens)"),
    ("kv_watermark", "a new admission must leave the KV-growth watermark free; value: the watermark "
                     "(tokens: kv_growth_iters x requests holding KV)"),
    ("given_up", "the lost rule gave it up (Moore-Hodgson / hopeless): served only after every live "
                 "request; value: its TTFT slack (ms)"),
    ("expired", "its TTFT deadline has passed (not sheddable): served only after every live request; "
                "value: its slack (ms, <= 0)"),
    ("ahead", "a decode far ahead of its next token's deadline sits out; value: its slack (ms)"),
    ("late", "a decode already past its deadline (not starving) sits out; value: its slack (ms, <= 0)"),
    ("class_sit_out", "a lower-class decode sits out so a higher-class decode makes its token; "
                      "value: its class (priority)"),
    ("class_rescue", "a lower-class decode sits out so the top class's prefills lose fewer first "
                     "tokens; value: the number of decodes sitting out"),
    ("class_reserve", "a new request of a class that waits while the decodes and partial prefills "
                      "take the reserve; value: their predicted time (ms)"),
    ("not_chosen", "BatchConstructor chose a batch without it; value: the prefills it chose"),
    ("behind", "behind other requests in the policy's queue order; value: the requests served"),
    ("ttft_expired", "rejected: its TTFT deadline has passed; value: its slack (ms)"),
    ("e2e_expired", "rejected: its end-to-end deadline has passed; value: its slack (ms)"),
    ("ttft_unreachable", "rejected: the prediction says its TTFT cannot be met; value: its slack (ms)"),
    ("e2e_unreachable", "rejected: the prediction says its end-to-end deadline cannot be met; "
                        "value: its slack (ms)"),
    ("preempted", "its KV is freed to admit a higher class (recompute later); value: the KV tokens "
                  "freed"),
)
#: The codes alone, in :data:`REASON_CODES` order (a code's index is its wire-free number).
CODES: tuple[str, ...] = tuple(c for c, _ in REASON_CODES)


class Reason(NamedTuple):
    """Why the plan does not fully serve request ``id``: ``code`` (one of
    :data:`REASON_CODES`) and the binding quantity ``value`` (its unit set by the code)."""

    id: str
    code: str
    value: float


class Reasons(Sequence[Reason]):
    """An immutable sequence of :class:`Reason`, kept as arrays (snapshot rows, code
    indices into ``names``, values) and turned into objects only when read: a plan
    leaving hundreds of requests waiting costs no Python objects until someone looks.
    ``names`` is the code table the indices refer to: :data:`CODES` (the default) for
    reasons classified here, the plan's own table for reasons decoded from the wire.
    With ``compute`` the arrays themselves are computed on first read (``compute()``
    returns them; it must only read immutable inputs).  Compares equal to any sequence of
    the same reasons."""

    __slots__ = ("_arrays", "_compute", "_ids", "_items", "names")

    def __init__(self, ids: Sequence[str], rows: np.ndarray | None = None, codes: np.ndarray | None = None,
                 values: np.ndarray | None = None, *,
                 compute: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
                 names: Sequence[str] | None = None) -> None:
        self._ids = ids
        self._arrays = None if compute is not None else (rows, codes, values)
        self._compute = compute
        self._items: tuple[Reason, ...] | None = None
        self.names: tuple[str, ...] = CODES if names is None else tuple(names)

    @property
    def ids(self) -> Sequence[str]:
        """The snapshot's request ids the rows refer to."""
        return self._ids

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(snapshot rows, code indices into :attr:`names`, values), computed if need be."""
        if self._arrays is None:
            assert self._compute is not None
            self._arrays = self._compute()
        return self._arrays  # type: ignore[return-value]

    @property
    def items(self) -> tuple[Reason, ...]:
        if self._items is None:
            ids, names = self._ids, self.names
            rows, codes, values = self.arrays()
            self._items = tuple(
                Reason(ids[i], names[c], float(v))
                for i, c, v in zip(rows.tolist(), codes.tolist(), values.tolist(), strict=True)
            )
        return self._items

    def counts(self) -> dict[str, int]:
        """Code → how many requests wait for it, in :attr:`names` order (for metrics: no
        :class:`Reason` objects are built)."""
        names = self.names
        c = np.bincount(self.arrays()[1], minlength=len(names)).tolist()
        return {names[k]: int(v) for k, v in enumerate(c) if v}

    def __len__(self) -> int:
        return len(self.arrays()[0])

    @overload
    def __getitem__(self, k: int) -> Reason: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[Reason, ...]: ...
    def __getitem__(self, k: int | slice) -> Reason | tuple[Reason, ...]:
        return self.items[k]

    def __iter__(self) -> Iterator[Reason]:
        return iter(self.items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self.items == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.items)

    def __repr__(self) -> str:
        return f"Reasons({self.items!r})"


def _reasons(items: Iterable[Mapping[str, Any]]) -> tuple[Reason, ...]:
    return tuple(Reason(str(r["id"]), str(r["code"]), float(r.get("value", 0.0))) for r in items)


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
    #: Why each request the plan does not fully serve waits: one :class:`Reason` per such
    #: request, or empty when the plan was made without explaining (``reasons.explain``).
    #: An explanation, not a decision: not part of :meth:`decision_key`.
    reasons: Sequence[Reason] = ()

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
        if self.reasons:
            out["reasons"] = [{"id": r.id, "code": r.code, "value": r.value} for r in self.reasons]
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
            reasons=_reasons(d.get("reasons", ())),
        )
