"""Batch features x1..x7, formulas (4)–(6): their one definition.

A batch is a set of *pieces* (c_i, u_i): tokens computed this iteration and
tokens already in the KV cache.  D = {c ≤ 1}, P = {c > 1}; the scenario is
decode-only (P empty), prefill-only (D empty) or mixed.  Seven features:

====  ==========================  ==========================================
x1    Σ_P c(u + c)                attention work of prefill chunks vs cache
x2    Σ_P c²                      attention inside the chunk
x3    Σ u                         all cached tokens
x4    |D|                         number of decodes
x5    Σ_D u                       decode context (KV bytes read)
x6    Σ_P c                       prefill tokens
x7    max_P c                     largest chunk
====  ==========================  ==========================================

Each piece has its own feature row (:func:`piece_features`); a batch's
features are the column sums of its pieces' rows, except x7, the column max
(:func:`combine`, :func:`combine_sets`).  Every feature of a batch of integer
pieces is an integer, so sums of rows are exact in any order.  How the linear
model weighs them lives in :mod:`.predictor`.

The scalar formulas at the end (:func:`piece_ms_one`, :func:`base_ms_one`,
:func:`segment_ms_one`) price one piece or one segment under a coefficient row of the
predictor's ``coef`` in plain Python that the kernels wrap with ``numba.njit``, so each
formula is written once (module-level constants are compile-time constants).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "DECODE",
    "MIXED",
    "N_FEATURES",
    "PREFILL",
    "SCENARIOS",
    "X4",
    "X6",
    "X7",
    "add_decodes",
    "add_piece",
    "base_ms_one",
    "batch_features",
    "combine",
    "combine_sets",
    "decode_features",
    "piece_features",
    "piece_ms_one",
    "scenario_codes",
    "scenario_of",
    "scenarios",
    "segment_ms_one",
]

N_FEATURES = 7
SCENARIOS = ("decode", "prefill", "mixed")
DECODE, PREFILL, MIXED = 0, 1, 2
#: Columns (0-based) read by name: x4 (decodes) and x6 (prefill tokens)
#: decide the scenario; x7 is the one feature that combines by max, not by sum.
X4, X6, X7 = 3, 5, 6


def piece_features(c: np.ndarray, u: np.ndarray) -> np.ndarray:
    """(n, 7): the feature row of each piece of c tokens on u cached ones.
    c > 1 is a prefill chunk, c ≤ 1 a decode (formula (5))."""
    c = np.asarray(c, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    big = c > 1
    f = np.zeros((len(c), N_FEATURES))
    f[:, 0] = np.where(big, c * (u + c), 0.0)
    f[:, 1] = np.where(big, c * c, 0.0)
    f[:, 2] = u
    f[:, 3] = ~big
    f[:, 4] = np.where(big, 0.0, u)
    f[:, 5] = np.where(big, c, 0.0)
    f[:, 6] = f[:, 5]
    return f


def add_piece(x: list[float], c: int, u: int) -> None:
    """Add one piece to the features ``x`` of a batch, in place (the scalar
    form of :func:`piece_features` + :func:`combine`)."""
    if c > 1:
        x[0] += c * (u + c)
        x[1] += c * c
        x[5] += c
        x[6] = max(x[6], c)
    else:
        x[3] += 1
        x[4] += u
    x[2] += u


def decode_features(n: float, u: float) -> np.ndarray:
    """x1..x7 of n decodes (one token each) of total context u."""
    return np.array([0.0, 0.0, u, n, u, 0.0, 0.0])


def add_decodes(x: np.ndarray, n: float, u: float) -> np.ndarray:
    """Features (m, 7) of m batches, each joined by n decodes of total
    context u, in place."""
    x[:, 2] += u
    x[:, 3] += n
    x[:, 4] += u
    return x


def combine(f: np.ndarray) -> np.ndarray:
    """Features of the batch made of the pieces' rows ``f`` (n, 7)."""
    x = f.sum(axis=0)
    x[X7] = f[:, X7].max() if len(f) else 0.0
    return x


def combine_sets(base: np.ndarray, f: np.ndarray, member: np.ndarray) -> np.ndarray:
    """(m, 7): features of "``base`` + the pieces of each row of ``member``"
    (bool (m, n) over the rows of ``f``); ``base`` holds no chunk (x7 = 0)."""
    x = base[None, :] + member.astype(np.float64) @ f
    x[:, X7] = np.max(np.where(member, f[None, :, X7], 0.0), axis=1, initial=0.0)
    return x


def scenario_codes(n_decode: np.ndarray, prefill_tokens: np.ndarray) -> np.ndarray:
    """Formula (5), vectorised: decode-only when there is no prefill chunk."""
    has_p = np.asarray(prefill_tokens) > 0
    has_d = np.asarray(n_decode) > 0
    return np.where(~has_p, DECODE, np.where(~has_d, PREFILL, MIXED)).astype(np.int8)


def scenarios(x: np.ndarray) -> np.ndarray:
    """Formula (5) for the features (m, 7) of m batches."""
    return scenario_codes(x[:, X4], x[:, X6])


def scenario_of(x: np.ndarray | list[float]) -> int:
    """Formula (5) for the features of one batch."""
    return DECODE if x[X6] == 0 else (PREFILL if x[X4] == 0 else MIXED)


def batch_features(c: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, int]:
    """Features (x1..x7) and scenario code of one batch given per-piece c, u."""
    x = combine(piece_features(c, u))
    return x, scenario_of(x)


# ------------------------------------------------------- scalar formulas (numba-compilable)
def piece_ms_one(w: np.ndarray, c: float, u: float) -> float:
    """``LinearModel.piece_ms`` of one piece under the coefficient row ``w``
    (intercept, x1..x7): the terms x1..x6 of c tokens on u cached ones."""
    a = c * (w[1] * (u + c) + w[2] * c + w[6]) if c > 1 else 0.0
    b = w[3] * u if c > 0 else 0.0
    d = w[4] + w[5] * u if c == 1 else 0.0
    return a + b + d


def base_ms_one(w: np.ndarray, n: float, du: float) -> float:
    """``LinearModel.base_ms`` under the row ``w``: intercept plus n decodes of total context du."""
    return w[0] + w[3] * du + w[4] * n + w[5] * du


def segment_ms_one(coef: np.ndarray, R: np.ndarray, u0: np.ndarray, n_dec: int, dec_u: float,
                   x: int, y: int, step: int) -> float:
    """Predicted time of "n_dec decodes + stream segment [x, y)" (look-ahead ``step``):
    its features summed piece by piece (:func:`add_piece`), weighed under the scenario's
    row of ``coef`` left to right as ``LinearModel.predict_one_ms`` does; 0 when empty.
    R: the stream boundaries, u0: each request's computed tokens."""
    du = dec_u + step * n_dec
    f = np.array([0.0, 0.0, du, float(n_dec), du, 0.0, 0.0])
    j = np.searchsorted(R, x, side="right") - 1
    pos = x
    while pos < y:
        end = min(y, R[j + 1])
        c = end - pos
        u = u0[j] + pos - R[j]
        if c > 1:
            f[0] += c * (u + c)
            f[1] += c * c
            f[5] += c
            f[6] = max(f[6], float(c))
        else:
            f[3] += 1
            f[4] += u
        f[2] += u
        pos = end
        j += 1
    if f[3] == 0 and f[5] == 0:
        return 0.0
    s = DECODE if f[5] == 0 else (PREFILL if f[3] == 0 else MIXED)
    acc = 0.0
    for i in range(N_FEATURES):
        acc += coef[s, 1 + i] * f[i]
    return float(coef[s, 0] + acc)
