"""Which way the policy hot path runs: its kernels compiled by numba, or as plain Python.

The policy modules reach the hot path through one facade, :func:`ops`: an
:class:`~._ops.Ops` over the kernels of :mod:`._compiled`, the one definition of each
operation.  On the numba backend they run compiled, a few calls per decision; on the
numpy backend the same functions run as their plain Python source (``py_func``), which
gives the same plans, only slower: it is what runs where numba is missing, and what the
tests hold the compiled code against.

``SLIDINGSERVE_KERNELS=numba|numpy`` selects one (default numba).  numba is imported
on first use, not with the package: the client and the CLI stand on the core and
must not pay its import.  If it cannot be imported the kernels run as plain Python, with
one logged warning.  :func:`warm_up` compiles (or loads from numba's on-disk cache,
``NUMBA_CACHE_DIR`` when set) every kernel, so that no request ever waits for the
compiler: the service and the in-process engine backend call it at start-up.  What it
runs (every registered policy on tiny snapshots, :mod:`._warm`) is handed to it by the
policy registry (:func:`set_warm_up`): this package stands below the policies and imports
none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from types import ModuleType

from ._ops import MAX_BOUNDARIES, Ops, QueueView, id_rank, lexsort_order

__all__ = ["BACKENDS", "ENV", "MAX_BOUNDARIES", "Ops", "QueueView", "backend", "id_rank", "jit", "lexsort_order",
           "ops", "set_warm_up", "use", "using", "warm_up"]

ENV = "SLIDINGSERVE_KERNELS"
BACKENDS = ("numba", "numpy")

_log = logging.getLogger(__name__)
_UNSET = object()
#: The facade of the active backend, _UNSET until the first call decides.
_active: object = _UNSET
_requested: str | None = None
_warmed: dict[str, float] = {}
#: What :func:`warm_up` runs; set by :mod:`..registry` when it is imported (with the core).
_workload: Callable[[], None] | None = None


def _wanted() -> str:
    name = _requested if _requested is not None else os.environ.get(ENV, "").strip().lower() or "numba"
    if name not in BACKENDS:
        _log.warning("%s=%r is not one of %s; using numba", ENV, name, "|".join(BACKENDS))
        name = "numba"
    return name


def _resolve() -> Ops:
    global _active
    from . import _compiled  # numba's import, when it is there

    wanted = _wanted()
    facade = Ops(_compiled, plain=wanted == "numpy")
    if wanted == "numba" and not _compiled.COMPILED:
        _log.warning("numba is not importable; the policy kernels run as plain Python (slower, same plans)")
    _active = facade
    return facade


def ops() -> Ops:
    """The hot path's operations on the active backend (the one dispatch).  Called on
    every hot-path step, so it is one global read once decided."""
    f = _active
    if f is _UNSET:
        return _resolve()
    return f  # type: ignore[return-value]


def jit() -> ModuleType | None:
    """The compiled-kernel module when the numba backend is active, else None (tests
    and tools; the policy modules call :func:`ops`)."""
    f = ops()
    return f.k if f.name == "numba" else None  # type: ignore[no-any-return]


def backend() -> str:
    """The implementation in use: ``"numba"`` or ``"numpy"``."""
    return ops().name


def use(name: str | None) -> str:
    """Select ``name`` (``"numba"``/``"numpy"``; None = the environment's choice) and
    return the backend actually in use (numpy when numba cannot be imported)."""
    global _requested, _active
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    _requested = name
    _active = _UNSET
    return backend()


@contextlib.contextmanager
def using(name: str) -> Iterator[str]:
    """``with using("numpy"): ...`` runs the block on one backend (tests compare them)."""
    before = _requested
    try:
        yield use(name)
    finally:
        use(before)


def set_warm_up(workload: Callable[[], None]) -> None:
    """Hand :func:`warm_up` what it runs: decisions that reach every kernel.  The policy
    registry calls it when it is imported (it knows the policies, the kernels do not)."""
    global _workload
    _workload = workload


def warm_up() -> float:
    """Compile or load every kernel now; seconds spent (about 0 the second time).

    Runs each policy on a few tiny snapshots that reach every kernel with the argument
    types a real decision passes (numba compiles one version per type signature), so
    the first real request finds them all compiled.  A no-op on the numpy backend."""
    mod = jit()
    if mod is None or "done" in _warmed or _workload is None:
        return 0.0
    t = time.perf_counter()
    _workload()
    _warmed["done"] = time.perf_counter() - t
    return _warmed["done"]
