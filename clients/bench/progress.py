"""A dependency-free text progress bar on stderr.

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints one
line per update, since carriage returns make logs unreadable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 28) -> None:
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self._t0 = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw("")

    def _draw(self, note: str) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self.width)
        elapsed = time.monotonic() - self._t0
        eta = ""
        if 0 < self.done < self.total:
            eta = f" eta {elapsed / self.done * (self.total - self.done):.0f}s"
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{self.done}/{self.total} {elapsed:.0f}s{eta}")
        if note:
            line += f"  {note}"
        if self._tty:
            self.stream.write("\r\x1b[2K" + line)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, note: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        self._draw(note)
