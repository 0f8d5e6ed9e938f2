"""Policies by name.  Registering a name twice raises; asking for an unknown
name raises a :class:`ValidationError` that lists the valid names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ValidationError
from .params import describe as describe_params
from .params import override
from .policy import Policy

__all__ = ["PolicySpec", "create", "describe", "names", "register", "version_of"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    base_version: str
    doc: str
    default_params: Any
    factory: Callable[[str, str, Any], Policy]


_REGISTRY: dict[str, PolicySpec] = {}


def register(spec: PolicySpec) -> PolicySpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"policy {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def _spec(name: str) -> PolicySpec:
    _load_builtin()
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
    _load_builtin()
    return list(_REGISTRY)


def describe(name: str) -> dict[str, Any]:
    spec = _spec(name)
    return {
        "name": spec.name,
        "version": spec.base_version,
        "doc": spec.doc,
        "params": describe_params(spec.default_params),
    }


def _load_builtin() -> None:
    # Imported lazily so that the policy modules can import this one.
    from . import baselines, slidingserve  # noqa: F401
