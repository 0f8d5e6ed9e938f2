"""The request-column schema: the one description of a snapshot's per-request columns.

Every per-request column of a :class:`~scheduler_service.core.Snapshot` is one
:class:`Column` row of :data:`COLUMNS`: its name (the snapshot attribute, the
``from_columns`` keyword), numpy dtype, default, bounds, JSON key and protobuf field.
Everything else is derived from that table or checked against it: the snapshot's and
``Request``'s declared fields (a test holds them equal), ``COLUMN_DTYPES``, the JSON reader
and writer, protobuf conversion (``scheduler_service.wire.convert``), the simulator's and
the vLLM adapter's snapshot builders, and the validation checks (``validate.CHECKS``).

Adding a request field = a row here (``optional=True``: old clients and engines leave it
out and get the default), its field in ``RequestColumns`` and ``Request`` of the .proto
(``wire`` names it), and the policy that reads ``snapshot.<name>`` (docs/architecture.md,
The request-column schema).

This module imports nothing of the core: the core's modules import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "COLUMNS",
    "COLUMNS_BY_NAME",
    "COUNTER_COLUMNS",
    "MAX_PRIORITY",
    "MAX_SECONDS",
    "MAX_TOKENS",
    "OPTIONAL_COLUMNS",
    "ROW_RULES",
    "V1_COLUMNS",
    "Column",
    "Rule",
]

#: Largest token count accepted anywhere (guards int64 arithmetic downstream).
MAX_TOKENS = 1 << 40
#: Largest magnitude of a time or SLO in seconds (~31,700 years).  Finite is not enough:
#: sums like ``arrival + ttft_slo + k * tbt_slo`` must not overflow to inf downstream.
MAX_SECONDS = 1e12
#: Bound on ``|priority|`` (vLLM takes any int; 32 bits keep keys exact in float64).
MAX_PRIORITY = (1 << 31) - 1

#: What a value of each dtype is called in a violation ("must be a number, got ...").
DTYPE_WORDS: dict[Any, str] = {np.float64: "a number", np.int64: "an integer", np.bool_: "a boolean"}


@dataclass(frozen=True, slots=True)
class Column:
    """One per-request column of a snapshot."""

    #: The snapshot attribute, ``from_columns`` keyword and :class:`Request` field.
    name: str
    #: numpy dtype of the column: ``np.float64``, ``np.int64`` or ``np.bool_``.
    dtype: Any
    #: The value of a request that does not set it (JSON key left out; an optional column
    #: left out everywhere).
    default: Any
    doc: str
    #: A JSON request object must have the key (else it defaults to ``default``).
    required: bool = False
    #: May be left out as a whole (``None`` in ``from_columns``, empty on the wire, absent
    #: from a JSON request): every request then has ``default``.  Written (JSON, wire) only
    #: where some request differs from the default, so older peers never see it.  Every
    #: column added after v1 is optional.
    optional: bool = False
    #: Bounds (None = unbounded on that side); ``lo_open``: ``> lo`` rather than ``>= lo``.
    #: NaN is outside any bounds.
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    #: The violation's description when a value is out of bounds.
    bounds_message: str = ""
    #: Key in a JSON request object; "" = ``name``.
    json_key: str = ""
    #: Field name in protobuf ``RequestColumns`` and ``Request`` (same name in both); "" = ``name``.
    wire: str = ""

    def __post_init__(self) -> None:
        if not self.json_key:
            object.__setattr__(self, "json_key", self.name)
        if not self.wire:
            object.__setattr__(self, "wire", self.name)
        if (self.lo is not None or self.hi is not None) and not self.bounds_message:
            raise ValueError(f"column {self.name}: bounds need a bounds_message")

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None

    def out_of_bounds(self, x: np.ndarray) -> np.ndarray:
        """Mask of the values outside the bounds (NaN included)."""
        ok = np.ones(len(x), np.bool_)
        if self.lo is not None:
            ok &= (x > self.lo) if self.lo_open else (x >= self.lo)
        if self.hi is not None:
            ok &= x <= self.hi
        return ~ok

    def clip(self, v: Any) -> Any:
        """``v`` moved into the bounds, as the bound's own value when it is moved (an open
        lower bound is not reachable by clipping: the caller keeps such values above it)."""
        if self.hi is not None and v > self.hi:
            return self.hi
        if self.lo is not None and v < self.lo:
            return self.lo
        return v


_SLO = f"must be finite and > 0, at most {MAX_SECONDS:g}"

#: The request columns, in wire (field number) order.  The first seven are the v1
#: contract (always present); the rest are optional.
COLUMNS: tuple[Column, ...] = (
    Column("arrival", np.float64, 0.0, "Arrival time, engine clock (s).", required=True,
           lo=-MAX_SECONDS, hi=MAX_SECONDS, bounds_message=f"must be finite, |arrival| <= {MAX_SECONDS:g}"),
    Column("prompt_tokens", np.int64, 0, "Prompt length (tokens); a recomputed request's generated "
           "tokens are folded in.", required=True, lo=1, hi=MAX_TOKENS, bounds_message="must be >= 1"),
    Column("computed_tokens", np.int64, 0, "Prompt tokens already in the KV cache.",
           lo=0, bounds_message="must be >= 0"),
    Column("output_tokens", np.int64, 0, "Tokens generated so far (0 until the prompt is computed).",
           lo=0, hi=MAX_TOKENS, bounds_message="must be >= 0"),
    Column("ttft_slo", np.float64, 0.0, "Time-to-first-token objective (s after arrival).", required=True,
           lo=0, lo_open=True, hi=MAX_SECONDS, bounds_message=_SLO),
    Column("tbt_slo", np.float64, 0.0, "Time-between-tokens objective (s).", required=True,
           lo=0, lo_open=True, hi=MAX_SECONDS, bounds_message=_SLO),
    Column("protected", np.bool_, False, "Never starved by the policy's overload control."),
    Column("priority", np.int64, 0, "Class priority: smaller is served first (vLLM's convention).",
           optional=True, lo=-MAX_PRIORITY, hi=MAX_PRIORITY, bounds_message=f"must be within ±{MAX_PRIORITY}"),
    Column("sheddable", np.bool_, False, "The scheduler may reject the request early when its SLO "
           "cannot be met.", optional=True),
    Column("e2e_slo", np.float64, 0.0, "End-to-end objective: s after arrival by which the last token "
           "must be out; 0 = none.", optional=True, lo=0, hi=MAX_SECONDS,
           bounds_message=f"must be finite and >= 0 (0 = none), at most {MAX_SECONDS:g}"),
    Column("tpot_slo", np.float64, 0.0, "Objective on the mean time per output token after the first "
           "(s); 0 = none.  A request with one is judged by TTFT and mean TPOT (``vllm bench serve "
           "--goodput``), not by formula (1)'s per-token deadlines.", optional=True, lo=0, hi=MAX_SECONDS,
           bounds_message=f"must be finite and >= 0 (0 = none), at most {MAX_SECONDS:g}"),
    Column("first_token_time", np.float64, 0.0, "When the first output token came out (s, engine clock); "
           "read for a decoding request with a tpot_slo, whose pace is counted from it.", optional=True,
           lo=-MAX_SECONDS, hi=MAX_SECONDS, bounds_message=f"must be finite, |first_token_time| <= {MAX_SECONDS:g}"),
    Column("cached_tokens", np.int64, 0, "The part of computed_tokens that are prefix-cache hits of a request "
           "the engine has not admitted yet (0 <= cached_tokens <= computed_tokens): context for the "
           "predictor, not work, but the request holds no KV of its own and has not started "
           "(``Snapshot.started``).", optional=True, lo=0, hi=MAX_TOKENS, bounds_message="must be >= 0"),
)
COLUMNS_BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
#: The v1 columns, which every snapshot carries, and the optional ones, in wire order.
V1_COLUMNS: tuple[Column, ...] = tuple(c for c in COLUMNS if not c.optional)
OPTIONAL_COLUMNS: tuple[Column, ...] = tuple(c for c in COLUMNS if c.optional)
#: The columns an engine derives from its token counters each iteration (the rest are
#: per-request constants, set once when the request arrives).
COUNTER_COLUMNS = ("prompt_tokens", "computed_tokens", "output_tokens", "cached_tokens")


@dataclass(frozen=True, slots=True)
class Rule:
    """An invariant between columns of one row (the request states, docs/usage.md),
    reported under ``column``."""

    column: str
    message: str
    #: Mask of the rows that break it, from the columns by name.
    bad: Callable[[Mapping[str, np.ndarray]], np.ndarray] = field(repr=False)
    #: The optional columns it reads: it applies when any of them is there (the others
    #: read as their defaults).  Empty: it applies when ``column`` is there.
    reads: tuple[str, ...] = ()


def _get(a: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """Column ``name`` of ``a``, or its default for every row when left out."""
    x = a.get(name)
    if x is None:
        c = COLUMNS_BY_NAME[name]
        return np.full(len(a["prompt_tokens"]), c.default, c.dtype)
    return x


ROW_RULES: tuple[Rule, ...] = (
    Rule("computed_tokens", "exceeds prompt_tokens", lambda a: a["computed_tokens"] > a["prompt_tokens"]),
    Rule("output_tokens", "must be 0 while the prompt is not fully computed",
         lambda a: (a["computed_tokens"] < a["prompt_tokens"]) & (a["output_tokens"] > 0)),
    Rule("output_tokens", "must be >= 1 once the prompt is fully computed",
         lambda a: (a["computed_tokens"] == a["prompt_tokens"]) & (a["output_tokens"] < 1)),
    Rule("first_token_time", "must be set (>= arrival) for a decoding request with a tpot_slo",
         lambda a: (_get(a, "tpot_slo") > 0) & (a["output_tokens"] > 0) & (_get(a, "first_token_time") < a["arrival"]),
         reads=("tpot_slo", "first_token_time")),
    Rule("cached_tokens", "exceeds computed_tokens (cached tokens are a part of the computed ones)",
         lambda a: (a["cached_tokens"] > 0) & (a["cached_tokens"] > a["computed_tokens"]), reads=("cached_tokens",)),
)
