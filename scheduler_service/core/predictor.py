"""Batch-latency predictor, formulas (4)–(6): the one owner of the linear model.

The features x1..x7 of a batch and its scenario (decode-only, prefill-only or mixed) are defined in
:mod:`.features`.  One linear model per scenario, with a global model used while a scenario has too
few samples.  Fitting uses scikit-learn; inference is a numpy dot product over many candidate
batches at once, because the schedulers evaluate hundreds of candidate budgets per decision.  For
the schedulers' incremental forms (prefix sums over a queue of requests) a :class:`LinearModel` also
weighs single pieces (:meth:`LinearModel.piece_ms`), so no caller re-derives the formula.  A
predictor is immutable and versioned by a hash of its coefficients, so a plan names exactly the
model that made it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from .errors import FieldViolation, ValidationError
from .features import (
    DECODE,
    MIXED,
    N_FEATURES,
    PREFILL,
    SCENARIOS,
    add_decodes,
    batch_features,
    piece_features,
    scenario_codes,
    scenarios,
)

#: Bounds of a predictor's learned margin (:func:`learn_margin`).
MARGIN_LO, MARGIN_HI = 1.0, 10.0

__all__ = ["DECODE", "MIXED", "N_FEATURES", "PREFILL", "SCENARIOS", "BatchLatencyPredictor", "LinearModel",
           "batch_features", "evaluate", "fit_predictor", "learn_margin", "monotonicity_violations",
           "scenario_codes"]


@dataclass(frozen=True, slots=True)
class LinearModel:
    intercept_ms: float
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.weights) != N_FEATURES:
            raise ValueError(f"a linear model needs {N_FEATURES} weights, got {len(self.weights)}")

    def to_dict(self) -> dict[str, Any]:
        return {"intercept_ms": self.intercept_ms, "weights": list(self.weights)}

    # The prediction of a batch is intercept + Σ_j w_j x_j.  Its features are
    # sums over pieces (x7 a max), so it also splits into the terms below,
    # which the schedulers sum incrementally (prefix sums over a queue):
    #   base_ms(|D'|, Σ_D' u) + Σ_pieces piece_ms(c, u) + x7_ms(max_P c)
    # for the batch "decodes D' + pieces".  The arrangements are fixed: a plan
    # carries its predicted time, so a reordered sum would change plans.

    def predict_one_ms(self, x: Sequence[float]) -> float:
        """Prediction for the features ``x`` of one batch, summed in plain Python left
        to right (an explicit loop, not ``sum``: Python 3.12 made ``sum`` of floats
        compensated, and the compiled kernels reproduce this order)."""
        acc = 0.0
        for w, f in zip(self.weights, x, strict=True):
            acc += w * f
        return float(self.intercept_ms + acc)

    def base_ms(self, n_decodes: float, decode_u: float) -> float:
        """Intercept plus the terms (x3, x4, x5) of ``n_decodes`` decodes of total context ``decode_u``."""
        return float(self.base_ms_many(n_decodes, decode_u))

    def base_ms_many(self, n_decodes: Any, decode_u: Any) -> Any:
        """:meth:`base_ms` elementwise over arrays (the same operations in the same order)."""
        w = self.weights
        return self.intercept_ms + w[2] * decode_u + w[3] * n_decodes + w[4] * decode_u

    def piece_ms(self, c: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Terms x1..x6 of each piece of c tokens on u cached ones (formula
        (5): c > 1 a prefill chunk, c = 1 a decode; c = 0 is no piece)."""
        w1, w2, w3, w4, w5, w6, _ = self.weights
        return (
            np.where(c > 1, c * (w1 * (u + c) + w2 * c + w6), 0.0)
            + np.where(c > 0, w3 * u, 0.0)
            + np.where(c == 1, w4 + w5 * u, 0.0)
        )

    def x7_ms(self, x7: np.ndarray) -> np.ndarray:
        """The x7 term (largest chunk)."""
        return self.weights[6] * x7


@dataclass(frozen=True, slots=True, eq=False)
class BatchLatencyPredictor:
    """Scenario models with a global fallback.  ``version`` is derived from the coefficients; ``meta``
    (sample counts, fit errors, source) is informational and not part of the version."""

    scenarios: Mapping[str, LinearModel | None]
    global_model: LinearModel
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: How many times over a predicted time should count to be kept: learned by the online
    #: refit from the residuals (:func:`learn_margin`), 1 for a predictor fitted offline.
    #: Part of the version (policies read it), and in the JSON only when it is not 1.
    margin: float = 1.0
    version: str = ""
    _coef: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    _models: tuple[LinearModel, ...] = field(default=(), repr=False)
    _memo: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if unknown := set(self.scenarios) - set(SCENARIOS):
            raise ValueError(f"unknown scenarios {sorted(unknown)}; valid: {list(SCENARIOS)}")
        if not MARGIN_LO <= self.margin <= MARGIN_HI:  # also rejects NaN
            raise ValueError(f"margin {self.margin} is not within [{MARGIN_LO:g}, {MARGIN_HI:g}]")
        models = (self.scenarios.get(name) or self.global_model for name in SCENARIOS)
        coef = np.array([[m.intercept_ms, *m.weights] for m in models], dtype=np.float64)
        coef.setflags(write=False)
        object.__setattr__(self, "_coef", coef)
        object.__setattr__(self, "_models", tuple(LinearModel(w[0], tuple(w[1:])) for w in coef.tolist()))
        if not self.version:
            object.__setattr__(self, "version", self._content_version())

    # --------------------------------------------------------------- predict
    @property
    def coef(self) -> np.ndarray:
        """(3, 8) read-only: per scenario (decode, prefill, mixed) the intercept and the
        weights of x1..x7 of the model that predicts it (what the kernels take)."""
        return self._coef

    def model(self, scenario: int) -> LinearModel:
        """The model that predicts batches of ``scenario`` (its own or the global fallback)."""
        return self._models[scenario]

    def predict_ms(self, features: np.ndarray, scenario: np.ndarray | None = None) -> np.ndarray:
        """Predicted latency (ms) of N batches: features (N, 7), scenario (N,) (default: formula (5))."""
        if scenario is None:
            scenario = scenarios(features)
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
            "scenarios": self._scenario_dicts(),
            "global": self.global_model.to_dict(),
            **({"margin": self.margin} if self.margin != 1.0 else {}),
            "meta": dict(self.meta),
        }

    def with_margin(self, margin: float) -> BatchLatencyPredictor:
        """The same models with another learned margin (a new version)."""
        return BatchLatencyPredictor(scenarios=self.scenarios, global_model=self.global_model,
                                     meta=self.meta, margin=margin)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any) -> BatchLatencyPredictor:
        """Parse the predictor JSON (docs/usage.md); the version is recomputed
        from the coefficients (a ``version`` key that disagrees is an error)."""
        if not isinstance(d, Mapping):
            raise ValidationError.single("predictor", "must be a JSON object")
        errs: list[FieldViolation] = []
        scen = d.get("scenarios", {})
        if not isinstance(scen, Mapping):
            errs.append(FieldViolation("scenarios", "must be an object"))
            scen = {}
        models: dict[str, LinearModel | None] = {}
        for k, m in scen.items():
            if k in SCENARIOS:
                models[k] = _model_from(f"scenarios.{k}", m, errs)
            else:
                errs.append(FieldViolation(f"scenarios.{k}", f"unknown scenario; valid: {list(SCENARIOS)}"))
        g = None
        if "global" in d:
            g = _model_from("global", d["global"], errs)
        else:
            errs.append(FieldViolation("global", "is required"))
        margin = d.get("margin", 1.0)
        if not _number(margin) or not MARGIN_LO <= margin <= MARGIN_HI:
            errs.append(FieldViolation("margin", f"must be a number within [{MARGIN_LO:g}, {MARGIN_HI:g}]"))
        if errs:
            raise ValidationError(errs)
        assert g is not None
        meta = d.get("meta", {})
        p = cls(scenarios=models, global_model=g, meta=meta if isinstance(meta, Mapping) else {},
                margin=float(margin))
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

    def _scenario_dicts(self) -> dict[str, dict[str, Any]]:
        return {k: m.to_dict() for k in SCENARIOS if (m := self.scenarios.get(k)) is not None}

    def _content_version(self) -> str:
        content: dict[str, Any] = {
            "s": self._scenario_dicts(),
            "g": self.global_model.to_dict(),
        }
        if self.margin != 1.0:  # versions of predictors without a learned margin stay as they were
            content["m"] = self.margin
        body = json.dumps(content, sort_keys=True)
        return "p-" + hashlib.sha256(body.encode()).hexdigest()[:12]


def _number(x: Any) -> TypeGuard[float]:
    """A JSON number (a bool is not one)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def _finite(x: Any) -> TypeGuard[float]:
    return _number(x) and bool(np.isfinite(x))


def _model_from(path: str, m: Any, errs: list[FieldViolation]) -> LinearModel | None:
    """The model at ``path`` of the predictor JSON; None, its violations added to ``errs``, if invalid."""
    if not isinstance(m, Mapping):
        errs.append(FieldViolation(path, "must be an object"))
        return None
    ic, w = m.get("intercept_ms"), m.get("weights")
    if not _finite(ic):
        errs.append(FieldViolation(f"{path}.intercept_ms", "must be a finite number"))
    if not isinstance(w, list) or len(w) != N_FEATURES or not all(map(_finite, w)):
        errs.append(FieldViolation(f"{path}.weights", f"must be a list of {N_FEATURES} finite numbers"))
        return None
    return LinearModel(float(ic), tuple(map(float, w))) if _finite(ic) else None


#: Features that can be non-zero in a batch of each scenario (0-based, x1 = 0).
#: In a decode-only batch x3 = Σu equals x5 = Σ_D u, so the decode model uses
#: x5 alone; a prefill-only batch has no decodes (x4 = x5 = 0).
SCENARIO_FEATURES = {DECODE: (3, 4), PREFILL: (0, 1, 2, 5, 6), MIXED: tuple(range(N_FEATURES))}
#: The mixed model's weights of these features are at least the prefill model's.
_PREFILL_COLS = SCENARIO_FEATURES[PREFILL]


def _fit_bounded(
    x: np.ndarray,
    y: np.ndarray,
    cols: tuple[int, ...],
    lower: np.ndarray,
    g: np.ndarray | None = None,
    h: np.ndarray | None = None,
) -> LinearModel:
    """Least squares over θ = (intercept, w1..w7) with θ ≥ ``lower`` and, when given, the linear
    constraints ``g @ θ ≥ h``, on the features ``cols`` (the other weights are 0).  Without ``g``
    this is bounded-variable least squares (``scipy.optimize.lsq_linear``, the generalisation of
    scikit-learn's ``LinearRegression(positive=True)`` and of ``nnls`` to lower bounds, the
    intercept included); with ``g`` a small quadratic programme solved by SLSQP from that solution."""
    idx = [0, *(1 + j for j in cols)]
    a = np.column_stack([np.ones(len(x)), x[:, list(cols)]])
    lb = lower[idx]
    assert g is None or np.all(g[:, 0] == 1.0), "every constraint row must include the intercept"
    # Scale columns so that the solver sees comparable magnitudes (x1 is ~1e7,
    # x4 ~1e2); the bounds and constraints scale with them.
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    an, lbn = a / scale, lb * scale
    # Deferred: scipy and scikit-learn take about a second to import and only fitting needs
    # them; every decision, the CLI and `slidingserve health` would pay it at start-up.
    from scipy.optimize import lsq_linear, minimize

    res = lsq_linear(an, y, bounds=(lbn, np.full(len(lb), np.inf)), method="bvls")
    z = res.x
    if g is not None and h is not None and np.any(g[:, idx] @ (z / scale) < h):
        gn = g[:, idx] / scale
        q, c = an.T @ an, an.T @ y
        out = minimize(
            lambda t: 0.5 * t @ q @ t - c @ t, z, jac=lambda t: q @ t - c, method="SLSQP",
            bounds=[(lo, None) for lo in lbn],
            constraints=[{"type": "ineq", "fun": lambda t: gn @ t - h, "jac": lambda t: gn}],
            options={"maxiter": 500, "ftol": 1e-12},
        )
        z = out.x
    theta = np.maximum(z / scale, lb)  # round-off below a bound goes back to it
    if g is not None and h is not None:
        # SLSQP meets constraints to its tolerance; every constraint row has
        # intercept coefficient 1, so raising the intercept by the largest
        # shortfall makes them hold exactly.
        short = h - g[:, idx] @ theta
        if short.max() > 0:
            theta[0] += float(short.max()) * (1 + 1e-12) + 1e-12
    w = np.zeros(N_FEATURES)
    w[list(cols)] = theta[1:]
    return LinearModel(float(theta[0]), tuple(float(v) for v in w))


def _fit_linear(x: np.ndarray, y: np.ndarray) -> LinearModel:
    """Unconstrained least squares on all seven features (``positive=False``)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    from sklearn.linear_model import LinearRegression  # deferred, as in _fit_bounded

    reg = LinearRegression().fit(x / scale, y)
    w = reg.coef_ / scale
    return LinearModel(float(reg.intercept_), tuple(float(v) for v in w))


#: The smallest prefill chunk (c = 2 on an empty cache): its features x1..x7.
_MIN_CHUNK = piece_features(np.array([2.0]), np.array([0.0]))[0]
#: Monotonicity is guaranteed over batches of up to this many decodes of up
#: to this context each, unless the predictor's ``meta["monotone_domain"]``
#: (set by :func:`fit_predictor` from its samples) says otherwise.
DEFAULT_DOMAIN = {"max_decodes": 1024, "max_context": 32768}


def _domain(predictor: BatchLatencyPredictor | None, domain: Mapping[str, Any] | None) -> tuple[float, float]:
    d = domain or (predictor.meta.get("monotone_domain") if predictor is not None else None)
    if not isinstance(d, Mapping):
        d = DEFAULT_DOMAIN
    try:
        return max(1.0, float(d["max_decodes"])), max(0.0, float(d["max_context"]))
    except (KeyError, TypeError, ValueError):
        return float(DEFAULT_DOMAIN["max_decodes"]), float(DEFAULT_DOMAIN["max_context"])


def _cross_rows(n_max: float, ctx: float) -> tuple[np.ndarray, np.ndarray]:
    """Features, with a leading 1 (intercept), of "the smallest chunk + n decodes of total context U"
    at the vertices of 1 ≤ n ≤ n_max, 0 ≤ U ≤ n·ctx; and the same rows without the chunk."""
    verts = [(1.0, 0.0), (1.0, ctx), (n_max, 0.0), (n_max, n_max * ctx)]
    rows = np.array([[1.0, *add_decodes(_MIN_CHUNK[None, :].copy(), n, u)[0]] for n, u in verts])
    dec = rows.copy()
    dec[:, 1:] -= _MIN_CHUNK[None, :]
    return rows, dec


def monotonicity_violations(
    predictor: BatchLatencyPredictor, domain: Mapping[str, Any] | None = None, tol: float = 1e-9
) -> list[str]:
    """Why ``predictor`` is not monotone in work, or [] when it is.

    Monotone means: adding a decode, adding a prefill chunk (c ≥ 2), growing a chunk of ≥ 2 tokens,
    or adding cached tokens to any request never lowers a prediction, across scenarios too (a
    prefill joining decodes, a decode joining prefills).  For linear scenario models on non-negative
    features that holds when

    * every intercept and weight is ≥ 0 (within a scenario);
    * the mixed model is at least the prefill model on x1, x2, x3, x6, x7, and its intercept plus
      one decode (x4 weight) at least the prefill intercept (a decode joining prefills);
    * the smallest chunk joining n decodes of total context U is predicted at least the decodes
      alone, for 1 ≤ n ≤ ``max_decodes`` and U ≤ n·``max_context`` (a linear condition, checked at
      the four vertices).

    The last rule needs a domain because a mixed batch's per-decode cost is lower than a decode-only
    batch's on real GPUs (the weights are read once for both); ``domain`` (default the predictor's
    ``meta["monotone_domain"]``, else :data:`DEFAULT_DOMAIN`) bounds it.  A one-token piece of a
    prompt counts as a decode (formula (5)); its growth to two tokens changes class and is outside
    the rule.  The effective models are checked: a missing scenario uses the global model."""
    c = predictor._coef
    out = []
    for k, name in enumerate(SCENARIOS):
        if c[k, 0] < -tol:
            out.append(f"{name}: intercept {c[k, 0]:.6g} < 0")
        for j in SCENARIO_FEATURES[k]:
            if c[k, 1 + j] < -tol:
                out.append(f"{name}: weight x{j + 1} {c[k, 1 + j]:.6g} < 0")
    d, p, m = c[DECODE], c[PREFILL], c[MIXED]
    for j in _PREFILL_COLS:
        if m[1 + j] < p[1 + j] - tol * max(1.0, abs(p[1 + j])):
            out.append(f"mixed x{j + 1} {m[1 + j]:.6g} < prefill {p[1 + j]:.6g}")
    if m[0] + m[4] < p[0] - tol * max(1.0, abs(p[0])):
        out.append(f"mixed intercept + x4 {m[0] + m[4]:.6g} < prefill intercept {p[0]:.6g}")
    rows, dec = _cross_rows(*_domain(predictor, domain))
    # decode-only part: x3 = x5 = U counts once in the decode model's x3 + x5
    for r, tm, td in zip(rows, rows @ m, dec @ d, strict=True):
        if tm < td - tol * max(1.0, abs(td)):
            out.append(f"a 2-token chunk joining {r[4]:g} decodes of context {r[5]:g} lowers the prediction "
                       f"({td:.6g} → {tm:.6g} ms)")
    return out


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

    ``positive`` (the default) fits a predictor that is monotone in work
    (:func:`monotonicity_violations` is empty over the samples' domain, stored in
    ``meta["monotone_domain"]``): every weight and intercept is ≥ 0 — each feature measures work, so
    a negative weight is an artefact of collinearity — and the mixed model is fitted under the
    cross-scenario constraints of :func:`monotonicity_violations`, with the decode-only and
    prefill-only models fitted first.  A scenario with fewer than ``min_samples`` samples is listed
    in ``meta["borrowed"]``: a thin decode or prefill scenario takes the mixed model on its own
    features; a thin mixed scenario is fitted on all samples.  ``positive=False`` is the
    unconstrained per-scenario least-squares fit, missing scenarios falling back to the global
    model."""
    x, s, y = _samples(features, scenario, latency_ms)
    counts = [int((s == k).sum()) for k in range(len(SCENARIOS))]
    info: dict[str, Any] = {"samples": dict(zip(SCENARIOS, counts, strict=True))}
    if not positive:
        models = {name: _fit_linear(x[s == k], y[s == k]) if counts[k] >= min_samples else None
                  for k, name in enumerate(SCENARIOS)}
        return BatchLatencyPredictor(scenarios=models, global_model=_fit_linear(x, y),
                                     meta={**info, **(meta or {})})
    thin = {k for k, n in enumerate(counts) if n < min_samples}
    fitted = _fit_pure_scenarios(x, s, y, thin)
    n_max, ctx = _sample_domain(x)
    lower, g, h = _mixed_bounds(fitted, n_max, ctx)
    mask = s == MIXED if MIXED not in thin else np.ones(len(y), dtype=bool)
    m = fitted[MIXED] = _fit_bounded(x[mask], y[mask], SCENARIO_FEATURES[MIXED], lower, g, h)
    for k in (DECODE, PREFILL):
        if k not in fitted:
            fitted[k] = _borrow_mixed(m, k)
    info["monotone_domain"] = {"max_decodes": n_max, "max_context": ctx}
    if thin:
        info["borrowed"] = [SCENARIOS[k] for k in sorted(thin)]
    info.update(meta or {})
    # Every scenario has its own model, so the global one never predicts; it
    # is the mixed model, the largest of the three.
    return BatchLatencyPredictor(scenarios={name: fitted[k] for k, name in enumerate(SCENARIOS)},
                                 global_model=fitted[MIXED], meta=info)


def _samples(features: np.ndarray, scenario: np.ndarray,
             latency_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The samples as float/int arrays, checked for shape and finiteness."""
    x = np.asarray(features, dtype=np.float64)
    s = np.asarray(scenario, dtype=np.int64)
    y = np.asarray(latency_ms, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != N_FEATURES or len(x) != len(y) or len(s) != len(y):
        raise ValidationError.single("samples",
                                     f"need features (N, {N_FEATURES}), scenario (N,), latency (N,)")
    if len(y) < 2 or not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)):
        raise ValidationError.single("samples", "need at least 2 finite samples")
    return x, s, y


def _fit_pure_scenarios(x: np.ndarray, s: np.ndarray, y: np.ndarray,
                        thin: set[int]) -> dict[int, LinearModel]:
    """The decode-only and prefill-only models, fitted before the mixed one."""
    everything = np.ones(len(y), dtype=bool)
    zero = np.zeros(N_FEATURES + 1)
    fitted: dict[int, LinearModel] = {}
    for k in (DECODE, PREFILL):
        # A thin decode/prefill scenario is derived from the mixed model below
        # (unless that one is thin too: then everything is fitted on all samples).
        if k not in thin or MIXED in thin:
            mask = s == k if k not in thin else everything
            fitted[k] = _fit_bounded(x[mask], y[mask], SCENARIO_FEATURES[k], zero)
    return fitted


def _sample_domain(x: np.ndarray) -> tuple[float, float]:
    """The domain the cross-scenario rule covers: the samples' largest decode count and mean context."""
    has_d = x[:, 3] > 0
    if not has_d.any():
        return 1.0, 0.0
    return float(x[has_d, 3].max()), float((x[has_d, 4] / x[has_d, 3]).max())


def _mixed_bounds(fitted: Mapping[int, LinearModel], n_max: float,
                  ctx: float) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The mixed model's cross-scenario constraints given the pure ones: lower bounds on θ, rows g·θ ≥ h."""
    lower = np.zeros(N_FEATURES + 1)
    rows_g, rows_h = [], []
    if PREFILL in fitted:
        p = fitted[PREFILL]
        lower[[1 + j for j in _PREFILL_COLS]] = np.take(p.weights, _PREFILL_COLS)
        rows_g.append(np.eye(N_FEATURES + 1)[[0, 4]].sum(axis=0))  # intercept + one decode (x4)
        rows_h.append(p.intercept_ms)
    if DECODE in fitted:
        d = fitted[DECODE]
        cross, dec_part = _cross_rows(n_max, ctx)
        rows_g.extend(cross)
        rows_h.extend(dec_part @ np.array([d.intercept_ms, *d.weights]))
    g = np.array(rows_g) if rows_g else None
    h = np.array(rows_h) if rows_h else None
    return lower, g, h


def _borrow_mixed(m: LinearModel, k: int) -> LinearModel:
    """The mixed model on the features scenario ``k`` has (x3 = x5 in a
    decode-only batch, so their weights merge): never above mixed."""
    w = np.zeros(N_FEATURES)
    cols = list(SCENARIO_FEATURES[k])
    w[cols] = np.take(m.weights, cols)
    if k == DECODE:
        w[4] += m.weights[2]
    return LinearModel(m.intercept_ms, tuple(float(v) for v in w))


def evaluate(
    predictor: BatchLatencyPredictor,
    features: np.ndarray,
    scenario: np.ndarray,
    latency_ms: np.ndarray,
) -> dict[str, dict[str, float]]:
    """MAE, RMSE (ms) and R² per scenario and overall."""
    # deferred, as in _fit_bounded
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    pred = predictor.predict_ms(features, scenario)
    out = {}
    every = np.ones(len(latency_ms), dtype=bool)
    for name, m in [*((name, scenario == k) for k, name in enumerate(SCENARIOS)), ("all", every)]:
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


def learn_margin(predicted_ms: np.ndarray, measured_ms: np.ndarray, *, quantile: float = 0.9,
                 cap: float = 2.0, step: float = 0.05) -> float:
    """The factor that covers ``quantile`` of the measured/predicted ratios of the larger
    half of the batches (by prediction), rounded up to ``step`` and clipped to [1, ``cap``].

    Only the larger half counts: plans bind on batches near a TBT slack, while a decode-only
    iteration of a few ms carries a relative jitter that says nothing about them.  Rounding
    to ``step`` keeps the version stable while the noise stays the same.  1.0 without
    enough samples (fewer than 10 in the larger half)."""
    pred = np.asarray(predicted_ms, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    ok = np.isfinite(pred) & np.isfinite(y) & (pred > 0)
    pred, y = pred[ok], y[ok]
    big = pred >= np.median(pred) if len(pred) else ok[:0]
    if int(big.sum()) < 10:
        return 1.0
    q = float(np.quantile(y[big] / pred[big], quantile, method="higher"))  # covers ≥ quantile of them
    m = np.ceil(q / step - 1e-9) * step
    return float(min(max(round(m, 6), MARGIN_LO), min(cap, MARGIN_HI)))
