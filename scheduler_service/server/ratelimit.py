"""Per-identity limits: token-bucket message rates and open-stream counts.

Used by the interceptor (:mod:`.security`); no gRPC here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Gate", "RateLimiter", "StreamSlots"]


class RateLimiter:
    """Token buckets per key: ``rate`` per second, ``burst`` deep.

    Buckets live in a bounded LRU (``max_keys``) so that unauthenticated callers keyed by
    IP address cannot grow memory without bound; an evicted bucket restarts full.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Take one token: 0.0 when allowed, else the seconds until one is available."""
        now = self._clock()
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                tokens = self.burst
                if len(self._buckets) >= self._max_keys:
                    self._buckets.popitem(last=False)
            else:
                tokens = min(self.burst, b[0] + (now - b[1]) * self.rate)
                self._buckets.move_to_end(key)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


class StreamSlots:
    """Open streams per identity; a slot is returned by the call's termination callback,
    which gRPC runs however the call ends (completion, cancellation, deadline)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            n = self._open.get(key, 0)
            if n >= self.limit:
                return False
            self._open[key] = n + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            n = self._open.get(key, 0) - 1
            if n > 0:
                self._open[key] = n
            else:
                self._open.pop(key, None)

    def count(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)


class Gate:
    """A stream's request iterator with a rate check per message.  Over the limit it ends
    the iteration (so the servicer finishes normally with what it has) and remembers
    why; the wrapper then ends the call with RESOURCE_EXHAUSTED."""

    def __init__(self, requests: Iterator[Any], check: Callable[[], float]) -> None:
        self._requests = requests
        self._check = check
        self.retry_after = 0.0

    def __iter__(self) -> Gate:
        return self

    def __next__(self) -> Any:
        if self.retry_after:
            raise StopIteration
        msg = next(self._requests)
        wait = self._check()
        if wait:
            self.retry_after = wait
            raise StopIteration
        return msg
