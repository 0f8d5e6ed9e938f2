"""Batch-latency predictor, formulas (4)–(6).

A batch is a set of (c_i, u_i): tokens computed this iteration and tokens
already in the KV cache.  D = {c ≤ 1}, P = {c > 1}; the scenario is
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

One linear model per scenario, with a global model used while a scenario has
too few samples.  Fitting uses scikit-learn; inference is a numpy dot product
over many candidate batches at once, because the schedulers evaluate hundreds
of candidate budgets per decision.  A predictor is immutable and versioned by a
hash of its coefficients, so a plan names exactly the model that made it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FieldViolation, ValidationError

__all__ = [
    "DECODE",
    "MIXED",
    "N_FEATURES",
    "PREFILL",
    "SCENARIOS",
    "BatchLatencyPredictor",
    "LinearModel",
    "batch_features",
    "evaluate",
    "fit_predictor",
    "scenario_codes",
]

N_FEATURES = 7
SCENARIOS = ("decode", "prefill", "mixed")
DECODE, PREFILL, MIXED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class LinearModel:
    intercept_ms: float
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.weights) != N_FEATURES:
            raise ValueError(f"a linear model needs {N_FEATURES} weights, got {len(self.weights)}")

    def to_dict(self) -> dict[str, Any]:
        return {"intercept_ms": self.intercept_ms, "weights": list(self.weights)}


def batch_features(c: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, int]:
    """Features (x1..x7) and scenario code of one batch given per-request c, u."""
    c = np.asarray(c, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    p = c > 1
    d = ~p
    cp, up = c[p], u[p]
    x = np.array(
        [
            float(np.sum(cp * (up + cp))),
            float(np.sum(cp * cp)),
            float(np.sum(u)),
            float(np.count_nonzero(d)),
            float(np.sum(u[d])),
            float(np.sum(cp)),
            float(cp.max()) if cp.size else 0.0,
        ]
    )
    return x, int(scenario_codes(np.array([x[3]]), np.array([x[5]]))[0])


def scenario_codes(n_decode: np.ndarray, prefill_tokens: np.ndarray) -> np.ndarray:
    """Formula (5), vectorised: decode-only when there is no prefill chunk."""
    has_p = np.asarray(prefill_tokens) > 0
    has_d = np.asarray(n_decode) > 0
    return np.where(~has_p, DECODE, np.where(~has_d, PREFILL, MIXED)).astype(np.int8)


@dataclass(frozen=True, slots=True, eq=False)
class BatchLatencyPredictor:
    """Scenario models with a global fallback.  ``version`` is derived from the
    coefficients; ``meta`` (sample counts, fit errors, source) is informational
    and not part of the version."""

    scenarios: Mapping[str, LinearModel | None]
    global_model: LinearModel
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: str = ""
    _coef: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    _memo: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown:
            raise ValueError(f"unknown scenarios {sorted(unknown)}; valid: {list(SCENARIOS)}")
        coef = np.empty((len(SCENARIOS), N_FEATURES + 1))
        for k, name in enumerate(SCENARIOS):
            m = self.scenarios.get(name) or self.global_model
            coef[k, 0] = m.intercept_ms
            coef[k, 1:] = m.weights
        coef.setflags(write=False)
        object.__setattr__(self, "_coef", coef)
        if not self.version:
            object.__setattr__(self, "version", self._content_version())

    # --------------------------------------------------------------- predict
    def predict_ms(self, features: np.ndarray, scenario: np.ndarray) -> np.ndarray:
        """Predicted latency (ms) of N batches: features (N, 7), scenario (N,)."""
        w = self._coef[np.asarray(scenario, dtype=np.intp)]
        return w[:, 0] + np.einsum("ij,ij->i", w[:, 1:], features)

    def predict_batch_ms(self, c: np.ndarray, u: np.ndarray) -> float:
        if len(c) == 0:
            return 0.0
        x, s = batch_features(c, u)
        return float(self._coef[s, 0] + self._coef[s, 1:] @ x)

    def prefill_throughput(self, tokens: int) -> float:
        """Tokens/s of a prefill-only batch of ``tokens`` fresh tokens in one
        request: the service's ρ_t estimate when the engine sends none.
        Memoised: a predictor is immutable and this runs every decision."""
        rho = self._memo.get(tokens)
        if rho is None:
            if len(self._memo) >= 256:  # engines send few distinct budgets; bound hostile ones
                self._memo.clear()
            t = self.predict_batch_ms(np.array([tokens]), np.array([0]))
            rho = self._memo[tokens] = tokens / max(t, 1e-3) * 1e3
        return rho

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "scenarios": {
                k: m.to_dict() for k in SCENARIOS if (m := self.scenarios.get(k)) is not None
            },
            "global": self.global_model.to_dict(),
            "meta": dict(self.meta),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any) -> BatchLatencyPredictor:
        """Parse the ARCHITECTURE §3 predictor JSON; the version is recomputed
        from the coefficients (a ``version`` key that disagrees is an error)."""
        errs: list[FieldViolation] = []
        if not isinstance(d, Mapping):
            raise ValidationError.single("predictor", "must be a JSON object")

        def model(path: str, m: Any) -> LinearModel | None:
            if not isinstance(m, Mapping):
                errs.append(FieldViolation(path, "must be an object"))
                return None
            ic, w = m.get("intercept_ms"), m.get("weights")
            ok_ic = isinstance(ic, int | float) and not isinstance(ic, bool) and np.isfinite(ic)
            if not ok_ic:
                errs.append(FieldViolation(f"{path}.intercept_ms", "must be a finite number"))
            if (
                not isinstance(w, list)
                or len(w) != N_FEATURES
                or not all(isinstance(x, int | float) and not isinstance(x, bool) and np.isfinite(x) for x in w)
            ):
                errs.append(FieldViolation(f"{path}.weights", f"must be a list of {N_FEATURES} finite numbers"))
                return None
            if not ok_ic:
                return None
            return LinearModel(float(ic), tuple(float(x) for x in w))  # type: ignore[arg-type]

        scen = d.get("scenarios", {})
        if not isinstance(scen, Mapping):
            errs.append(FieldViolation("scenarios", "must be an object"))
            scen = {}
        models: dict[str, LinearModel | None] = {}
        for k, m in scen.items():
            if k not in SCENARIOS:
                errs.append(FieldViolation(f"scenarios.{k}", f"unknown scenario; valid: {list(SCENARIOS)}"))
                continue
            models[k] = model(f"scenarios.{k}", m)
        g = None
        if "global" in d:
            g = model("global", d["global"])
        else:
            errs.append(FieldViolation("global", "is required"))
        if errs:
            raise ValidationError(errs)
        assert g is not None
        meta = d.get("meta", {})
        p = cls(scenarios=models, global_model=g, meta=meta if isinstance(meta, Mapping) else {})
        claimed = d.get("version")
        if claimed and claimed != p.version:
            raise ValidationError.single(
                "version", f"{claimed!r} does not match the coefficients (they hash to {p.version!r})"
            )
        return p

    @classmethod
    def from_json(cls, text: str | bytes) -> BatchLatencyPredictor:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValidationError.single("predictor", f"is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def _content_version(self) -> str:
        body = json.dumps(
            {"s": {k: m.to_dict() for k in SCENARIOS if (m := self.scenarios.get(k)) is not None},
             "g": self.global_model.to_dict()},
            sort_keys=True,
        )
        return "p-" + hashlib.sha256(body.encode()).hexdigest()[:12]


def _fit_linear(x: np.ndarray, y: np.ndarray, positive: bool) -> LinearModel:
    from sklearn.linear_model import LinearRegression

    # Scale columns so that the solver sees comparable magnitudes (x1 is ~1e7,
    # x4 ~1e2); unscale the weights afterwards.
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    reg = LinearRegression(positive=positive).fit(x / scale, y)
    w = reg.coef_ / scale
    return LinearModel(float(reg.intercept_), tuple(float(v) for v in w))


def fit_predictor(
    features: np.ndarray,
    scenario: np.ndarray,
    latency_ms: np.ndarray,
    *,
    min_samples: int = 30,
    positive: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> BatchLatencyPredictor:
    """Fit scenario models and the global fallback.

    ``positive`` keeps every weight ≥ 0: each feature measures work, so a
    negative weight is an artefact of collinearity and makes the predicted
    time non-monotone in the budget.
    """
    x = np.asarray(features, dtype=np.float64)
    s = np.asarray(scenario, dtype=np.int64)
    y = np.asarray(latency_ms, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != N_FEATURES or len(x) != len(y) or len(s) != len(y):
        raise ValidationError.single(
            "samples", f"need features (N, {N_FEATURES}), scenario (N,), latency (N,)"
        )
    if len(y) < 2 or not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)):
        raise ValidationError.single("samples", "need at least 2 finite samples")
    models: dict[str, LinearModel | None] = {}
    counts = {}
    for k, name in enumerate(SCENARIOS):
        mask = s == k
        counts[name] = int(mask.sum())
        models[name] = _fit_linear(x[mask], y[mask], positive) if mask.sum() >= min_samples else None
    g = _fit_linear(x, y, positive)
    info = {"samples": counts}
    info.update(meta or {})
    return BatchLatencyPredictor(scenarios=models, global_model=g, meta=info)


def evaluate(
    predictor: BatchLatencyPredictor,
    features: np.ndarray,
    scenario: np.ndarray,
    latency_ms: np.ndarray,
) -> dict[str, dict[str, float]]:
    """MAE, RMSE (ms) and R² per scenario and overall."""
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    pred = predictor.predict_ms(features, scenario)
    out = {}
    groups = [(name, scenario == k) for k, name in enumerate(SCENARIOS)]
    groups.append(("all", np.ones(len(latency_ms), dtype=bool)))
    for name, m in groups:
        if m.sum() < 2:
            continue
        y, p = latency_ms[m], pred[m]
        out[name] = {
            "n": int(m.sum()),
            "mae_ms": float(mean_absolute_error(y, p)),
            "rmse_ms": float(np.sqrt(mean_squared_error(y, p))),
            "r2": float(r2_score(y, p)),
        }
    return out
