"""Which implementation of the policy hot path runs: compiled kernels or plain numpy.

The policy modules reach the hot path through one facade, :func:`ops`: an object with
the same methods on both backends (:mod:`._ops`).  On numpy each method runs the
reference (:mod:`..reference`); on numba it calls a kernel of :mod:`._compiled`, which
computes the same result bit for bit (same operations in the same order wherever a
rounding could flip a comparison; ``tests/test_kernels.py`` holds the two equal) in a few
calls per decision instead of a few hundred numpy calls.  A kernel can decline a rare
input whose reference result it cannot reproduce exactly; the facade then runs the
reference itself.  Every such escape rule lives in :mod:`._ops`, and the policy modules
never ask which backend runs.

``SLIDINGSERVE_KERNELS=numba|numpy`` selects one (default numba).  numba is imported
on first use, not with the package: the client and the CLI stand on the core and
must not pay its import.  If it cannot be imported the numpy path runs, with one
logged warning.  :func:`warm_up` compiles (or loads from numba's on-disk cache,
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

from ._ops import NumbaOps, NumpyOps, QueueView

__all__ = ["BACKENDS", "ENV", "NumpyOps", "QueueView", "backend", "jit", "ops", "set_warm_up", "use", "using",
           "warm_up"]

ENV = "SLIDINGSERVE_KERNELS"
BACKENDS = ("numba", "numpy")

_log = logging.getLogger(__name__)
_UNSET = object()
#: The facade of the active backend (a NumbaOps or a NumpyOps), _UNSET until the first
#: call decides.
_active: object = _UNSET
_NUMPY = NumpyOps()
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


def _resolve() -> NumpyOps:
    global _active
    facade = _NUMPY
    if _wanted() == "numba":
        try:
            from . import _compiled
        except ImportError as e:  # numba missing or broken: the reference path still works
            _log.warning("numba kernels unavailable (%s); the policy core runs on numpy", e)
        else:
            facade = NumbaOps(_compiled)
    _active = facade
    return facade


def ops() -> NumpyOps:
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
    return f.k if isinstance(f, NumbaOps) else None  # type: ignore[no-any-return]


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
