"""Validation errors that carry per-field details.

The gRPC edge turns a :class:`ValidationError` into INVALID_ARGUMENT with a
``google.rpc.BadRequest`` (one ``FieldViolation`` per entry); the CLI prints
its one-line ``str()``.  Keeping the details structured here means neither edge
has to parse messages.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FieldViolation", "ValidationError"]


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


class ValidationError(ValueError):
    """Raised for any bad input; ``violations`` lists every problem found."""

    def __init__(self, violations: list[FieldViolation] | tuple[FieldViolation, ...]):
        self.violations = tuple(violations)
        if not self.violations:
            raise ValueError("ValidationError needs at least one violation")
        shown = "; ".join(str(v) for v in self.violations[:3])
        more = len(self.violations) - 3
        super().__init__(shown + (f" (and {more} more)" if more > 0 else ""))

    @classmethod
    def single(cls, field: str, description: str) -> ValidationError:
        return cls([FieldViolation(field, description)])
