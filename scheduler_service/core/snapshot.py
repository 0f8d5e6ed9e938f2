"""The engine's queue snapshot: what a policy sees in one iteration.

A snapshot is columnar (one numpy array per request attribute) because every
policy works on whole columns at once and the wire format is columnar too.
All times are on the *engine's* clock (``now`` included): a policy never reads
its own clock, so a snapshot replays to the same plan byte for byte.

Request states (docs/usage.md, Formats):

* waiting    — ``computed_tokens == 0``
* prefilling — ``0 < computed_tokens < prompt_tokens``
* decoding   — ``computed_tokens == prompt_tokens`` (then ``output_tokens >= 1``)

``output_tokens`` must be 0 until the prompt is fully computed; an engine that
recomputes a preempted request folds its generated tokens into the prompt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FieldViolation, ValidationError

__all__ = [
    "CLASS_COLUMN_DTYPES", "COLUMN_DTYPES", "DEFAULT_MAX_REQUESTS", "MAX_BATCH_TOKENS", "MAX_PRIORITY",
    "MAX_SECONDS", "Request", "Snapshot",
]

#: Upper bound on requests in one snapshot unless the caller sets another.
DEFAULT_MAX_REQUESTS = 100_000
#: Largest token count accepted anywhere (guards int64 arithmetic downstream).
MAX_TOKENS = 1 << 40
#: Largest ``max_batch_tokens``.  Policies build per-token curves up to the iteration's
#: budget (O(budget) memory and time: ~70 MB and 0.1-0.2 s at this bound, 8 GB at 10^8),
#: so an unbounded budget would let one request exhaust the server's memory.  2^20 is
#: above any engine's per-iteration token budget (vLLM: 2k-64k, whole 1M-token prompts).
MAX_BATCH_TOKENS = 1 << 20
#: Largest magnitude of a time or SLO in seconds (~31,700 years).  Finite is not enough:
#: sums like ``arrival + ttft_slo + k * tbt_slo`` must not overflow to inf downstream.
MAX_SECONDS = 1e12
#: Bounds of ``prefill_throughput`` (tokens/s): policies divide remaining tokens by it
#: times a slack (up to ~1e24 s with the bounds above), which must stay finite.
MIN_THROUGHPUT, MAX_THROUGHPUT = 1e-3, 1e12


#: The request columns of a snapshot and their dtypes, in wire (field number) order.
COLUMN_DTYPES: dict[str, Any] = {
    "arrival": np.float64,
    "prompt_tokens": np.int64,
    "computed_tokens": np.int64,
    "output_tokens": np.int64,
    "ttft_slo": np.float64,
    "tbt_slo": np.float64,
    "protected": np.bool_,
}
#: The request-class columns (docs/usage.md, SLO classes): optional everywhere.  A
#: snapshot without them is all priority 0, nothing sheddable, no end-to-end objective
#: (the v1 contract).
CLASS_COLUMN_DTYPES: dict[str, Any] = {
    "priority": np.int64,
    "sheddable": np.bool_,
    "e2e_slo": np.float64,
}
#: Bound on ``|priority|`` (vLLM takes any int; 32 bits keep keys exact in float64).
MAX_PRIORITY = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the engine sees it; a row of a :class:`Snapshot`."""

    id: str
    arrival: float
    prompt_tokens: int
    computed_tokens: int = 0
    output_tokens: int = 0
    ttft_slo: float = 1.0
    tbt_slo: float = 0.1
    protected: bool = False
    #: Class priority: smaller is served first (vLLM's convention); 0 by default.
    priority: int = 0
    #: The scheduler may reject this request early when its SLO cannot be met.
    sheddable: bool = False
    #: End-to-end objective: seconds after arrival by which the last token must be out;
    #: 0 = none.
    e2e_slo: float = 0.0


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """A validated, immutable snapshot.  Build it with :meth:`from_requests`,
    :meth:`from_columns` or :meth:`from_json`; the constructor itself does not
    validate.

    Invariants (checked by :meth:`validate`): all columns have ``len(ids)``
    rows; ids are unique non-empty strings; ``0 <= computed_tokens <=
    prompt_tokens``; ``prompt_tokens >= 1``; ``output_tokens == 0`` while
    ``computed_tokens < prompt_tokens`` and ``>= 1`` once equal; times and SLOs
    finite, SLOs > 0 (``e2e_slo`` >= 0, 0 = none); ``max_batch_tokens >= 1``,
    ``max_num_seqs >= 1``.
    """

    now: float
    max_batch_tokens: int
    max_num_seqs: int
    ids: tuple[str, ...]
    arrival: np.ndarray
    prompt_tokens: np.ndarray
    computed_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_slo: np.ndarray
    tbt_slo: np.ndarray
    protected: np.ndarray
    free_kv_tokens: int | None = None
    prefill_throughput: float | None = None
    #: Engine profile key (model/hardware/TP); informational for policies.
    profile: str = ""
    #: Class columns (:data:`CLASS_COLUMN_DTYPES`); left out (empty), the defaults are filled in.
    priority: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sheddable: np.ndarray = field(default_factory=lambda: np.zeros(0, np.bool_))
    e2e_slo: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name, dtype in CLASS_COLUMN_DTYPES.items():
            col = getattr(self, name)
            if col is None or (n and len(col) == 0):
                object.__setattr__(self, name, _readonly(np.zeros(n, dtype)))

    # ------------------------------------------------------------------ build
    @classmethod
    def from_columns(
        cls,
        *,
        now: float,
        max_batch_tokens: int,
        max_num_seqs: int,
        ids: Sequence[str],
        arrival: Any,
        prompt_tokens: Any,
        computed_tokens: Any,
        output_tokens: Any,
        ttft_slo: Any,
        tbt_slo: Any,
        protected: Any,
        free_kv_tokens: int | None = None,
        prefill_throughput: float | None = None,
        profile: str = "",
        max_requests: int = DEFAULT_MAX_REQUESTS,
        priority: Any = None,
        sheddable: Any = None,
        e2e_slo: Any = None,
    ) -> Snapshot:
        """Validate columns and build a snapshot; raises :class:`ValidationError`.
        ``priority``, ``sheddable`` and ``e2e_slo`` may be left out (None): all 0 / False / 0."""
        errs: list[FieldViolation] = []
        scal = _validate_scalars(
            errs, now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput
        )
        n = len(ids)
        _limit_requests(errs, n, max_requests)
        cols = {
            "arrival": (arrival, np.float64),
            "prompt_tokens": (prompt_tokens, np.int64),
            "computed_tokens": (computed_tokens, np.int64),
            "output_tokens": (output_tokens, np.int64),
            "ttft_slo": (ttft_slo, np.float64),
            "tbt_slo": (tbt_slo, np.float64),
            "protected": (protected, np.bool_),
        }
        for name, values in (("priority", priority), ("sheddable", sheddable), ("e2e_slo", e2e_slo)):
            if values is not None:
                cols[name] = (values, CLASS_COLUMN_DTYPES[name])
        ids_t, arrays = _validate_requests(errs, ids, cols, n)
        return cls._checked(scal, ids_t, arrays, profile)

    @classmethod
    def from_arrays(
        cls,
        *,
        now: float,
        max_batch_tokens: int,
        max_num_seqs: int,
        ids: tuple[str, ...],
        columns: Mapping[str, np.ndarray],
        free_kv_tokens: int | None = None,
        prefill_throughput: float | None = None,
        profile: str = "",
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> Snapshot:
        """:meth:`from_columns` for a decoder that already holds typed columns: ``ids`` a
        tuple of ``str`` and ``columns`` one fresh 1-D array per request column with the
        column's dtype (``COLUMN_DTYPES``), handed over (kept, not copied, made read-only).

        The wire decoder builds exactly that from protobuf's typed repeated fields, so the
        per-element type checks and copies of :meth:`from_columns` (most of its time on a
        768-request snapshot) cannot find anything and are skipped; every value check is
        the same, vectorised, with the same violations in the same order.  Anything else
        (a wrong dtype, a missing column) is the caller's bug: ``TypeError``.
        """
        errs: list[FieldViolation] = []
        scal = _plain_scalars(now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput)
        if scal is None:  # something to report: the generic checks name it
            scal = _validate_scalars(
                errs, now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput
            )
        n = len(ids)
        _limit_requests(errs, n, max_requests)
        arrays = _typed_columns(errs, columns, n)
        if not _str_ids_ok(ids):
            _validate_ids(errs, ids)
        if errs:
            raise ValidationError(errs)
        if not _rows_ok(arrays):
            _validate_rows(errs, arrays)
            raise ValidationError(errs)
        return cls._checked(scal, ids, arrays, profile)

    @classmethod
    def _checked(cls, scal: tuple[float, int, int, int | None, float | None], ids: tuple[str, ...],
                 arrays: Mapping[str, np.ndarray], profile: str) -> Snapshot:
        """The snapshot of validated scalars (as :func:`_validate_scalars` returns them) and
        columns, the columns made read-only."""
        return cls(
            now=scal[0],
            max_batch_tokens=scal[1],
            max_num_seqs=scal[2],
            ids=ids,
            free_kv_tokens=scal[3],
            prefill_throughput=scal[4],
            profile=str(profile),
            **{k: _readonly(v) for k, v in arrays.items()},  # type: ignore[arg-type]
        )

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[Request],
        *,
        now: float,
        max_batch_tokens: int = 2048,
        max_num_seqs: int = 256,
        free_kv_tokens: int | None = None,
        prefill_throughput: float | None = None,
        profile: str = "",
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> Snapshot:
        reqs = list(requests)
        return cls.from_columns(
            now=now,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=max_num_seqs,
            ids=[r.id for r in reqs],
            arrival=[r.arrival for r in reqs],
            prompt_tokens=[r.prompt_tokens for r in reqs],
            computed_tokens=[r.computed_tokens for r in reqs],
            output_tokens=[r.output_tokens for r in reqs],
            ttft_slo=[r.ttft_slo for r in reqs],
            tbt_slo=[r.tbt_slo for r in reqs],
            protected=[r.protected for r in reqs],
            priority=[r.priority for r in reqs],
            sheddable=[r.sheddable for r in reqs],
            e2e_slo=[r.e2e_slo for r in reqs],
            free_kv_tokens=free_kv_tokens,
            prefill_throughput=prefill_throughput,
            profile=profile,
            max_requests=max_requests,
        )

    # ------------------------------------------------------------------- JSON
    @classmethod
    def from_json(
        cls, data: str | bytes | Mapping[str, Any], *, max_requests: int = DEFAULT_MAX_REQUESTS
    ) -> Snapshot:
        """Parse the JSON form (docs/usage.md) (a string or a decoded object)."""
        data = _json_object(data)
        errs, reqs = _top_level(data, max_requests)
        cols = _request_columns(errs, reqs)
        if errs:
            raise ValidationError(errs)
        _validate_json_types(errs, data, cols)
        if errs:
            raise ValidationError(errs)
        return cls.from_columns(
            now=data["now"],
            max_batch_tokens=data["max_batch_tokens"],
            max_num_seqs=data["max_num_seqs"],
            free_kv_tokens=data.get("free_kv_tokens"),
            prefill_throughput=data.get("prefill_throughput"),
            profile=data.get("profile", "") or "",
            ids=cols["id"],
            arrival=cols["arrival"],
            prompt_tokens=cols["prompt_tokens"],
            computed_tokens=cols["computed_tokens"],
            output_tokens=cols["output_tokens"],
            ttft_slo=cols["ttft_slo"],
            tbt_slo=cols["tbt_slo"],
            protected=cols["protected"],
            priority=cols["priority"],
            sheddable=cols["sheddable"],
            e2e_slo=cols["e2e_slo"],
            max_requests=max_requests,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "now": self.now,
            "max_batch_tokens": self.max_batch_tokens,
            "max_num_seqs": self.max_num_seqs,
        }
        if self.free_kv_tokens is not None:
            out["free_kv_tokens"] = self.free_kv_tokens
        if self.prefill_throughput is not None:
            out["prefill_throughput"] = self.prefill_throughput
        if self.profile:
            out["profile"] = self.profile
        out["requests"] = [
            {
                "id": rid,
                "arrival": float(self.arrival[i]),
                "prompt_tokens": int(self.prompt_tokens[i]),
                "computed_tokens": int(self.computed_tokens[i]),
                "output_tokens": int(self.output_tokens[i]),
                "ttft_slo": float(self.ttft_slo[i]),
                "tbt_slo": float(self.tbt_slo[i]),
                "protected": bool(self.protected[i]),
            }
            for i, rid in enumerate(self.ids)
        ]
        # the class fields only where they differ from the default (the v1 form stays as it was)
        for name, col in (("priority", self.priority), ("sheddable", self.sheddable), ("e2e_slo", self.e2e_slo)):
            for i in np.flatnonzero(col).tolist():
                out["requests"][i][name] = col[i].item()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def requests(self) -> list[Request]:
        return [Request(**r) for r in self.to_dict()["requests"]]

    # ---------------------------------------------------------------- derived
    def __len__(self) -> int:
        return len(self.ids)

    @property
    def index_of(self) -> dict[str, int]:
        """Row of each request id."""
        d = self._cache.get("index_of")
        if d is None:
            d = {rid: i for i, rid in enumerate(self.ids)}
            self._cache["index_of"] = d
        return d

    @property
    def is_decoding(self) -> np.ndarray:
        return self._memo("is_decoding", lambda: self.computed_tokens == self.prompt_tokens)

    @property
    def remaining_prefill(self) -> np.ndarray:
        """r_i = p_i − c_i (formula 10); 0 for decodes."""
        return self._memo("remaining", lambda: self.prompt_tokens - self.computed_tokens)

    @property
    def ttft_deadline(self) -> np.ndarray:
        return self._memo("ttft_deadline", lambda: self.arrival + self.ttft_slo)

    @property
    def e2e_deadline(self) -> np.ndarray:
        """a_i + e2e_slo_i, by when the last token must be out; +inf without an objective."""
        return self._memo("e2e_deadline", lambda: np.where(self.e2e_slo > 0, self.arrival + self.e2e_slo, np.inf))

    @property
    def any_e2e(self) -> bool:
        """Some request has an end-to-end objective."""
        return self._flag("any_e2e", lambda: self.e2e_slo.any())

    @property
    def slack(self) -> np.ndarray:
        """s_i: TTFT slack for prefills (11), TBT slack for decodes (formula (1)); where the
        request has an end-to-end objective, at most the time left to its deadline
        (``e2e_deadline − now``)."""

        def compute() -> np.ndarray:
            k = np.where(self.is_decoding, self.output_tokens, 0)
            s = self.arrival + self.ttft_slo + k * self.tbt_slo - self.now
            if self.any_e2e:  # else exactly formula (1), bit for bit
                s = np.minimum(s, self.e2e_deadline - self.now)
            return s

        return self._memo("slack", compute)

    @property
    def one_class(self) -> bool:
        """Every request has the same priority (the v1 contract, and the common case): the
        class-aware steps of a policy can skip their per-subset checks."""
        p = self.priority
        return self._flag("one_class", lambda: len(p) == 0 or p.min() == p.max())

    @property
    def any_sheddable(self) -> bool:
        return self._flag("any_sheddable", lambda: self.sheddable.any())

    @property
    def kv_tokens(self) -> np.ndarray:
        """u_i: tokens already in the KV cache (a decode's last token is not yet)."""

        def compute() -> np.ndarray:
            return np.where(
                self.is_decoding,
                self.prompt_tokens + self.output_tokens - 1,
                self.computed_tokens,
            )

        return self._memo("kv", compute)

    def _memo(self, key: str, fn: Any) -> np.ndarray:
        v = self._cache.get(key)
        if v is None:
            v = _readonly(np.asarray(fn()))
            self._cache[key] = v
        return v

    def _flag(self, key: str, fn: Any) -> bool:
        """A memoised yes/no fact about the snapshot (``_memo`` for a bool)."""
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = bool(fn())
        return bool(v)


_REQUEST_FIELDS: dict[str, tuple[Any, bool]] = {
    "id": ("", True),
    "arrival": (0.0, True),
    "prompt_tokens": (0, True),
    "computed_tokens": (0, False),
    "output_tokens": (0, False),
    "ttft_slo": (0.0, True),
    "tbt_slo": (0.0, True),
    "protected": (False, False),
    "priority": (0, False),
    "sheddable": (False, False),
    "e2e_slo": (0.0, False),
}


def _limit_requests(errs: list[FieldViolation], n: int, max_requests: int) -> None:
    """Raise (with ``errs`` so far) when there are more than ``max_requests`` requests."""
    if n > max_requests:
        errs.append(
            FieldViolation("requests", f"has {n} requests, more than the limit {max_requests}")
        )
        raise ValidationError(errs)


def _validate_requests(
    errs: list[FieldViolation], ids: Sequence[str], cols: Mapping[str, tuple[Any, Any]], n: int
) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The ids and the request columns as arrays; raises :class:`ValidationError`."""
    arrays: dict[str, np.ndarray] = {}
    for name, (values, dtype) in cols.items():
        arr = _column(errs, name, values, dtype, n)
        if arr is not None:
            arrays[name] = arr
    ids_t = tuple(ids)
    _validate_ids(errs, ids_t)
    if errs:
        raise ValidationError(errs)
    _validate_rows(errs, arrays)
    if errs:
        raise ValidationError(errs)
    return ids_t, arrays


def _json_object(data: str | bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` decoded, if text, and checked to be a JSON object."""
    if isinstance(data, str | bytes):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as e:
            # ValueError covers JSONDecodeError, UnicodeDecodeError and integers over
            # Python's digit limit; RecursionError is deeply nested arrays/objects.
            raise ValidationError.single("snapshot", f"is not valid JSON: {e}") from None
    if not isinstance(data, Mapping):
        raise ValidationError.single("snapshot", "must be a JSON object")
    return data


def _top_level(data: Mapping[str, Any], max_requests: int) -> tuple[list[FieldViolation], list[Any]]:
    """Violations among the top-level fields, and the request list (raises
    when it is over ``max_requests``)."""
    known = {
        "now", "max_batch_tokens", "max_num_seqs", "free_kv_tokens",
        "prefill_throughput", "requests", "profile",
    }
    errs = [FieldViolation(_key(k), "unknown field") for k in data if k not in known]
    for k in ("now", "max_batch_tokens", "max_num_seqs", "requests"):
        if k not in data:
            errs.append(FieldViolation(k, "is required"))
    reqs = data.get("requests", [])
    if not isinstance(reqs, list):
        errs.append(FieldViolation("requests", "must be a list"))
        reqs = []
    _limit_requests(errs, len(reqs), max_requests)
    return errs, reqs


def _request_columns(errs: list[FieldViolation], reqs: list[Any]) -> dict[str, list[Any]]:
    """The JSON request objects as columns, defaults filled in; violations go to ``errs``."""
    cols: dict[str, list[Any]] = {k: [] for k in _REQUEST_FIELDS}
    for i, r in enumerate(reqs):
        if not isinstance(r, Mapping):
            errs.append(FieldViolation(f"requests[{i}]", "must be an object"))
            continue
        for k in r:
            if k not in _REQUEST_FIELDS:
                errs.append(FieldViolation(f"requests[{i}].{_key(k)}", "unknown field"))
        for k, (default, required) in _REQUEST_FIELDS.items():
            if k in r:
                cols[k].append(r[k])
            elif required:
                errs.append(FieldViolation(f"requests[{i}].{k}", "is required"))
                cols[k].append(default)
            else:
                cols[k].append(default)
    return cols


def _validate_json_types(errs: list[FieldViolation], data: Mapping[str, Any], cols: dict[str, list[Any]]) -> None:
    """String-typed fields the columnar check does not cover: ids and the profile."""
    for i, v in enumerate(cols["id"]):
        if not isinstance(v, str):
            errs.append(FieldViolation(f"requests[{i}].id", "must be a string"))
    if not isinstance(data.get("profile", ""), str | None):
        errs.append(FieldViolation("profile", "must be a string"))


def _key(k: Any) -> str:
    """An unknown JSON key as it may appear in a field path: printable, so that an error
    stays one line (``"a\\nb"`` is shown as its repr)."""
    k = str(k)
    return k if k.isprintable() else repr(k)


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(
        v, bool | np.bool_
    )


def _finite_within(v: Any, bound: float) -> bool:
    """A real number with ``|v| <= bound`` (False, not OverflowError, for huge ints)."""
    if not _is_real(v):
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    return math.isfinite(f) and abs(f) <= bound


def _validate_scalars(
    errs: list[FieldViolation],
    now: Any,
    max_batch_tokens: Any,
    max_num_seqs: Any,
    free_kv_tokens: Any,
    prefill_throughput: Any,
) -> tuple[float, int, int, int | None, float | None]:
    if not _finite_within(now, MAX_SECONDS):
        errs.append(FieldViolation("now", f"must be a finite number of seconds, |now| <= {MAX_SECONDS:g}"))
        now = 0.0
    for name, v, hi in (("max_batch_tokens", max_batch_tokens, MAX_BATCH_TOKENS),
                        ("max_num_seqs", max_num_seqs, MAX_TOKENS)):
        if not _is_int(v) or not 1 <= v <= hi:
            errs.append(FieldViolation(name, f"must be an integer in [1, {hi}], got {v!r}"))
    if free_kv_tokens is not None and (not _is_int(free_kv_tokens) or not 0 <= free_kv_tokens <= MAX_TOKENS):
        errs.append(
            FieldViolation("free_kv_tokens", f"must be an integer >= 0, got {free_kv_tokens!r}")
        )
    if prefill_throughput is not None and (
        not _finite_within(prefill_throughput, MAX_THROUGHPUT) or prefill_throughput < MIN_THROUGHPUT
    ):
        errs.append(
            FieldViolation(
                "prefill_throughput",
                f"must be a number in [{MIN_THROUGHPUT:g}, {MAX_THROUGHPUT:g}] (tokens/s), got {prefill_throughput!r}",
            )
        )
    return (
        float(now),
        int(max_batch_tokens) if _is_int(max_batch_tokens) else 1,
        int(max_num_seqs) if _is_int(max_num_seqs) else 1,
        None if free_kv_tokens is None or not _is_int(free_kv_tokens) else int(free_kv_tokens),
        float(prefill_throughput) if _finite_within(prefill_throughput, MAX_THROUGHPUT) else None,
    )


def _column(
    errs: list[FieldViolation], name: str, values: Any, dtype: Any, n: int
) -> np.ndarray | None:
    if isinstance(values, np.ndarray):
        arr = values
        if arr.ndim != 1:
            errs.append(FieldViolation(name, "must be one-dimensional"))
            return None
        kind_ok = {
            np.float64: arr.dtype.kind in "fiu",
            np.int64: arr.dtype.kind in "iu",
            np.bool_: arr.dtype.kind == "b",
        }[dtype]
        if not kind_ok:
            errs.append(FieldViolation(name, f"has dtype {arr.dtype}, expected {np.dtype(dtype)}"))
            return None
        arr = arr.astype(dtype, copy=True)
    else:
        seq = list(values)
        check = {np.float64: _is_real, np.int64: _is_int, np.bool_: lambda v: isinstance(v, bool | np.bool_)}[dtype]
        bad = [i for i, v in enumerate(seq) if not check(v)]
        if bad:
            what = {np.float64: "a number", np.int64: "an integer", np.bool_: "a boolean"}[dtype]
            for i in bad[:5]:
                errs.append(FieldViolation(f"requests[{i}].{name}", f"must be {what}, got {seq[i]!r}"))
            return None
        try:
            arr = np.array(seq, dtype=dtype)
        except OverflowError:
            errs.append(FieldViolation(name, "has a value out of range"))
            return None
    if len(arr) != n:
        errs.append(FieldViolation(name, f"has {len(arr)} entries but there are {n} ids"))
        return None
    return arr


def _validate_ids(errs: list[FieldViolation], ids: tuple[str, ...]) -> None:
    # Fast path for the common, valid case: one C-level pass each.
    if (
        len(set(ids)) == len(ids)
        and all(type(r) is str for r in ids)
        and (not ids or (min(map(len, ids)) >= 1 and max(map(len, ids)) <= 256))
    ):
        return
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids):
        if not isinstance(rid, str) or not rid:
            errs.append(FieldViolation(f"requests[{i}].id", "must be a non-empty string"))
        elif len(rid) > 256:
            errs.append(FieldViolation(f"requests[{i}].id", "is longer than 256 characters"))
        elif rid in seen:
            errs.append(
                FieldViolation(f"requests[{i}].id", f"duplicates requests[{seen[rid]}].id {rid!r}")
            )
        else:
            seen[rid] = i
        if len(errs) >= 20:
            return


def _validate_rows(errs: list[FieldViolation], a: dict[str, np.ndarray]) -> None:
    """Vectorised row checks; per-row messages are built only for failing rows."""
    p, c, o = a["prompt_tokens"], a["computed_tokens"], a["output_tokens"]
    checks: list[tuple[str, np.ndarray, str]] = [
        ("arrival", ~(np.abs(a["arrival"]) <= MAX_SECONDS), f"must be finite, |arrival| <= {MAX_SECONDS:g}"),
        ("ttft_slo", ~((a["ttft_slo"] > 0) & (a["ttft_slo"] <= MAX_SECONDS)),
         f"must be finite and > 0, at most {MAX_SECONDS:g}"),
        ("tbt_slo", ~((a["tbt_slo"] > 0) & (a["tbt_slo"] <= MAX_SECONDS)),
         f"must be finite and > 0, at most {MAX_SECONDS:g}"),
        ("prompt_tokens", (p < 1) | (p > MAX_TOKENS), "must be >= 1"),
        ("computed_tokens", c < 0, "must be >= 0"),
        ("computed_tokens", c > p, "exceeds prompt_tokens"),
        ("output_tokens", (o < 0) | (o > MAX_TOKENS), "must be >= 0"),
        ("output_tokens", (c < p) & (o > 0), "must be 0 while the prompt is not fully computed"),
        ("output_tokens", (c == p) & (o < 1), "must be >= 1 once the prompt is fully computed"),
    ]
    if "priority" in a:
        pr = a["priority"]  # not np.abs: |int64 min| overflows to itself, which would pass
        checks.append(("priority", (pr < -MAX_PRIORITY) | (pr > MAX_PRIORITY), f"must be within ±{MAX_PRIORITY}"))
    if "e2e_slo" in a:
        e = a["e2e_slo"]
        checks.append(("e2e_slo", ~((e >= 0) & (e <= MAX_SECONDS)),
                       f"must be finite and >= 0 (0 = none), at most {MAX_SECONDS:g}"))
    for name, bad, msg in checks:
        if not bad.any():
            continue
        for i in np.flatnonzero(bad)[:5]:
            errs.append(FieldViolation(f"requests[{int(i)}].{name}", msg))


# ---------------------------------------------------- typed columns (from_arrays)
#: Longest request id (characters).
MAX_ID_CHARS = 256


def _typed_columns(
    errs: list[FieldViolation], columns: Mapping[str, np.ndarray], n: int
) -> dict[str, np.ndarray]:
    """The columns of :meth:`Snapshot.from_arrays`, checked for length like
    :func:`_column` (same violation); a wrong dtype or shape is a ``TypeError``."""
    arrays: dict[str, np.ndarray] = {}
    for name, dtype in COLUMN_DTYPES.items():
        arr = columns[name]
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != dtype:
            raise TypeError(f"column {name} must be a 1-D {np.dtype(dtype)} array")
        if len(arr) != n:
            errs.append(FieldViolation(name, f"has {len(arr)} entries but there are {n} ids"))
        else:
            arrays[name] = arr
    for name, dtype in CLASS_COLUMN_DTYPES.items():
        given = columns.get(name)
        if given is None or (len(given) == 0 and n > 0):
            continue  # not sent: the default class
        if not isinstance(given, np.ndarray) or given.ndim != 1 or given.dtype != dtype:
            raise TypeError(f"column {name} must be a 1-D {np.dtype(dtype)} array")
        if len(given) != n:
            errs.append(FieldViolation(name, f"has {len(given)} entries but there are {n} ids"))
        else:
            arrays[name] = given
    return arrays


def _plain_scalars(
    now: Any, max_batch_tokens: Any, max_num_seqs: Any, free_kv_tokens: Any, prefill_throughput: Any
) -> tuple[float, int, int, int | None, float | None] | None:
    """The scalars as :func:`_validate_scalars` returns them when they are plain, valid
    Python ``float``/``int`` (what protobuf hands over), else None.  Exact type checks
    instead of its ``isinstance`` against numpy's abstract types, which cost more than all
    the rest of the scalar checks together."""
    f, i = float, int
    ok = (
        type(now) is f and abs(now) <= MAX_SECONDS
        and type(max_batch_tokens) is i and 1 <= max_batch_tokens <= MAX_BATCH_TOKENS
        and type(max_num_seqs) is i and 1 <= max_num_seqs <= MAX_TOKENS
        and (free_kv_tokens is None or (type(free_kv_tokens) is i and 0 <= free_kv_tokens <= MAX_TOKENS))
        and (prefill_throughput is None
             or (type(prefill_throughput) is f and MIN_THROUGHPUT <= prefill_throughput <= MAX_THROUGHPUT))
    )
    return (now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput) if ok else None


def _str_ids_ok(ids: tuple[str, ...]) -> bool:
    """True when ids (all ``str``) are unique, non-empty and short enough: one ``set`` and
    one ``max`` at C speed (a dict of rows would cost twice the set, and the server's
    policies no longer need it); on False, :func:`_validate_ids` names the offending ids."""
    unique = set(ids)
    return len(unique) == len(ids) and "" not in unique and (not ids or max(map(len, ids)) <= MAX_ID_CHARS)


def _rows_ok(a: dict[str, np.ndarray]) -> bool:
    """True when every check of :func:`_validate_rows` passes, in about a dozen
    reductions instead of its per-check masks; NaN fails every comparison, so it is
    caught as there.  On False, :func:`_validate_rows` finds and names the rows."""
    p, c, o = a["prompt_tokens"], a["computed_tokens"], a["output_tokens"]
    if not len(p):
        return True
    t, b = a["ttft_slo"], a["tbt_slo"]
    return bool(
        np.abs(a["arrival"]).max() <= MAX_SECONDS
        and t.min() > 0 and t.max() <= MAX_SECONDS
        and b.min() > 0 and b.max() <= MAX_SECONDS
        and p.min() >= 1 and p.max() <= MAX_TOKENS
        and c.min() >= 0 and (p - c).min() >= 0
        and o.min() >= 0 and o.max() <= MAX_TOKENS
        # with 0 <= c <= p and o >= 0: output 0 exactly while the prompt is incomplete
        and np.array_equal(c == p, o > 0)
        and ("priority" not in a or not len(a["priority"])
             or (a["priority"].min() >= -MAX_PRIORITY and a["priority"].max() <= MAX_PRIORITY))
        and ("e2e_slo" not in a or not len(a["e2e_slo"])
             or (a["e2e_slo"].min() >= 0 and a["e2e_slo"].max() <= MAX_SECONDS))
    )
