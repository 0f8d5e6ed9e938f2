"""Pacing a simulated engine to wall time.

The simulator runs in simulated time, microseconds of wall time per iteration.  Against a
real service (load tests, fault and upgrade tests) an engine must ask at the rate a GPU
would: before each decision, wait until the iteration's simulated start has elapsed in wall
time (divided by ``speedup``), so that restarts, reconnect back-offs and deadlines play out
in the wall time they take.
"""

from __future__ import annotations

import time

__all__ = ["WallClockPacer"]


class WallClockPacer:
    """``wait(sim_now)`` sleeps until ``sim_now`` is due: simulated seconds since the first
    call (or since :meth:`restart`) divided by ``speedup``, in wall seconds since then."""

    def __init__(self, speedup: float) -> None:
        self.speedup = speedup
        self._sim0: float | None = None
        self._wall0 = 0.0

    def restart(self) -> None:
        """Pace from the next call on (after something that blocked, e.g. an injected fault)."""
        self._sim0 = None

    def wait(self, sim_now: float) -> float:
        """Seconds slept; negative: how late the call was (nothing slept)."""
        if self._sim0 is None:
            self._sim0, self._wall0 = sim_now, time.perf_counter()
        left = self._wall0 + (sim_now - self._sim0) / self.speedup - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return left
