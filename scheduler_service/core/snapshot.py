"""The engine's queue snapshot: what a policy sees in one iteration.

A snapshot is columnar (one numpy array per request attribute) because every
policy works on whole columns at once and the wire format is columnar too.
All times are on the *engine's* clock (``now`` included): a policy never reads
its own clock, so a snapshot replays to the same plan byte for byte.

Request states (docs/usage.md, Formats):

* waiting    — ``computed_tokens == 0``, or all of them ``cached_tokens``
* prefilling — ``0 < computed_tokens < prompt_tokens``
* decoding   — ``computed_tokens == prompt_tokens`` (then ``output_tokens >= 1``)

``output_tokens`` must be 0 until the prompt is fully computed; an engine that
recomputes a preempted request folds its generated tokens into the prompt.

``cached_tokens`` (optional, default 0, ``<= computed_tokens``) is the part of
``computed_tokens`` that are prefix-cache hits of a request the engine has not admitted:
context, not work (``remaining_prefill`` excludes them), but no KV of the request's own.
Such a request has not *started*: :attr:`Snapshot.started` (``computed_tokens >
cached_tokens``, or decoding) is the mask of the requests that have, and hold KV.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from .columns import (
    COLUMNS,
    COLUMNS_BY_NAME,
    DTYPE_WORDS,
    MAX_PRIORITY,
    MAX_SECONDS,
    MAX_TOKENS,
    Column,
    checks_pass,
    find_violations,
)
from .errors import FieldViolation, ValidationError

__all__ = [
    "ALL_COLUMN_DTYPES", "CLASS_COLUMN_DTYPES", "COLUMN_DTYPES", "DEFAULT_MAX_REQUESTS", "MAX_BATCH_TOKENS", "MAX_PRIORITY",
    "MAX_REQUESTS", "MAX_SECONDS", "Request", "Snapshot",
]

#: Upper bound on requests in one snapshot unless the caller sets another.
DEFAULT_MAX_REQUESTS = 100_000
#: The most requests any snapshot may hold, whatever the caller sets: a request's
#: position must fit the bits the lost sets' heap key and MLPS's class rank keep for it.
MAX_REQUESTS = (1 << 19) - 1
#: Largest ``max_batch_tokens``.  Policies build per-token curves up to the iteration's
#: budget (O(budget) memory and time: ~70 MB and 0.1-0.2 s at this bound, 8 GB at 10^8),
#: so an unbounded budget would let one request exhaust the server's memory.  2^20 is
#: above any engine's per-iteration token budget (vLLM: 2k-64k, whole 1M-token prompts).
MAX_BATCH_TOKENS = 1 << 20
#: Bounds of ``prefill_throughput`` (tokens/s): policies divide remaining tokens by it
#: times a slack (up to ~1e24 s with the bounds above), which must stay finite.
MIN_THROUGHPUT, MAX_THROUGHPUT = 1e-3, 1e12


#: The v1 request columns of a snapshot and their dtypes, in wire (field number) order
#: (derived from :data:`~scheduler_service.core.columns.COLUMNS`, the one schema).
COLUMN_DTYPES: dict[str, Any] = {c.name: c.dtype for c in COLUMNS if not c.optional}
#: The optional columns (docs/usage.md, SLO classes): a snapshot without them is all
#: priority 0, nothing sheddable, no end-to-end objective (the v1 contract).
CLASS_COLUMN_DTYPES: dict[str, Any] = {c.name: c.dtype for c in COLUMNS if c.optional}
#: Every request column's dtype, in wire order.
ALL_COLUMN_DTYPES: dict[str, Any] = {c.name: c.dtype for c in COLUMNS}


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the engine sees it; a row of a :class:`Snapshot`.  Its fields are
    the request columns of the schema (:data:`~scheduler_service.core.columns.COLUMNS`,
    ``tests/test_snapshot.py`` holds them equal), with the schema's defaults; the columns
    every request must set (``required``) have none."""

    id: str
    arrival: float
    prompt_tokens: int
    _: KW_ONLY
    computed_tokens: int = 0
    output_tokens: int = 0
    ttft_slo: float
    tbt_slo: float
    protected: bool = False
    priority: int = 0
    sheddable: bool = False
    e2e_slo: float = 0.0
    tpot_slo: float = 0.0
    first_token_time: float = 0.0
    cached_tokens: int = 0


class _fact:  # (lower case: a decorator, like property)
    """A memoised yes/no fact about a snapshot: a read-only property computed once into
    the snapshot's memo field of the same name, underscored (a policy asks some of them
    several times a decision)."""

    def __init__(self, fn: Callable[[Any], bool]) -> None:
        self.fn, self.slot, self.__doc__ = fn, "_" + fn.__name__, fn.__doc__

    def __get__(self, snap: Any, owner: type | None = None) -> bool:
        if snap is None:
            return self  # type: ignore[return-value]
        v = getattr(snap, self.slot)
        if v is None:
            v = self.fn(snap)
            object.__setattr__(snap, self.slot, v)
        return v  # type: ignore[no-any-return]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


#: An optional request column left out of the constructor (filled with its default).
_ABSENT = _readonly(np.zeros(0))


def _absent() -> np.ndarray:
    return _ABSENT


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """A validated, immutable snapshot.  Build it with :meth:`from_requests`,
    :meth:`from_columns` or :meth:`from_json`; the constructor itself does not
    validate.

    Besides its scalars it has one read-only numpy array per request column of the schema
    (:data:`~scheduler_service.core.columns.COLUMNS`, in its order; ``tests/test_snapshot.py``
    holds them equal), keyword-only in the constructor; an optional column left out (None
    or empty) is filled with its default.

    Invariants (checked by :meth:`validate`): all columns have ``len(ids)``
    rows; ids are unique non-empty strings; ``0 <= computed_tokens <=
    prompt_tokens``; ``prompt_tokens >= 1``; ``output_tokens == 0`` while
    ``computed_tokens < prompt_tokens`` and ``>= 1`` once equal; ``0 <= cached_tokens <=
    computed_tokens``; times and SLOs
    finite, SLOs > 0 (``e2e_slo`` >= 0, 0 = none); ``max_batch_tokens >= 1``,
    ``max_num_seqs >= 1``.
    """

    now: float
    max_batch_tokens: int
    max_num_seqs: int
    ids: tuple[str, ...]
    free_kv_tokens: int | None = None
    prefill_throughput: float | None = None
    #: Engine profile key (model/hardware/TP); informational for policies.
    profile: str = ""
    # the request columns (the schema's, in its order); an optional one left out: _ABSENT
    arrival: np.ndarray = field(kw_only=True)
    prompt_tokens: np.ndarray = field(kw_only=True)
    computed_tokens: np.ndarray = field(kw_only=True)
    output_tokens: np.ndarray = field(kw_only=True)
    ttft_slo: np.ndarray = field(kw_only=True)
    tbt_slo: np.ndarray = field(kw_only=True)
    protected: np.ndarray = field(kw_only=True)
    priority: np.ndarray = field(default_factory=_absent, kw_only=True)
    sheddable: np.ndarray = field(default_factory=_absent, kw_only=True)
    e2e_slo: np.ndarray = field(default_factory=_absent, kw_only=True)
    tpot_slo: np.ndarray = field(default_factory=_absent, kw_only=True)
    first_token_time: np.ndarray = field(default_factory=_absent, kw_only=True)
    cached_tokens: np.ndarray = field(default_factory=_absent, kw_only=True)
    # What is derived from the columns, computed on first use (``_memo``, ``_fact``): not
    # constructor arguments, so a snapshot made by ``dataclasses.replace`` starts without.
    _index_of: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)
    _is_decoding: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _started: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _remaining: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _ttft_deadline: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _e2e_deadline: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _paced: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _step: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _slack: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _kv: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _reason_columns: tuple[np.ndarray, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _any_e2e: bool | None = field(default=None, init=False, repr=False, compare=False)
    _any_tpot: bool | None = field(default=None, init=False, repr=False, compare=False)
    _one_class: bool | None = field(default=None, init=False, repr=False, compare=False)
    _any_sheddable: bool | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.ids)
        for c in _OPTIONAL:
            col = getattr(self, c.name)
            if col is None or len(col) == 0:
                object.__setattr__(self, c.name, _readonly(np.full(n, c.default, c.dtype)))

    # ------------------------------------------------------------------ build
    @classmethod
    def from_columns(
        cls,
        *,
        now: float,
        max_batch_tokens: int,
        max_num_seqs: int,
        ids: Sequence[str],
        free_kv_tokens: int | None = None,
        prefill_throughput: float | None = None,
        profile: str = "",
        max_requests: int = DEFAULT_MAX_REQUESTS,
        **columns: Any,
    ) -> Snapshot:
        """Validate columns and build a snapshot; raises :class:`ValidationError`.

        ``columns``: one sequence or 1-D array per request column of the schema, by name
        (``arrival=..., prompt_tokens=..., ...``); the optional ones (``priority``,
        ``sheddable``, ``e2e_slo``, ...) may be left out or None: all default.  A missing
        required column or an unknown name is the caller's bug: ``TypeError``."""
        _known_columns(columns, "from_columns")
        errs: list[FieldViolation] = []
        scal = _validate_scalars(
            errs, now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput
        )
        n = len(ids)
        _limit_requests(errs, n, max_requests)
        cols = {c.name: (columns[c.name], c.dtype) for c in COLUMNS if columns.get(c.name) is not None}
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
        """:meth:`from_columns` for a caller that already holds typed columns: ``ids`` a
        tuple of ``str`` and ``columns`` one fresh 1-D array per request column with the
        column's dtype (the schema's; optional columns may be left out or empty), handed
        over (kept, not copied, made read-only).

        The wire decoder builds exactly that from protobuf's typed repeated fields, and the
        vLLM adapter from its queues, so the per-element type checks and copies of
        :meth:`from_columns` (most of its time on a 768-request snapshot) cannot find
        anything and are skipped; every value check is the same (the schema's
        :data:`~scheduler_service.core.columns.CHECKS`), each first as one or two
        reductions, with the same violations in the same order.  Anything else (a wrong
        dtype, a missing column) is the caller's bug: ``TypeError``.
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
        if not checks_pass(arrays):
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
            free_kv_tokens=free_kv_tokens,
            prefill_throughput=prefill_throughput,
            profile=profile,
            max_requests=max_requests,
            **{c.name: [getattr(r, c.name, c.default) for r in reqs] for c in COLUMNS},
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
            max_requests=max_requests,
            **{c.name: cols[c.json_key] for c in COLUMNS},
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
        keys = ("id", *(c.json_key for c in _ALWAYS))
        lists = [getattr(self, c.name).tolist() for c in _ALWAYS]  # plain float/int/bool
        rows = [dict(zip(keys, row, strict=True)) for row in zip(self.ids, *lists, strict=True)]
        # the optional columns only where they differ from the default (the v1 form stays as it was)
        for c in _OPTIONAL:
            col = getattr(self, c.name)
            for i in np.flatnonzero(col != c.default).tolist():
                rows[i][c.json_key] = col[i].item()
        out["requests"] = rows
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def requests(self) -> list[Request]:
        names = {c.json_key: c.name for c in COLUMNS}
        return [Request(**{names.get(k, k): v for k, v in r.items()}) for r in self.to_dict()["requests"]]

    # ---------------------------------------------------------------- derived
    def __len__(self) -> int:
        return len(self.ids)

    @property
    def index_of(self) -> dict[str, int]:
        """Row of each request id."""
        d = self._index_of
        if d is None:
            d = {rid: i for i, rid in enumerate(self.ids)}
            object.__setattr__(self, "_index_of", d)
        return d

    @property
    def is_decoding(self) -> np.ndarray:
        return self._memo("_is_decoding", lambda: self.computed_tokens == self.prompt_tokens)

    @property
    def started(self) -> np.ndarray:
        """Requests that have started and hold KV of their own: decoding, or more tokens
        computed than the prefix-cache hits of a request not admitted (``cached_tokens``);
        ``computed_tokens > 0`` when no request has cached tokens."""
        return self._memo("_started", lambda: (self.computed_tokens > self.cached_tokens) | self.is_decoding)

    @property
    def remaining_prefill(self) -> np.ndarray:
        """r_i = p_i − c_i (formula 10); 0 for decodes."""
        return self._memo("_remaining", lambda: self.prompt_tokens - self.computed_tokens)

    @property
    def ttft_deadline(self) -> np.ndarray:
        return self._memo("_ttft_deadline", lambda: self.arrival + self.ttft_slo)

    @property
    def e2e_deadline(self) -> np.ndarray:
        """a_i + e2e_slo_i, by when the last token must be out; +inf without an objective."""
        return self._memo("_e2e_deadline", lambda: np.where(self.e2e_slo > 0, self.arrival + self.e2e_slo, np.inf))

    @_fact
    def any_e2e(self) -> bool:
        """Some request has an end-to-end objective."""
        return bool(self.e2e_slo.any())

    @_fact
    def any_tpot(self) -> bool:
        """Some request has an objective on its mean time per output token."""
        return bool(self.tpot_slo.any())

    @property
    def paced(self) -> np.ndarray:
        """Decodes whose next token is due by their TPOT objective, not formula (1)."""
        return self._memo("_paced", lambda: self.is_decoding & (self.tpot_slo > 0))

    @property
    def step(self) -> np.ndarray:
        """How much later each further token of a decode is due: ``tbt_slo`` (formula (1)),
        or ``tpot_slo`` for a paced decode (the ``tbt_slo`` array itself when no request
        has a TPOT objective)."""
        if not self.any_tpot:
            return self.tbt_slo
        return self._memo("_step", lambda: np.where(self.paced, self.tpot_slo, self.tbt_slo))

    @property
    def slack(self) -> np.ndarray:
        """s_i: TTFT slack for prefills (11), TBT slack for decodes (formula (1)); a decode
        with a TPOT objective counts from its first token instead,
        ``first_token_time + k × tpot_slo − now`` (each token on that pace keeps the mean
        within the objective whenever the stream ends); where the request has an
        end-to-end objective, at most the time left to its deadline (``e2e_deadline − now``)."""

        def compute() -> np.ndarray:
            k = np.where(self.is_decoding, self.output_tokens, 0)
            s = self.arrival + self.ttft_slo + k * self.tbt_slo - self.now
            if self.any_tpot:  # else exactly formula (1), bit for bit
                s = np.where(self.paced, self.first_token_time + k * self.tpot_slo - self.now, s)
            if self.any_e2e:
                s = np.minimum(s, self.e2e_deadline - self.now)
            return s

        return self._memo("_slack", compute)

    @_fact
    def one_class(self) -> bool:
        """Every request has the same priority (the v1 contract, and the common case): the
        class-aware steps of a policy can skip their per-subset checks."""
        p = self.priority
        return bool(len(p) == 0 or p.min() == p.max())

    @_fact
    def any_sheddable(self) -> bool:
        return bool(self.sheddable.any())

    @property
    def kv_tokens(self) -> np.ndarray:
        """u_i: tokens already in the KV cache (a decode's last token is not yet)."""

        def compute() -> np.ndarray:
            return np.where(
                self.is_decoding,
                self.prompt_tokens + self.output_tokens - 1,
                self.computed_tokens,
            )

        return self._memo("_kv", compute)

    @property
    def reason_columns(self) -> tuple[np.ndarray, ...]:
        """(``remaining_prefill``, ``slack``, ``tbt_slo``, ``step``, ``priority``): the
        columns the reasons' kernel reads (a decode is a row with nothing left to prefill),
        memoised together (one look-up where each is a property of its own)."""
        cols = self._reason_columns
        if cols is None:
            cols = (self.remaining_prefill, self.slack, self.tbt_slo, self.step, self.priority)
            object.__setattr__(self, "_reason_columns", cols)
        return cols

    def _memo(self, slot: str, fn: Any) -> np.ndarray:
        """Memo field ``slot``, computed by ``fn`` (read-only) on first use."""
        v = getattr(self, slot)
        if v is None:
            v = _readonly(np.asarray(fn()))
            object.__setattr__(self, slot, v)
        return v  # type: ignore[no-any-return]


#: The schema's columns: those every snapshot has, and the optional ones.
_ALWAYS: tuple[Column, ...] = tuple(c for c in COLUMNS if not c.optional)
_OPTIONAL: tuple[Column, ...] = tuple(c for c in COLUMNS if c.optional)
#: The keys of a JSON request object: (default, required) each.
_REQUEST_FIELDS: dict[str, tuple[Any, bool]] = {
    "id": ("", True),
    **{c.json_key: (c.default, c.required) for c in COLUMNS},
}


def _known_columns(columns: Mapping[str, Any], where: str) -> None:
    """``TypeError`` for an unknown column name or a required column left out (the
    caller's bug, as for a missing keyword argument)."""
    unknown = [k for k in columns if k not in COLUMNS_BY_NAME]
    if unknown:
        raise TypeError(f"{where}() got unknown request columns {unknown}")
    missing = [c.name for c in _ALWAYS if columns.get(c.name) is None]
    if missing:
        raise TypeError(f"{where}() missing request columns {missing}")


def _limit_requests(errs: list[FieldViolation], n: int, max_requests: int) -> None:
    """Raise (with ``errs`` so far) when there are more than ``max_requests`` requests
    (never more than :data:`MAX_REQUESTS`)."""
    max_requests = min(max_requests, MAX_REQUESTS)
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


#: Array kinds a column of each dtype accepts (converted, exactly or widening).
_KINDS: dict[Any, str] = {np.float64: "fiu", np.int64: "iu", np.bool_: "b"}


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool | np.bool_)


#: What each element of a column of each dtype must be.
_ELEMENT_CHECKS: dict[Any, Any] = {np.float64: _is_real, np.int64: _is_int, np.bool_: _is_bool}


def _column(
    errs: list[FieldViolation], name: str, values: Any, dtype: Any, n: int
) -> np.ndarray | None:
    if isinstance(values, np.ndarray):
        arr = values
        if arr.ndim != 1:
            errs.append(FieldViolation(name, "must be one-dimensional"))
            return None
        if arr.dtype.kind not in _KINDS[dtype]:
            errs.append(FieldViolation(name, f"has dtype {arr.dtype}, expected {np.dtype(dtype)}"))
            return None
        arr = arr.astype(dtype, copy=True)
    else:
        seq = list(values)
        check = _ELEMENT_CHECKS[dtype]
        bad = [i for i, v in enumerate(seq) if not check(v)]
        if bad:
            what = DTYPE_WORDS[dtype]
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
    """The schema's value checks (:data:`~scheduler_service.core.columns.CHECKS`),
    vectorised; per-row messages are built only for failing rows."""
    errs.extend(FieldViolation(f, d) for f, d in find_violations(a))


# ---------------------------------------------------- typed columns (from_arrays)
#: Longest request id (characters).
MAX_ID_CHARS = 256


def _typed_columns(
    errs: list[FieldViolation], columns: Mapping[str, np.ndarray], n: int
) -> dict[str, np.ndarray]:
    """The columns of :meth:`Snapshot.from_arrays`, checked for length like
    :func:`_column` (same violation); a wrong dtype or shape, a required column missing
    or an unknown one is a ``TypeError``.  An optional column left out (None, or empty
    while there are requests) is the default for every request."""
    arrays: dict[str, np.ndarray] = {}
    if len(columns) > len(COLUMNS) or not COLUMNS_BY_NAME.keys() >= columns.keys():
        raise TypeError(f"unknown request columns {sorted(set(columns) - COLUMNS_BY_NAME.keys())}")
    for c in COLUMNS:
        arr = columns.get(c.name)
        if c.optional and (arr is None or (len(arr) == 0 and n > 0)):
            continue  # not sent: the default
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != c.dtype:
            raise TypeError(f"column {c.name} must be a 1-D {np.dtype(c.dtype)} array")
        if len(arr) != n:
            errs.append(FieldViolation(c.name, f"has {len(arr)} entries but there are {n} ids"))
        else:
            arrays[c.name] = arr
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
