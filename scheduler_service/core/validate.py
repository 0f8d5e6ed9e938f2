"""Snapshot validation: the one validator of every way a snapshot is built.

Every builder of :class:`~scheduler_service.core.snapshot.Snapshot` (``from_columns``,
``from_arrays``, ``from_requests``, ``from_json``) ends in the functions here; the value
checks are the schema's (:mod:`.columns`: each column's bounds and the row rules), as
:data:`CHECKS`.  Two ways run them, and ``tests/test_columns.py`` holds them to the same
verdict: :func:`find_violations` names the failing rows (the error a client reads), and
:func:`checks_pass` answers yes or no in a few reductions (what every decision pays on
its valid snapshot).  Violations carry the field path a client sent (``requests[3].arrival``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .columns import (
    COLUMNS,
    COLUMNS_BY_NAME,
    DTYPE_WORDS,
    MAX_SECONDS,
    MAX_TOKENS,
    ROW_RULES,
    V1_COLUMNS,
    Column,
    Rule,
)
from .errors import FieldViolation, ValidationError

__all__ = ["CHECKS", "MAX_BATCH_TOKENS", "MAX_REQUESTS", "Check", "checked_arrays", "checked_columns", "checked_json",
           "checks_pass", "find_violations"]

#: A snapshot's scalars: now, max_batch_tokens, max_num_seqs, free_kv_tokens, prefill_throughput.
Scalars = tuple[float, int, int, int | None, float | None]
#: What a builder hands the snapshot: the checked scalars, ids and request columns.
Checked = tuple[Scalars, tuple[str, ...], dict[str, np.ndarray]]

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


@dataclass(frozen=True, slots=True)
class Check:
    """One value check: a column's bounds, or a row rule.  ``bad`` finds the failing
    rows (the generic path names them); ``passes`` is the same verdict for the whole
    snapshot, cheaper (the fast path)."""

    column: str
    message: str
    bounds: Column | None = None
    rule: Rule | None = None

    def bad(self, a: Mapping[str, np.ndarray]) -> np.ndarray:
        if self.bounds is not None:
            return self.bounds.out_of_bounds(a[self.column])
        assert self.rule is not None
        return self.rule.bad(a)

    def applies(self, a: Mapping[str, np.ndarray]) -> bool:
        """The columns it reads are there (an optional column left out has only defaults,
        all within bounds)."""
        if self.rule is not None and self.rule.reads:
            return any(k in a for k in self.rule.reads)
        return self.column in a


def _checks() -> tuple[Check, ...]:
    """Each column's bounds, then the rules reported under it, in column order."""
    out: list[Check] = []
    for c in COLUMNS:
        if c.bounded:
            out.append(Check(c.name, c.bounds_message, bounds=c))
        out.extend(Check(r.column, r.message, rule=r) for r in ROW_RULES if r.column == c.name)
    return tuple(out)


#: Every value check of a snapshot's columns, in reporting order.
CHECKS: tuple[Check, ...] = _checks()
#: Failing rows named per check (the rest are counted only by the first violations).
MAX_ROWS_PER_CHECK = 5


def find_violations(a: Mapping[str, np.ndarray]) -> list[tuple[str, str]]:
    """(field path, description) of every failing check, up to
    :data:`MAX_ROWS_PER_CHECK` rows each, in :data:`CHECKS` order."""
    out: list[tuple[str, str]] = []
    for chk in CHECKS:
        if not chk.applies(a):
            continue
        bad = chk.bad(a)
        if bad.any():
            out.extend((f"requests[{int(i)}].{chk.column}", chk.message)
                       for i in np.flatnonzero(bad)[:MAX_ROWS_PER_CHECK])
    return out


def checks_pass(a: Mapping[str, np.ndarray]) -> bool:
    """True exactly when :func:`find_violations` finds nothing, in a few reductions: each
    column's bounds as its minimum and maximum (NaN fails every comparison), each rule as
    one ``any``.  (Unrolled over :data:`_FAST`: this runs on every decision.)"""
    if not len(a["prompt_tokens"]):
        return True
    for column, lo, lo_open, hi, rule in _FAST:
        if rule is not None:
            if (any(k in a for k in rule.reads) if rule.reads else column in a) and rule.bad(a).any():
                return False
            continue
        x = a.get(column)
        if x is None:
            continue
        if lo is not None:
            m = x.min()
            if not ((m > lo) if lo_open else (m >= lo)):
                return False
        if hi is not None and not x.max() <= hi:
            return False
    return True


#: :data:`CHECKS` for :func:`checks_pass`: (column, lo, lo_open, hi, rule) each.
_FAST: tuple[tuple[str, float | None, bool, float | None, Rule | None], ...] = tuple(
    (chk.column, chk.bounds.lo, chk.bounds.lo_open, chk.bounds.hi, None) if chk.bounds is not None
    else (chk.column, None, False, None, chk.rule)
    for chk in CHECKS
)


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
    missing = [c.name for c in V1_COLUMNS if columns.get(c.name) is None]
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


# ------------------------------------------------------------- the builders' entries
def checked_columns(scal: tuple[Any, ...], ids: Sequence[str], columns: Mapping[str, Any],
                    max_requests: int) -> Checked:
    """``Snapshot.from_columns``: any sequences (each element type-checked, copied)."""
    _known_columns(columns, "from_columns")
    errs: list[FieldViolation] = []
    checked = _validate_scalars(errs, *scal)
    n = len(ids)
    _limit_requests(errs, n, max_requests)
    cols = {c.name: (columns[c.name], c.dtype) for c in COLUMNS if columns.get(c.name) is not None}
    ids_t, arrays = _validate_requests(errs, ids, cols, n)
    return checked, ids_t, arrays


def checked_arrays(scal: tuple[Any, ...], ids: tuple[str, ...], columns: Mapping[str, np.ndarray],
                   max_requests: int) -> Checked:
    """``Snapshot.from_arrays``: typed columns, each value check first as one or two
    reductions (:func:`checks_pass`), the violations named only when one fails."""
    errs: list[FieldViolation] = []
    checked = _plain_scalars(*scal)
    if checked is None:  # something to report: the generic checks name it
        checked = _validate_scalars(errs, *scal)
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
    return checked, ids, arrays


def checked_json(data: str | bytes | Mapping[str, Any], max_requests: int
                 ) -> tuple[Mapping[str, Any], dict[str, list[Any]]]:
    """``Snapshot.from_json``: the decoded object and its requests as columns (JSON keys),
    the JSON-only checks done (top-level fields, request objects, string ids and profile);
    the values are checked by :func:`checked_columns` after."""
    data = _json_object(data)
    errs, reqs = _top_level(data, max_requests)
    cols = _request_columns(errs, reqs)
    if errs:
        raise ValidationError(errs)
    _validate_json_types(errs, data, cols)
    if errs:
        raise ValidationError(errs)
    return data, cols
