"""Policies by name.  The built-in policies are the one list :data:`BUILTIN`;
registering a name twice raises; asking for an unknown name raises a
:class:`ValidationError` that lists the valid names.

The registry also hands the compiled kernels their warm-up (:func:`.kernels.warm_up`
runs every registered policy on tiny snapshots): the kernels stand below the policies
and do not import them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from . import baselines, kernels, slidingserve
from .baselines import (
    QoServeParams,
    QoServePolicy,
    SarathiParams,
    SarathiPolicy,
    VllmFcfsParams,
    VllmFcfsPolicy,
)
from .errors import ValidationError
from .kernels._warm import exercise
from .params import describe as describe_params
from .params import override
from .policy import Policy, PolicySpec
from .predictor import BatchLatencyPredictor
from .slidingserve import SlidingServeParams, SlidingServePolicy

__all__ = ["BUILTIN", "PolicySpec", "create", "describe", "names", "register", "version_of"]

#: Every built-in policy, in the order :func:`names` lists them.
BUILTIN: tuple[PolicySpec, ...] = (
    PolicySpec(
        "vllm-fcfs", baselines.VERSION,
        "vLLM V1 default: running first, then waiting, FCFS, fixed max_batch_tokens.",
        VllmFcfsParams(), VllmFcfsPolicy,
    ),
    PolicySpec(
        "vllm-priority", baselines.VERSION,
        "vLLM V1 --scheduling-policy priority: as vllm-fcfs, each group by (priority, arrival).",
        VllmFcfsParams(), lambda n, v, p: VllmFcfsPolicy(n, v, p, by_priority=True),
    ),
    PolicySpec(
        "sarathi", baselines.VERSION,
        "Sarathi-Serve: fixed chunk budget, decodes first, then prefills FCFS.",
        SarathiParams(), lambda n, v, p: SarathiPolicy(n, v, p, edf=False),
    ),
    PolicySpec(
        "sarathi-edf", baselines.VERSION,
        "Sarathi-EDF: fixed chunk budget, decodes first, prefills by TTFT deadline.",
        SarathiParams(), lambda n, v, p: SarathiPolicy(n, v, p, edf=True),
    ),
    PolicySpec(
        "qoserve", baselines.VERSION,
        "QoServe: dynamic chunking on the smallest decode slack, hybrid priority, eager relegation.",
        QoServeParams(), QoServePolicy,
    ),
    PolicySpec(
        "slidingserve", slidingserve.VERSION,
        "SlidingServe: MLPS order, violation check, BatchConstructor or SlidingChunker (k-window).",
        SlidingServeParams(), SlidingServePolicy,
    ),
    PolicySpec(
        "sarathi-edf+sc", slidingserve.VERSION,
        "Ablation: Sarathi-EDF order with the SlidingChunker budget (no MLPS, no BatchConstructor).",
        SlidingServeParams(order="edf", batch_constructor=False), SlidingServePolicy,
    ),
    PolicySpec(
        "sarathi-edf+sc+mlps", slidingserve.VERSION,
        "Ablation: MLPS order with the SlidingChunker budget (no BatchConstructor).",
        SlidingServeParams(order="mlps", batch_constructor=False), SlidingServePolicy,
    ),
)

_REGISTRY: dict[str, PolicySpec] = {}


def register(spec: PolicySpec) -> PolicySpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"policy {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


for _builtin in BUILTIN:
    register(_builtin)


def _spec(name: str) -> PolicySpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValidationError.single("policy", f"unknown policy {name!r}; valid: {', '.join(names())}")
    return spec


def version_of(spec: PolicySpec, params: Any) -> str:
    """``base_version`` for default parameters, ``base_version+<hash>`` else."""
    if params == spec.default_params:
        return spec.base_version
    body = json.dumps(dataclasses.asdict(params), sort_keys=True)
    return f"{spec.base_version}+{hashlib.sha256(body.encode()).hexdigest()[:8]}"


def create(name: str, overrides: Mapping[str, Any] | None = None) -> Policy:
    """Build policy ``name`` with validated parameter overrides."""
    spec = _spec(name)
    params = override(spec.default_params, overrides)
    return spec.factory(spec.name, version_of(spec, params), params)


def names() -> list[str]:
    return list(_REGISTRY)


def describe(name: str) -> dict[str, Any]:
    spec = _spec(name)
    return {
        "name": spec.name,
        "version": spec.base_version,
        "doc": spec.doc,
        "params": describe_params(spec.default_params),
    }


def _warm_up_kernels() -> None:
    """What :func:`.kernels.warm_up` runs: every registered policy on the warm-up
    snapshots, with the bundled predictor (``default_predictor()``'s file)."""
    text = resources.files(__package__).joinpath("data/default_predictor.json").read_text()
    exercise(create, names(), BatchLatencyPredictor.from_json(text))


kernels.set_warm_up(_warm_up_kernels)
