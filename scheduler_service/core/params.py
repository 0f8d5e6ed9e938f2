"""Typed, bounded policy parameters that a request may override.

Each policy declares a frozen dataclass of parameters; every field carries its
bounds and a docstring in ``metadata``.  :func:`override` applies overrides
given as strings (CLI ``--param window=1``) or numbers (protobuf map values)
and reports every bad key or value at once, listing the valid keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import FieldViolation, ValidationError

__all__ = ["describe", "override", "param", "param_text"]

P = TypeVar("P")


def param(default: Any, *, doc: str, lo: float | None = None, hi: float | None = None,
          choices: tuple[Any, ...] | None = None) -> Any:
    """A parameter field with bounds (inclusive) and a one-line description."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "lo": lo, "hi": hi, "choices": choices}
    )


def param_text(value: Any) -> str:
    """A parameter value as text, the form of the wire's and the config's string maps:
    booleans are ``true`` / ``false`` (what :func:`override` reads back), the rest ``str``."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    if typ in (int, "int"):
        if isinstance(raw, bool):
            raise ValueError("must be an integer")
        if isinstance(raw, float):
            if not raw.is_integer():
                raise ValueError("must be an integer")
            return int(raw)
        return int(raw)
    if typ in (float, "float"):
        if isinstance(raw, bool):
            raise ValueError("must be a number")
        v = float(raw)
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v
    if typ in (bool, "bool"):
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError("must be a boolean")
    return str(raw)


def override(base: P, overrides: Mapping[str, Any] | None, *, prefix: str = "params") -> P:
    """Return ``base`` with ``overrides`` applied and validated."""
    if not overrides:
        return base
    fields = {f.name: f for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    errs: list[FieldViolation] = []
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        f = fields.get(key)
        if f is None:
            errs.append(FieldViolation(f"{prefix}.{key}",
                                       f"unknown parameter; valid: {', '.join(sorted(fields))}"))
            continue
        try:
            v = _coerce(key, f.type, raw)
        except (TypeError, ValueError) as e:
            msg = str(e) if "must" in str(e) else f"cannot parse {raw!r} as {f.type}"
            errs.append(FieldViolation(f"{prefix}.{key}", msg))
            continue
        md = f.metadata
        if md.get("choices") is not None and v not in md["choices"]:
            errs.append(FieldViolation(f"{prefix}.{key}", f"must be one of {list(md['choices'])}, got {v!r}"))
            continue
        if md.get("lo") is not None and v < md["lo"]:
            errs.append(FieldViolation(f"{prefix}.{key}", f"must be >= {md['lo']}, got {v!r}"))
            continue
        if md.get("hi") is not None and v > md["hi"]:
            errs.append(FieldViolation(f"{prefix}.{key}", f"must be <= {md['hi']}, got {v!r}"))
            continue
        changes[key] = v
    if errs:
        raise ValidationError(errs)
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def describe(params: Any) -> list[dict[str, Any]]:
    """Name, type, default, bounds and doc of each parameter (for ListPolicies)."""
    out = []
    for f in dataclasses.fields(params):
        md = f.metadata
        out.append({
            "name": f.name,
            "type": f.type if isinstance(f.type, str) else f.type.__name__,
            "default": getattr(params, f.name),
            "min": md.get("lo"),
            "max": md.get("hi"),
            "choices": list(md["choices"]) if md.get("choices") else None,
            "doc": md.get("doc", ""),
        })
    return out
