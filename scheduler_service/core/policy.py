"""The policy contract.

Call cycle: an engine builds a :class:`~.snapshot.Snapshot` every iteration,
the service calls ``policy.plan(snapshot, predictor)`` and returns the
:class:`~.plan.Plan`; the engine executes it and reports the measured latency,
which eventually becomes a new predictor version.  A policy object is
immutable and holds no per-engine state: the same snapshot, policy version and
predictor version always give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .plan import Plan
from .predictor import BatchLatencyPredictor
from .snapshot import Snapshot

__all__ = ["Policy", "PolicySpec"]


@runtime_checkable
class Policy(Protocol):
    @property
    def name(self) -> str:
        """Registry name, e.g. ``"slidingserve"``."""
        ...

    @property
    def version(self) -> str:
        """Changes whenever the policy's behaviour or parameters change."""
        ...

    @property
    def params(self) -> Any:
        """Frozen dataclass of typed parameters (see :mod:`.params`)."""
        ...

    def plan(self, snapshot: Snapshot, predictor: BatchLatencyPredictor) -> Plan:
        """Decide one iteration.  Must respect every limit of the snapshot.

        Reasons (optional, docs/reasons.md): a class attribute ``explains = True`` promises
        ``plan(snapshot, predictor, explain=True)``, the same plan with a reason for every
        request it does not fully serve, classified (``reasons.classify``) from a
        ``reasons.Facts`` record of what the decision knew (``reasons.plan_explained`` calls
        it); a method ``facts(snapshot, predictor, plan) -> reasons.Facts`` rebuilds that
        record for a plan it made before (``reasons.explain``; without it a plan's reasons
        are the engine's limits only)."""
        ...


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A registrable policy: ``factory(name, version, params)`` builds it."""

    name: str
    base_version: str
    doc: str
    default_params: Any
    factory: Callable[[str, str, Any], Policy]
