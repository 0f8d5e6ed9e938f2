"""Engine profile keys: which engines share one batch-latency predictor.

Engines of one (model, hardware, tensor-parallel degree) run batches at the same speed, so
they share a predictor and their reports refit it together; different profiles never mix.
The key is a plain string so that it can travel in a core :class:`Snapshot` (``profile``)
and in logs and metric labels.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineProfile"]

_SEP = "|"
MAX_NAME = 256


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """A profile; ``tensor_parallel`` 0 is normalised to 1 (proto3 default)."""

    model: str = ""
    hardware: str = ""
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel == 0:
            object.__setattr__(self, "tensor_parallel", 1)
        for name in ("model", "hardware"):
            v = getattr(self, name)
            if _SEP in v or len(v) > MAX_NAME:
                raise ValueError(f"{name} must not contain {_SEP!r} and be at most {MAX_NAME} characters")
        if not 1 <= self.tensor_parallel <= 4096:
            raise ValueError("tensor_parallel must be in [1, 4096]")

    @property
    def key(self) -> str:
        """``model|hardware|tp<N>``; the all-default profile has key ``"||tp1"``."""
        return f"{self.model}{_SEP}{self.hardware}{_SEP}tp{self.tensor_parallel}"

    @classmethod
    def from_key(cls, key: str) -> EngineProfile:
        """Inverse of :attr:`key`; raises ``ValueError`` for anything else."""
        parts = key.split(_SEP)
        if len(parts) != 3 or not parts[2].startswith("tp") or not parts[2][2:].isdigit():
            raise ValueError(f"not an engine profile key (model|hardware|tp<N>): {key!r}")
        return cls(parts[0], parts[1], int(parts[2][2:]))

    @classmethod
    def parse(cls, text: str) -> EngineProfile:
        """Lenient form for users: ``""`` is the default profile, a key parses as a key, and
        any other string (e.g. a snapshot JSON's free-form ``profile``) names the model."""
        if not text:
            return cls()
        try:
            return cls.from_key(text)
        except ValueError:
            return cls(model=text)

    def __str__(self) -> str:
        return self.key
