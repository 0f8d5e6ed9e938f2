"""The settings kit: one way to type, load, validate and watch settings.

The server (:class:`scheduler_service.server.config.ServerConfig`) and the vLLM adapter
(:class:`engine_adapter.vllm.settings.VllmAdapterSettings`) are frozen dataclasses built on
the pieces here, so that a new setting is one annotated field (the server's carries its range
in the field's metadata, checked in one loop; the adapter checks its few ranges by hand):

* :func:`field_types` — the fields and their types (``int``, ``float``, ``str``, ``bool``,
  mappings), read from the annotations;
* :func:`convert` — one value from an environment variable (text) or from a settings file
  (already typed) to the field's type, with :func:`parse_bool` the one boolean spelling;
  :func:`type_violations` — the strict variant for files whose values must already have
  the right type (the server's config);
* :func:`env_values` — the fields set in an environment (``PREFIX`` + field name in upper
  case; empty values count as unset), :func:`unknown_keys` — the keys of a file that name
  no field;
* :func:`load_document` / :func:`read_document` — a ``.yaml``/``.yml``, ``.toml`` or
  ``.json`` file by suffix;
* :class:`Checks` — collects range checks as :class:`FieldViolation`\\ s that name the field;
* :class:`FileWatch` — the stat stamp of one or more files, polled at most every
  ``period_s``: every hot-reloaded file (policy config, tokens, TLS certificates, the
  adapter's settings file) is watched through it.

Bad input is one line naming the field: :class:`ValidationError` (server) or the adapter's
``SettingsError``.  This module imports neither grpc nor vLLM.
"""

from __future__ import annotations

import json
import os
import threading
import time
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from scheduler_service.core.errors import FieldViolation, ValidationError

__all__ = [
    "FALSE_WORDS",
    "TRUE_WORDS",
    "Checks",
    "DocumentError",
    "FileStamp",
    "FileWatch",
    "convert",
    "env_values",
    "field_types",
    "file_stamp",
    "load_document",
    "parse_bool",
    "read_document",
    "type_violations",
    "unknown_keys",
]

# ------------------------------------------------------------------ values
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(raw: Any) -> bool:
    """``True``/``False`` as they are; text ``1 true yes on`` / ``0 false no off`` (any case,
    surrounding spaces ignored); anything else is a :class:`ValueError`."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError(f"not a boolean: {raw!r}")


_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@cache
def field_types(cls: Any) -> dict[str, Any]:
    """Field name → ``int``, ``float``, ``str``, ``bool`` or ``Mapping`` (any mapping
    annotation), in declaration order."""
    hints = typing.get_type_hints(cls, {"Mapping": Mapping, "Any": Any})
    out: dict[str, Any] = {}
    for f in fields(cls):
        t = hints[f.name]
        out[f.name] = Mapping if typing.get_origin(t) in (Mapping, dict) or t in (Mapping, dict) else t
    return out


def convert(typ: Any, raw: Any) -> Any:
    """``raw`` (text from the environment, or a value from a file) as ``typ``.

    Integers: an ``int``, an integral ``float`` or integer text; floats: a number or number
    text; booleans: :func:`parse_bool`; strings: ``str(raw)`` stripped.  Booleans are never
    numbers.  Raises :class:`ValueError` or :class:`TypeError`."""
    if typ is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(raw)
        return int(raw)
    if typ is float:
        if isinstance(raw, bool):
            raise ValueError(raw)
        return float(raw)
    if typ is bool:
        return parse_bool(raw)
    return str(raw).strip()


def type_violations(obj: Any) -> list[FieldViolation]:
    """Fields of dataclass instance ``obj`` whose value does not have the field's scalar type
    (an ``int`` passes for a ``float`` and is made one in place; a ``bool`` is no number)."""
    errs: list[FieldViolation] = []
    for name, want in field_types(obj.__class__).items():
        v = getattr(obj, name)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            object.__setattr__(obj, name, float(v))
        elif not isinstance(v, want) or (isinstance(v, bool) and want is not bool):
            errs.append(FieldViolation(name, f"must be of type {want.__name__}, got {v!r}"))
    return errs


def env_values(cls: Any, env: Mapping[str, str], prefix: str,
               convert_one: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The fields of ``cls`` that ``env`` sets (``prefix`` + name in upper case, non-empty),
    each converted by ``convert_one(name, text)``."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        raw = env.get(prefix + f.name.upper())
        if raw is not None and raw != "":
            out[f.name] = convert_one(f.name, raw)
    return out


def unknown_keys(cls: Any, keys: Iterable[Any], exclude: Iterable[str] = ()) -> tuple[list[Any], set[str]]:
    """(keys naming no field of ``cls`` except ``exclude``, in the given order; the known names)."""
    known = {f.name for f in fields(cls)} - set(exclude)
    return [k for k in keys if k not in known], known


class Checks:
    """Range checks of one settings object, collected so that every problem is reported::

        c = Checks(self)
        c.check("port", 0 <= self.port <= 65535, "must be in [0, 65535]")
        c.raise_if_any()   # ValidationError: "port: must be in [0, 65535], got 70000"
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.violations: list[FieldViolation] = []

    def check(self, name: str, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(FieldViolation(name, f"{what}, got {getattr(self.obj, name)!r}"))

    def raise_if_any(self) -> None:
        if self.violations:
            raise ValidationError(self.violations)


# --------------------------------------------------------------- documents
class DocumentError(ValueError):
    """A settings file that cannot be read (``stage`` "read"), decoded ("decode") or parsed
    ("parse"), or whose suffix is no known format ("format"); ``detail`` is one line."""

    def __init__(self, stage: str, path: str | Path, detail: str) -> None:
        self.stage, self.path, self.detail = stage, str(path), detail
        super().__init__(f"{path}: {detail}")


def load_document(path: str | Path, *, yaml_default: bool = False, yaml_unless_json: bool = False) -> Any:
    """The parsed content of a ``.json``, ``.toml`` or ``.yaml``/``.yml`` file (by suffix).
    ``yaml_default``: any other suffix is YAML too; ``yaml_unless_json``: every suffix but
    ``.json`` is YAML.  Raises :class:`DocumentError`."""
    p = Path(path)
    try:
        blob = p.read_bytes()
    except OSError as e:
        raise DocumentError("read", p, e.strerror or str(e)) from None
    try:
        text = blob.decode()
    except UnicodeDecodeError as e:
        raise DocumentError("decode", p, str(e)) from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix == ".toml" and not yaml_unless_json:
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml") or yaml_unless_json or yaml_default:
            return yaml.safe_load(text)
    except Exception as e:  # parser errors of three libraries; YAML's span lines: made one
        raise DocumentError("parse", p, " ".join(str(e).split())) from None
    raise DocumentError("format", p, f"unknown format {suffix!r}; use .yaml, .toml or .json")


def read_document(path: str | Path, field: str, *, yaml_unless_json: bool = False) -> Any:
    """:func:`load_document` whose errors are a :class:`ValidationError` on ``field``, so
    that every file the server reads (its config, the policy config, the tokens) fails the
    same clear way."""
    try:
        return load_document(path, yaml_unless_json=yaml_unless_json)
    except DocumentError as e:
        p = Path(path)
        what = {"read": "cannot read", "decode": "cannot read", "parse": "cannot parse"}.get(e.stage)
        raise ValidationError.single(field, f"{what} {p}: {e.detail}" if what else e.detail) from None


# ----------------------------------------------------------------- watching
#: (mtime in ns, size, inode) of a file, None when it cannot be stat'ed (or no path).
FileStamp = tuple[int, int, int] | None


def file_stamp(path: str) -> FileStamp:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class FileWatch:
    """Tells when any of ``paths`` changed since the last look (its mtime, size or inode —
    an atomic rename, as Kubernetes does for mounted secrets, changes the inode).

    :meth:`changed` looks at most every ``period_s`` (0: every call), so a caller on a hot
    path pays one ``time.monotonic`` per call and a few ``os.stat`` per period; the first
    look is one period after construction.  Safe to call from several threads: one caller
    sees each change.  A path that is "" or cannot be stat'ed has stamp None.
    """

    def __init__(self, *paths: str, period_s: float = 0.0) -> None:
        self.paths = paths
        self.period_s = period_s
        self.stamp = self.look()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def look(self) -> tuple[FileStamp, ...]:
        return tuple(file_stamp(p) for p in self.paths)

    def changed(self, now: float | None = None) -> bool:
        """True when a period has passed and the stamps differ from the last look's."""
        now = time.monotonic() if now is None else now
        if now - self._checked < self.period_s:
            return False
        with self._lock:
            if now - self._checked < self.period_s:
                return False
            self._checked = now
            stamp = self.look()
            if stamp == self.stamp:
                return False
            self.stamp = stamp
            return True

    def forget(self) -> None:
        """Make the next :meth:`changed` (after its period) answer True whatever the files
        are: for a reader that must look again after a failed read, or at its first call."""
        with self._lock:
            self.stamp = ()
