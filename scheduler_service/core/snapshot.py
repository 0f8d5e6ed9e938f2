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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from . import validate
from .columns import COLUMNS, MAX_PRIORITY, MAX_SECONDS, MAX_TOKENS, OPTIONAL_COLUMNS, V1_COLUMNS
from .validate import MAX_BATCH_TOKENS, MAX_REQUESTS

__all__ = [
    "ALL_COLUMN_DTYPES", "CLASS_COLUMN_DTYPES", "COLUMN_DTYPES", "DEFAULT_MAX_REQUESTS", "MAX_BATCH_TOKENS", "MAX_PRIORITY",
    "MAX_REQUESTS", "MAX_SECONDS", "MAX_TOKENS", "Request", "Snapshot",
]

#: Upper bound on requests in one snapshot unless the caller sets another.
DEFAULT_MAX_REQUESTS = 100_000


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
        for c in OPTIONAL_COLUMNS:
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
        scal = (now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput)
        return cls._checked(*validate.checked_columns(scal, ids, columns, max_requests), profile)

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
        :data:`~scheduler_service.core.validate.CHECKS`), each first as one or two
        reductions, with the same violations in the same order.  Anything else (a wrong
        dtype, a missing column) is the caller's bug: ``TypeError``.
        """
        scal = (now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput)
        return cls._checked(*validate.checked_arrays(scal, ids, columns, max_requests), profile)

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
        data, cols = validate.checked_json(data, max_requests)
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
        keys = ("id", *(c.json_key for c in V1_COLUMNS))
        lists = [getattr(self, c.name).tolist() for c in V1_COLUMNS]  # plain float/int/bool
        rows = [dict(zip(keys, row, strict=True)) for row in zip(self.ids, *lists, strict=True)]
        # the optional columns only where they differ from the default (the v1 form stays as it was)
        for c in OPTIONAL_COLUMNS:
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
