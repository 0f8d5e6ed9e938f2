"""Where the request traces and GPU profiles come from.

The files the code reads (two request-length traces, three ``mlp.csv`` compute profiles and
two ``all_reduce.csv`` network profiles, from Vidur and Sarathi-Serve) ship gzipped in this
package, under ``vidur/`` (see ``vidur/PROVENANCE.md``). ``SLIDINGSERVE_DATA`` names another
folder with the same layout (``processed_traces/``, ``profiling/``) to read instead; it
replaces the bundled data as a whole. In either folder a file may be a plain ``.csv`` or a
gzipped ``.csv.gz``.

The trace reader (:mod:`.traces`, for the workloads of :mod:`clients`) and the simulated
engine's ground truth (:mod:`engine_adapter.sim.groundtruth`) read through here, one layer
below both of them; the scheduling core never does.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import TextIO

__all__ = ["BUNDLED", "ENV", "data_dir", "find", "open_text"]

#: The environment variable that overrides the bundled data.
ENV = "SLIDINGSERVE_DATA"
#: The data that ships with the package.
BUNDLED = Path(__file__).resolve().parent / "vidur"


def data_dir() -> Path:
    """``$SLIDINGSERVE_DATA`` when set, else the bundled data."""
    env = os.environ.get(ENV)
    return Path(env) if env else BUNDLED


def _where(root: Path) -> str:
    env = os.environ.get(ENV)
    if env and root.resolve() == Path(env).resolve():
        return f"in {root} (from {ENV}; unset it to use the bundled data)"
    if root.resolve() == BUNDLED:
        return (f"in the bundled data at {root} (an incomplete install?); set {ENV} to a folder "
                "holding processed_traces/ and profiling/")
    return f"in {root}"


def find(rel: str, what: str, root: Path | str | None = None) -> Path:
    """``root/rel`` or ``root/rel.gz`` (``root`` defaults to :func:`data_dir`).

    ``what`` names the file in the error (e.g. ``"trace 'sharegpt'"``)."""
    base = data_dir() if root is None else Path(root)
    for path in (base / rel, base / f"{rel}.gz"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{what} not found: looked for {rel}[.gz] {_where(base)}")


def open_text(path: Path) -> TextIO:
    """``path`` opened for reading text (for :mod:`csv`), gunzipped when it ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")
