"""Per-profile predictors with online refit.

Why this shape:

* **Profiles never mix.**  Each engine profile (model|hardware|tp) has its own state; a
  profile never reported uses the bootstrap predictor and creates no state (so scheduling
  calls cannot grow server memory).
* **Tenants never mix either.**  With authentication the servicer keys states by
  ``tenant|profile`` (:func:`.security.scoped_key`), and ``max_profiles_per_tenant`` caps
  each tenant's share of ``max_profiles`` so that one tenant cannot use up every slot.
* **Hot path is lock-free.**  ``current(key)`` is one dict lookup and one attribute read;
  publishing replaces the reference atomically (the predictor object is immutable), so a
  decision sees either the old or the new version, never a mix.
* **Refits run off the request path** on one background thread: a report call only appends
  to a bounded window and, every ``refit_every`` new samples, enqueues the profile.
* **A refit must earn its publication.**  The most recent ``holdout_fraction`` of the window
  is held out; the candidate is fitted on the older part and published only if its MAE on
  the held-out recent samples is at least ``min_gain`` below the current version's.  Recent
  samples are what the next decisions will look like, so this is the comparison that
  matters; the required gain keeps refits on a noisy engine from flapping between models
  that are equally good.
* **The margin is learned from the residuals.**  A published predictor carries the factor
  that covers ``margin_quantile`` of the measured/predicted ratios on the held-out samples
  (:func:`~scheduler_service.core.predictor.learn_margin`); policies count predicted times
  that many times over.  When no better model is found, the current one is republished with
  a new margin only when the learned margin moved by ``margin_hysteresis`` or more
  ("remargined"), so that the margin follows a change in the engine's noise, not the noise.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from scheduler_service.core import BatchLatencyPredictor, ValidationError, fit_predictor
from scheduler_service.core.predictor import learn_margin, monotonicity_violations

if TYPE_CHECKING:  # the registry only calls what it is handed: no prometheus here
    from .metrics import Metrics

__all__ = ["PredictorRegistry", "ProfileState", "RefitSettings"]

log = structlog.get_logger("slidingserve.predictors")


@dataclass(frozen=True, slots=True)
class RefitSettings:
    every: int = 256
    window: int = 4096
    holdout_fraction: float = 0.2
    min_samples: int = 30
    max_profiles: int = 64
    #: Profiles one tenant may create (0 = no cap besides ``max_profiles``).
    max_profiles_per_tenant: int = 0
    #: A candidate is published only if its held-out MAE is this fraction below the current's.
    min_gain: float = 0.02
    #: Share of held-out measured/predicted ratios the learned margin covers (0 = margin 1).
    margin_quantile: float = 0.9
    #: The learned margin never exceeds this.
    max_margin: float = 2.0
    #: Republish the current model when its learned margin moved at least this much.
    margin_hysteresis: float = 0.1


@dataclass(eq=False)
class ProfileState:
    key: str
    current: BatchLatencyPredictor
    window: deque[tuple[np.ndarray, int, float]]
    tenant: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    new_since_refit: int = 0
    accepted: int = 0
    refits: int = 0
    published: int = 0
    refit_queued: bool = False


class PredictorRegistry:
    def __init__(
        self,
        bootstrap: BatchLatencyPredictor,
        settings: RefitSettings,
        metrics: Metrics | None = None,
        on_publish: Callable[[str, BatchLatencyPredictor], None] | None = None,
        *,
        synchronous: bool = False,
    ) -> None:
        """``synchronous`` refits inside :meth:`add` instead of on the worker
        thread: slower reports, but a replay (the simulator) is deterministic."""
        self.bootstrap = bootstrap
        self.settings = settings
        self._metrics = metrics
        self._on_publish = on_publish
        self._states: dict[str, ProfileState] = {}
        self._per_tenant: dict[str, int] = {}
        self._states_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._busy = False
        self._closed = False
        self._synchronous = synchronous
        self._thread = threading.Thread(target=self._worker, name="predictor-refit", daemon=True)
        if not synchronous:
            self._thread.start()

    # ------------------------------------------------------------ hot path
    def current(self, key: str) -> BatchLatencyPredictor:
        st = self._states.get(key)
        return self.bootstrap if st is None else st.current

    def state(self, key: str) -> ProfileState | None:
        return self._states.get(key)

    # ------------------------------------------------------------- reports
    def add(self, key: str, x: np.ndarray, scenario: int, latency_ms: float, *, tenant: str = "") -> float:
        """Buffer one validated sample; returns the current predictor's abs error (ms).
        ``tenant`` (the owner of ``key``) only counts towards ``max_profiles_per_tenant``."""
        st = self._states.get(key)
        if st is None:
            with self._states_lock:
                st = self._states.get(key)
                if st is None:
                    if len(self._states) >= self.settings.max_profiles:
                        raise ValidationError.single(
                            "engine_profile",
                            f"the server already tracks {self.settings.max_profiles} profiles (max_profiles)",
                        )
                    cap = self.settings.max_profiles_per_tenant
                    if cap and self._per_tenant.get(tenant, 0) >= cap:
                        raise ValidationError.single(
                            "engine_profile",
                            f"this tenant already has {cap} profiles (max_profiles_per_tenant)",
                        )
                    st = self._new_state(key, self.bootstrap, tenant)
                    if self._metrics:
                        self._metrics.predictor_version.labels(profile=key).info(
                            {"version": st.current.version}
                        )
        current = st.current
        pred = float(current.predict_ms(x[None, :], np.array([scenario]))[0])
        if self._metrics and latency_ms > pred:
            self._metrics.predictor_overruns.labels(profile=key, margin="none").inc()
            if latency_ms > pred * current.margin:
                self._metrics.predictor_overruns.labels(profile=key, margin="learned").inc()
        with st.lock:
            st.window.append((x, scenario, latency_ms))
            st.accepted += 1
            st.new_since_refit += 1
            trigger = st.new_since_refit >= self.settings.every and not st.refit_queued
            if trigger:
                st.refit_queued = True
                st.new_since_refit = 0
        if trigger:
            if self._synchronous:
                self.refit(key)
            else:
                with self._cv:
                    self._queue.append(key)
                    self._cv.notify_all()
        return abs(pred - latency_ms)

    def _new_state(self, key: str, predictor: BatchLatencyPredictor, tenant: str) -> ProfileState:
        """Track ``key`` (under ``_states_lock``, its limits checked by the caller)."""
        st = ProfileState(key, predictor, deque(maxlen=self.settings.window), tenant)
        self._states[key] = st
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        return st

    # ------------------------------------------------------ other workers
    def install(self, key: str, predictor: BatchLatencyPredictor, *, tenant: str = "") -> bool:
        """Serve ``predictor`` for ``key`` from now on: a refit another worker of the same
        service published (:mod:`.workers`).  It becomes the baseline that this worker's
        own next refit of ``key`` must beat; the local report window is kept.  Returns
        False when ``key`` is new here and ``max_profiles`` is reached (memory stays bounded;
        the profile keeps the bootstrap predictor on this worker)."""
        st = self._states.get(key)
        if st is None:
            with self._states_lock:
                st = self._states.get(key)
                if st is None:
                    if len(self._states) >= self.settings.max_profiles:
                        return False
                    st = self._new_state(key, predictor, tenant)
        with st.lock:
            st.current = predictor  # atomic reference swap, as a local publication
        if self._metrics:
            self._metrics.predictor_version.labels(profile=key).info({"version": predictor.version})
        return True

    # --------------------------------------------------------------- refit
    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until no refit is queued or running (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                key = self._queue.popleft()
                self._busy = True
            try:
                self.refit(key)
            except Exception:
                log.exception("refit_failed", profile=key)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def refit(self, key: str) -> str:
        """Refit ``key`` now; returns the outcome (published, remargined, rejected, unchanged,
        skipped)."""
        st = self._states[key]
        with st.lock:
            st.refit_queued = False
            rows = list(st.window)
            st.refits += 1
        outcome, info = self._refit_rows(st, rows)
        if self._metrics:
            self._metrics.refits.labels(profile=key, outcome=outcome).inc()
        log.info("predictor_refit", profile=key, outcome=outcome, **info)
        return outcome

    def _refit_rows(self, st: ProfileState, rows: list[tuple[np.ndarray, int, float]]) -> tuple[str, dict[str, Any]]:
        n = len(rows)
        n_hold = max(1, round(n * self.settings.holdout_fraction))
        if n - n_hold < 2:
            return "skipped", {"samples": n}
        x = np.stack([r[0] for r in rows])
        s = np.array([r[1] for r in rows], dtype=np.int64)
        y = np.array([r[2] for r in rows], dtype=np.float64)
        cut = n - n_hold
        current = st.current
        try:
            cand = fit_predictor(
                x[:cut], s[:cut], y[:cut], min_samples=self.settings.min_samples,
                meta={"source": "online refit", "profile": st.key, "parent_version": current.version},
            )
        except (ValidationError, ValueError) as e:
            return "skipped", {"samples": n, "error": str(e)}
        y_hold = y[cut:]
        pred_new = cand.predict_ms(x[cut:], s[cut:])
        pred_cur = current.predict_ms(x[cut:], s[cut:])
        mae_new = float(np.mean(np.abs(pred_new - y_hold)))
        mae_cur = float(np.mean(np.abs(pred_cur - y_hold)))
        info: dict[str, Any] = {
            "samples": n, "holdout": n_hold, "mae_new_ms": round(mae_new, 4), "mae_current_ms": round(mae_cur, 4),
            "current_version": current.version, "candidate_version": cand.version,
            "current_margin": current.margin,
        }
        outcome = ""
        if not np.isfinite(mae_new) or mae_new > mae_cur * (1.0 - self.settings.min_gain):
            outcome = "rejected"
        # Never publish a model under which more work is predicted faster: the
        # chunker and the BatchConstructor rely on it (the fit enforces it; this
        # is the last line of defence).
        elif broken := monotonicity_violations(cand):
            info["not_monotone"] = broken[:3]
            outcome = "rejected"
        elif cand.coef.tobytes() == current.coef.tobytes():
            outcome = "unchanged"
        if outcome:  # the current model stays; its margin follows the residuals, with hysteresis
            # over the whole window: ten times the samples of the holdout, so a steady noise
            # gives a steady margin (the current model was fitted before most of them arrived)
            margin = self._margin(current.predict_ms(x, s), y)
            if margin == current.margin or abs(margin - current.margin) < self.settings.margin_hysteresis:
                return outcome, info
            info["kept_as"] = outcome
            self._publish(st, current.with_margin(margin))
            info["margin"] = margin
            return "remargined", info
        info["margin"] = margin = self._margin(pred_new, y_hold)
        self._publish(st, BatchLatencyPredictor(
            scenarios=cand.scenarios, global_model=cand.global_model, margin=margin,
            meta={**cand.meta, "holdout_mae_ms": mae_new, "holdout_samples": n_hold},
        ))
        return "published", info

    def _margin(self, predicted: np.ndarray, measured: np.ndarray) -> float:
        q = self.settings.margin_quantile
        return learn_margin(predicted, measured, quantile=q, cap=self.settings.max_margin) if q > 0 else 1.0

    def _publish(self, st: ProfileState, published: BatchLatencyPredictor) -> None:
        with st.lock:
            st.current = published  # atomic reference swap; readers never lock
            st.published += 1
        if self._metrics:
            self._metrics.predictor_version.labels(profile=st.key).info({"version": published.version})
        if self._on_publish:
            self._on_publish(st.key, published)
