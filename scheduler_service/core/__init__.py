"""The policy core: numpy, no gRPC, no vLLM, no torch.  Its hot path is written once, as
kernels numba compiles (``kernels/``: ``SLIDINGSERVE_KERNELS``, ``kernels.warm_up()``) and
that run as plain Python without it.

Public surface (pinned by ``tests/test_public_api.py``)."""

from __future__ import annotations

from importlib import resources

from . import registry
from .check import plan_violations
from .errors import FieldViolation, ValidationError
from .plan import Allocation, Plan, Rejection
from .policy import Policy
from .predictor import BatchLatencyPredictor, LinearModel, batch_features, evaluate, fit_predictor
from .snapshot import Request, Snapshot

__all__ = [
    "Allocation",
    "BatchLatencyPredictor",
    "FieldViolation",
    "LinearModel",
    "Plan",
    "Policy",
    "Rejection",
    "Request",
    "Snapshot",
    "ValidationError",
    "batch_features",
    "default_predictor",
    "evaluate",
    "fit_predictor",
    "plan_violations",
    "registry",
]


def default_predictor() -> BatchLatencyPredictor:
    """The bootstrap predictor shipped with the package (see its ``meta``)."""
    text = resources.files(__package__).joinpath("data/default_predictor.json").read_text()
    return BatchLatencyPredictor.from_json(text)
