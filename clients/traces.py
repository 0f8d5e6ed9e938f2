"""Request-length traces from the shared Vidur/Sarathi data (see its README).

The data lives outside the repository; ``SLIDINGSERVE_DATA`` points at the
folder that holds ``processed_traces/`` and ``profiling/``.  Without it, the
first ``shared/data/vidur/data`` found next to the checkout or next to one of
its parent folders is used (``../shared/data/vidur/data`` in the usual layout).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["TRACES", "Trace", "data_dir", "load_trace"]

TRACES = {
    "sharegpt": "processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}


_SHARED = Path("shared") / "data" / "vidur" / "data"


def data_dir() -> Path:
    env = os.environ.get("SLIDINGSERVE_DATA")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    for folder in repo.parents:
        if (folder / _SHARED).is_dir():
            return folder / _SHARED
    return repo.parent / _SHARED  # not found: errors name the usual place


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    prefill: np.ndarray
    decode: np.ndarray
    #: Arrival times in seconds when the CSV has ``arrived_at``; else None.
    arrived_at: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prefill)

    def sample(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """n (prefill, decode) pairs drawn with replacement, seeded."""
        idx = np.random.default_rng(seed).integers(0, len(self), n)
        return self.prefill[idx], self.decode[idx]


_CACHE: dict[str, Trace] = {}


def load_trace(name_or_path: str) -> Trace:
    """A named trace (``sharegpt``, ``arxiv``) or any CSV with columns
    ``num_prefill_tokens,num_decode_tokens[,arrived_at]``."""
    if name_or_path in _CACHE:
        return _CACHE[name_or_path]
    if name_or_path in TRACES:
        path = data_dir() / TRACES[name_or_path]
        if not path.exists():
            raise FileNotFoundError(
                f"trace {name_or_path!r} not found at {path}; set SLIDINGSERVE_DATA to the folder "
                "holding processed_traces/"
            )
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(f"no trace named {name_or_path!r} (known: {', '.join(TRACES)}) "
                                    f"and no such file")
    pre, dec, arr = [], [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        for need in ("num_prefill_tokens", "num_decode_tokens"):
            if need not in cols:
                raise ValueError(f"{path}: missing column {need!r}")
        has_arrival = "arrived_at" in cols
        for lineno, row in enumerate(reader, start=2):
            try:
                p, d = int(float(row["num_prefill_tokens"])), int(float(row["num_decode_tokens"]))
                a = float(row["arrived_at"]) if has_arrival else 0.0
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{lineno}: non-numeric value") from None
            if p < 1 or d < 1 or not np.isfinite(a):
                raise ValueError(f"{path}:{lineno}: token counts must be >= 1 and times finite")
            pre.append(p)
            dec.append(d)
            arr.append(a)
    if not pre:
        raise ValueError(f"{path}: no rows")
    trace = Trace(
        name=name_or_path,
        prefill=np.array(pre, dtype=np.int64),
        decode=np.array(dec, dtype=np.int64),
        arrived_at=np.array(arr) if has_arrival else None,
    )
    _CACHE[name_or_path] = trace
    return trace
