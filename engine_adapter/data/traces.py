"""Request-length traces (ShareGPT, arXiv-Summarization) from Vidur / Sarathi-Serve.

They ship gzipped with the package (:mod:`engine_adapter.data`, see ``engine_adapter/data/vidur/PROVENANCE.md``);
``SLIDINGSERVE_DATA`` names another folder holding ``processed_traces/`` to read instead.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import data_dir, find, open_text

__all__ = ["TRACES", "Trace", "data_dir", "load_trace"]

TRACES = {
    "sharegpt": "processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}


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
    """A named trace (``sharegpt``, ``arxiv``) or any CSV (plain or ``.gz``) with columns
    ``num_prefill_tokens,num_decode_tokens[,arrived_at]``."""
    if name_or_path in _CACHE:
        return _CACHE[name_or_path]
    if name_or_path in TRACES:
        path = find(TRACES[name_or_path], f"trace {name_or_path!r}")
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(f"no trace named {name_or_path!r} (known: {', '.join(TRACES)}) "
                                    f"and no such file")
    pre, dec, arr = [], [], []
    with open_text(path) as fh:
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
