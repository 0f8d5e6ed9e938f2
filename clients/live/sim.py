"""Sim-to-real: the live sweep's workloads replayed in the simulated engine, with the live
engine's own cost model as the ground truth.

The ground truth is the predictor the scheduling service fitted on the live engine's
iteration reports during the sweep (``engine_predictor.json``), times mean-one lognormal
noise; the simulated engine has the live run's token budget and sequence limit.  Every
configuration's policy replays the same requests at the same arrival times (vLLM's own
scheduler as ``vllm-fcfs``, the project's model of it), starting, like the live engine,
from the bundled default predictor and refitting online.  The records have the live runs'
keys, so the report puts the two curves side by side.

The client is part of what a live run measures: it shares a core with vLLM's API server,
sends some requests late, reads some tokens late (its event loop is busy) and adds the
HTTP, tokenizing and streaming path to every TTFT.  :class:`Frontend` replays what a live
run recorded of that (``frontend/`` beside the runs): each request arrives as late as it was
sent, and each token is seen when the client's loop could have read it, plus the mean
difference between the client's TTFT and vLLM's own (what is left once the loop's lag is
counted).  Records with ``source: "sim+client"`` are that replay.

The machine's speed is not one number either: on a shared machine the same engine ran up
to a third faster or slower from run to run, and one cost model fitted over a whole sweep
is too slow for some runs and too fast for others.  Where a live run recorded vLLM's own
mean inter-token latency (``vllm_timings``), :func:`match_speed` finds the factor on the
cost model's iteration times under which the replay of that run has the same mean
inter-token latency, engine-side, and replays the run at that speed with the client's
delays (``source: "sim+speed"``, the factor in ``speed``).  The engine's pace is then
taken from the live run; what the replay still gets wrong is the scheduling and the queue.
A remote run's late answers are replayed too (:class:`LateAnswers`): the same share of the
decisions fails as late, and the adapter falls back to ``vllm-fcfs`` and backs off, as it
did live (the live run's ``fallback_deadline`` count over its iterations).

One factor is not the engine's whole shape: at 1 and 2 req/s the replays at each run's
speed gave vLLM's prefills 10–25% less time than vLLM measured (its prefill time, from first
scheduling to first token), and its attainment 10–17 points too much at its capacity.
:func:`match_pace` fits a second factor, on the iterations that carry prefill chunks, with
the first, so that the replay of vLLM's own run has both its mean inter-token latency and
its mean prefill time; every configuration's run at that rate and seed is replayed with that
prefill factor, at its own speed (``source: "sim+pace"``).  The prefill factor is read on
vLLM's run only: a policy that holds chunks back adds its own waits to the prefill time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapter.core import AdapterCore, AdapterSettings, IterationSample
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES
from scheduler_service.core import BatchLatencyPredictor, default_predictor

from .measure import RequestResult, summarize
from .runner import Config, LiveSpec, frontend_path
from .workload import make_requests

__all__ = ["FittedTruth", "Frontend", "LateAnswers", "cost_structure", "late_share", "match_pace",
           "match_speed", "noise_from_overruns", "prefill_mean_ms", "replay_engine", "simulate_sweep"]


class FittedTruth:
    """Iteration latency (ms) from a predictor fitted on a live engine, with mean-one
    lognormal noise of spread ``noise_sigma`` (the simulated engine's ground-truth interface),
    times ``scale`` (above 1: a slower engine than the one the predictor was fitted on), and
    times ``prefill_scale`` more on an iteration that carries a prefill chunk (one with an
    entry of more than one token: this engine has no multi-token decodes)."""

    def __init__(self, predictor: BatchLatencyPredictor, noise_sigma: float = 0.15, scale: float = 1.0,
                 prefill_scale: float = 1.0) -> None:
        for name, v in (("scale", scale), ("prefill_scale", prefill_scale)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v}")
        self.predictor = predictor
        self.noise_sigma = float(noise_sigma)
        self.scale = float(scale)
        self.prefill_scale = float(prefill_scale)

    def scaled(self, scale: float, prefill_scale: float | None = None) -> FittedTruth:
        return FittedTruth(self.predictor, self.noise_sigma, scale,
                           self.prefill_scale if prefill_scale is None else prefill_scale)

    def iteration_ms(self, c: np.ndarray, u: np.ndarray, rng: np.random.Generator | None = None) -> float:
        c = np.asarray(c, dtype=np.int64)
        u = np.asarray(u, dtype=np.int64)
        live = c > 0
        if not live.any():
            return 0.0
        t = max(float(self.predictor.predict_batch_ms(c[live], u[live])), 0.05) * self.scale
        if self.prefill_scale != 1.0 and c.max() > 1:
            t *= self.prefill_scale
        if rng is not None:
            s = self.noise_sigma
            t *= math.exp(s * rng.standard_normal() - 0.5 * s * s)
        return t


def cost_structure(p: BatchLatencyPredictor) -> dict[str, float]:
    """What an iteration of the engine costs, read off a fitted predictor (ms): a lone
    decode on a 256-token context, each more decode, each prefill token of a 256 → 512 chunk,
    a 512-token prefill alone."""
    one = float(p.predict_batch_ms(np.array([1]), np.array([256])))
    many = float(p.predict_batch_ms(np.ones(32, np.int64), np.full(32, 256)))
    p256 = float(p.predict_batch_ms(np.array([256]), np.array([0])))
    p512 = float(p.predict_batch_ms(np.array([512]), np.array([0])))
    return {"one_decode_ms": one, "per_decode_ms": (many - one) / 31, "per_prefill_token_ms": (p512 - p256) / 256,
            "prefill_512_ms": p512}


@dataclasses.dataclass(frozen=True, slots=True)
class Frontend:
    """What the client added to one live run's timings (see the module)."""

    #: per request (by index): how late it was sent (s)
    late_s: np.ndarray
    #: the event loop's late wake-ups: when each was due (s since the run's start), how late
    lag_at: np.ndarray
    lag_s: np.ndarray
    #: the client's mean TTFT minus vLLM's (s), None when not measured
    frontend_s: float | None

    @classmethod
    def load(cls, path: Path) -> Frontend | None:
        if not path.exists():
            return None
        doc = json.loads(path.read_text())
        lag = np.asarray(doc.get("lag") or np.zeros((0, 2)), dtype=np.float64).reshape(-1, 2)
        f = doc.get("frontend_ms")
        return cls(np.asarray(doc["late_s"], dtype=np.float64), lag[:, 0], lag[:, 1],
                   None if f is None else float(f) / 1e3)

    def read_at(self, t: np.ndarray) -> np.ndarray:
        """When the client's loop could read a token the server sent at ``t``: the end of
        the stall covering ``t``, if one does, else ``t``."""
        t = np.asarray(t, dtype=np.float64)
        k = np.searchsorted(self.lag_at, t, side="right") - 1
        ok = k >= 0
        end = np.where(ok, self.lag_at[np.maximum(k, 0)] + self.lag_s[np.maximum(k, 0)], -np.inf)
        return np.maximum(t, end)

    def base_s(self, first_tokens: np.ndarray) -> float:
        """The constant part of the client's delay: its measured TTFT excess over vLLM's,
        less what the loop's lag already explains on these first tokens (at least 0)."""
        if self.frontend_s is None or not len(first_tokens):
            return 0.0
        explained = float(np.mean(self.read_at(first_tokens) - first_tokens))
        return max(0.0, self.frontend_s - explained)


def noise_from_overruns(runs: Sequence[dict[str, Any]]) -> float | None:
    """The spread of the live engine's iteration times around the service's prediction, as
    a lognormal σ: the median over the runs that measured it (remote runs, which record the
    share of iterations over the bare prediction and over it times the learned margin m).
    For measured = b · prediction · lognormal(σ), the two shares s₁ and s_m give
    Φ⁻¹(1 − s_m) − Φ⁻¹(1 − s₁) = ln m / σ, whatever the bias b.  None when no run has both."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf
    sigmas = []
    for r in runs:
        shares, m = r.get("overrun_share") or {}, r.get("service_margin")
        s1, sm = shares.get("none"), shares.get("learned")
        if m is None or s1 is None or sm is None or not (m > 1 and 0 < sm < s1 < 1):
            continue
        sigmas.append(math.log(m) / (z(1 - sm) - z(1 - s1)))
    return float(np.median(sigmas)) if sigmas else None


class LateAnswers:
    """The scheduler's answers late (``TimeoutError``) on a ``share`` of the decisions,
    drawn from a generator seeded with ``seed``; the rest from ``inner``.  The adapter
    core handles a late answer as it does live: a fallback decision and a back-off."""

    def __init__(self, inner: InProcessBackend, share: float, seed: int) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"share must be in [0, 1), got {share}")
        self.inner, self.share = inner, float(share)
        self._rng = np.random.default_rng([seed, 7919])

    def schedule(self, snapshot: Any, timeout_s: float) -> Any:
        if self.share and self._rng.random() < self.share:
            raise TimeoutError("a late answer (replayed)")
        return self.inner.schedule(snapshot, timeout_s)

    def report(self, samples: Sequence[IterationSample]) -> None:
        self.inner.report(samples)

    def close(self) -> None:
        self.inner.close()


def late_share(run: dict[str, Any] | None) -> float:
    """The share of a live run's decisions answered late (0 without a count)."""
    ad = (run or {}).get("adapter") or {}
    it = float(ad.get("iterations") or 0.0)
    return min(float(ad.get("fallback_deadline") or 0.0) / it, 0.5) if it > 0 else 0.0


def _policy(c: Config) -> tuple[str, dict[str, str]]:
    return ("vllm-fcfs", {}) if c.mode == "native" else (c.policy, dict(c.params))


def simulate_run(spec: LiveSpec, c: Config, rate: float, seed: int, truth: FittedTruth,
                 frontend: Frontend | None = None, late: float = 0.0) -> dict[str, Any]:
    """One live run replayed in the simulator (with ``frontend``: the client's recorded
    delays added back; ``late``: that share of the decisions answered late)."""
    reqs = make_requests(spec.workload, rate, seed)
    n = len(reqs)
    slo = spec.slo
    sent_late = np.zeros(n)
    if frontend is not None and len(frontend.late_s) == n:
        sent_late = np.maximum(frontend.late_s, 0.0)
    at = np.array([r.at_s for r in reqs]) + sent_late
    order = np.argsort(at, kind="stable")  # the engine takes requests in the order they came
    row = np.empty(n, np.int64)
    row[order] = np.arange(n)  # request index -> the engine's row
    w = Workload(arrival=at[order],
                 prompt_tokens=np.array([len(reqs[i].prompt) for i in order], np.int64),
                 output_tokens=np.array([reqs[i].output_len for i in order], np.int64),
                 ttft_slo=np.full(n, slo.ttft_ms / 1e3), tbt_slo=np.full(n, slo.tbt_ms / 1e3),
                 protected=np.zeros(n, bool), name=f"live-{rate:g}-{seed}",
                 tpot_slo=np.full(n, slo.tbt_ms / 1e3) if c.objective == "tpot" else None)
    eng, fallbacks = _replay(spec, c, w, truth, seed, late)
    assert eng.token_times is not None
    measured = [r for r in reqs if not r.warmup]
    firsts = np.array([eng.token_times[row[r.index]][0] for r in measured if eng.token_times[row[r.index]]])
    base = frontend.base_s(firsts) if frontend is not None else 0.0
    results = []
    for r in measured:
        j = int(row[r.index])
        res = RequestResult(r.index, float(w.arrival[j]), r.output_len)
        times = np.asarray(eng.token_times[j])
        if eng.done[j] and not eng.rejected[j] and len(times):
            res.token_times = (frontend.read_at(times) + base if frontend is not None else times).tolist()
        else:
            res.error = "not finished in the simulation"
        results.append(res)
    return {"config": c.label, "mode": c.mode, "policy": _policy(c)[0], "rate": rate, "seed": seed,
            **summarize(results, slo).to_dict(), "source": "sim" if frontend is None else "sim+client",
            "itl_mean_ms": itl_mean_ms(eng.token_times),
            "prefill_mean_ms": prefill_mean_ms(eng),
            "speed": truth.scale, "prefill_speed": truth.prefill_scale, "noise_sigma": truth.noise_sigma,
            "late_share": late, "fallbacks": fallbacks}


def itl_mean_ms(token_times: Sequence[Sequence[float]]) -> float:
    """The mean time between a request's successive tokens, over every token after each
    request's first (how vLLM's ``inter_token_latency_seconds`` counts), in ms."""
    gaps = [np.diff(t) for t in token_times if len(t) > 1]
    return 1e3 * float(np.mean(np.concatenate(gaps))) if gaps else math.nan


def match_speed(run: Callable[[FittedTruth], dict[str, Any]], truth: FittedTruth, live_itl_ms: float,
                tol: float = 0.03, steps: int = 8, first: dict[str, Any] | None = None) -> dict[str, Any]:
    """The replay ``run`` at the speed under which its mean inter-token latency is the live
    run's ``live_itl_ms`` (within ``tol``, relative), else the closest of ``steps`` tries;
    ``first``: ``run(truth)`` where the caller has it already (the first try).

    The inter-token latency grows with the factor, and faster than it near saturation
    (queues grow), so the search is on the logarithms: secant steps, kept inside the
    bracket once one try is above the target and one below, bisecting when a step would
    leave it."""
    if not (math.isfinite(live_itl_ms) and live_itl_ms > 0):
        raise ValueError(f"live_itl_ms must be a positive number, got {live_itl_ms}")
    target = math.log(live_itl_ms)
    tries: list[tuple[float, float, dict[str, Any]]] = []  # (log factor, log itl - target, record)
    x = math.log(truth.scale)
    for step in range(steps):
        rec = first if step == 0 and first is not None else run(truth.scaled(math.exp(x)))
        itl = rec["itl_mean_ms"]
        if not (math.isfinite(itl) and itl > 0):
            break
        tries.append((x, math.log(itl) - target, rec))
        if abs(tries[-1][1]) <= math.log1p(tol):
            break
        x = _next_factor(tries)
    if not tries:
        raise ValueError("the replay has no inter-token latency to match (no request had two tokens)")
    return min(tries, key=lambda t: abs(t[1]))[2]


def match_pace(run: Callable[[FittedTruth], dict[str, Any]], truth: FittedTruth, live_itl_ms: float,
               live_prefill_ms: float, tol: float = 0.03, steps: int = 10,
               first: dict[str, Any] | None = None) -> dict[str, Any]:
    """The replay ``run`` at the two factors (``scale`` on every iteration, ``prefill_scale``
    more on those that carry a prefill chunk) under which its mean inter-token latency and
    its mean prefill time are the live run's (both within ``tol``, relative), else the
    closest of ``steps`` tries (by the larger of the two errors).

    Both times grow with both factors, the inter-token latency mostly with the first and
    the prefill time mostly with the second, so the search is a Broyden (quasi-Newton)
    iteration on the logarithms from that guess of the slopes, at most a factor of 2 per
    step.  Meant for vLLM's own scheduler, where the prefill time is the engine's pace: a
    policy that holds chunks back adds its own waits to it."""
    targets = np.array([live_itl_ms, live_prefill_ms], dtype=np.float64)
    if not (np.isfinite(targets).all() and (targets > 0).all()):
        raise ValueError(f"live_itl_ms and live_prefill_ms must be positive numbers, got {live_itl_ms}, "
                         f"{live_prefill_ms}")
    goal = np.log(targets)
    x = np.log([truth.scale, truth.prefill_scale])
    jac = np.array([[2.0, 0.5], [0.5, 1.0]])  # d log(itl, prefill) / d log(scale, prefill_scale), first guess
    best: tuple[float, dict[str, Any]] | None = None
    prev: tuple[np.ndarray, np.ndarray] | None = None
    for step in range(steps):
        rec = first if step == 0 and first is not None else run(truth.scaled(*np.exp(x).tolist()))
        got = np.array([rec["itl_mean_ms"], rec.get("prefill_mean_ms", math.nan)], dtype=np.float64)
        if not (np.isfinite(got).all() and (got > 0).all()):
            break
        err = np.log(got) - goal
        if best is None or np.abs(err).max() < best[0]:
            best = (float(np.abs(err).max()), rec)
        if np.abs(err).max() <= math.log1p(tol):
            break
        if prev is not None:
            dx, de = x - prev[0], err - prev[1]
            if dx @ dx > 1e-12:
                jac = jac + np.outer(de - jac @ dx, dx) / (dx @ dx)
        try:
            move = -np.linalg.solve(jac, err)
        except np.linalg.LinAlgError:
            move = -err / np.array([2.0, 1.0])
        if not np.isfinite(move).all():
            move = -err / np.array([2.0, 1.0])
        prev = (x, err)
        x = x + np.clip(move, -math.log(2), math.log(2))
    if best is None:
        raise ValueError("the replay has no inter-token latency or prefill time to match")
    return best[1]


def _next_factor(tries: Sequence[tuple[float, float, Any]]) -> float:
    """The next log factor to try (see :func:`match_speed`)."""
    below = [t for t in tries if t[1] < 0]
    above = [t for t in tries if t[1] > 0]
    if below and above:
        (x0, e0, _), (x1, e1, _) = max(below, key=lambda t: t[0]), min(above, key=lambda t: t[0])
        lo, hi = min(x0, x1), max(x0, x1)
        x = x0 - e0 * (x1 - x0) / (e1 - e0) if e1 != e0 else (lo + hi) / 2
        inside = lo + 0.1 * (hi - lo) < x < hi - 0.1 * (hi - lo)
        return x if inside else (lo + hi) / 2
    (x1, e1, _) = tries[-1]
    slope = 2.0  # a first guess: near saturation the latency grows about twice as fast as the factor
    if len(tries) > 1:
        (x0, e0, _) = tries[-2]
        if x1 != x0 and (e1 - e0) / (x1 - x0) > 0.5:
            slope = (e1 - e0) / (x1 - x0)
    return x1 - max(-math.log(2), min(math.log(2), e1 / slope))  # at most a factor of 2 per step


def _replay(spec: LiveSpec, c: Config, w: Workload, truth: FittedTruth, seed: int, late: float
            ) -> tuple[SimulatedEngine, dict[str, int]]:
    """``w`` through the simulated engine under ``c``'s policy, from the bundled predictor
    (``late``: that share of its decisions answered late); the engine, and its decisions
    and fallbacks by reason."""
    policy, params = _policy(c)
    eng, adapter = replay_engine(w, truth, policy, params, default_predictor(), seed=seed, late=late,
                                 max_batch_tokens=spec.engine.max_num_batched_tokens,
                                 max_num_seqs=spec.engine.max_num_seqs, shed_after=c.shed_after)
    return eng, {"decisions": adapter.remote_decisions + adapter.fallback_total,
                 **{k: int(v) for k, v in adapter.fallbacks.items() if v}}


def replay_engine(w: Workload, truth: FittedTruth, policy: str, params: Mapping[str, str],
                  predictor: BatchLatencyPredictor, *, seed: int, max_batch_tokens: int, max_num_seqs: int,
                  late: float = 0.0, shed_after: float = 0.0) -> tuple[SimulatedEngine, AdapterCore]:
    """``w`` through the simulated engine on ``truth`` (every token's time kept), ``policy``
    planning in process from ``predictor`` and refitting inline (``late``: that share of its
    decisions answered late); the engine after the run, and its closed adapter core."""
    settings = AdapterSettings(policy=policy, params=params, profile=DEFAULT_PROFILE, report_inline=True,
                               shed_after=shed_after)
    backend = InProcessBackend(settings, predictor)
    adapter = AdapterCore(LateAnswers(backend, late, seed) if late else backend, settings,  # type: ignore[arg-type]
                          predictor)
    profile = dataclasses.replace(PROFILES[DEFAULT_PROFILE], key="live-sim")
    cfg = EngineConfig(max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs, noise_seed=seed,
                       keep_token_times=True)
    try:
        eng = SimulatedEngine(w, truth, profile, adapter, cfg)  # type: ignore[arg-type]
        eng.run()
    finally:
        adapter.close()
    return eng, adapter


def prefill_mean_ms(eng: SimulatedEngine) -> float:
    """vLLM's prefill time, engine-side: from a request's first scheduling to its first
    token, the mean over the requests that got one (ms)."""
    started = ~np.isnan(eng.first_token)
    prefill = eng.first_token[started] - eng.first_scheduled[started]
    return 1e3 * float(np.mean(prefill)) if len(prefill) else math.nan


def simulate_sweep(spec: LiveSpec, predictor: BatchLatencyPredictor, noise_sigma: float,
                   configs: Sequence[Config] | None = None,
                   progress: Callable[[int, int, str], None] | None = None,
                   live_dir: Path | None = None,
                   live: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every run of ``spec`` replayed (``configs``: only those); with ``live_dir``, each run
    whose client delays were recorded there is replayed a second time with them added
    (``source: "sim+client"``); with the ``live`` records, each run whose vLLM inter-token
    latency they hold is replayed once more at that run's speed (``source: "sim+speed"``,
    with the client's delays where recorded and, remote, its late answers;
    :func:`match_speed`, :class:`LateAnswers`), once more at its pace (``source:
    "sim+pace"``, :func:`_native_pace`) and, for the adapter's configurations, once more at
    vLLM's own run's pace with its client's delays (``source: "sim+vllm"``)."""
    from clients.bench.runner import quiet_logs

    quiet_logs()  # one refit log line per few hundred iterations otherwise
    truth = FittedTruth(predictor, noise_sigma)
    runs = {(r["config"], float(r["rate"]), int(r["seed"])): r for r in live}
    todo = [(rate, seed, c) for rate, seed, c in spec.order() if configs is None or c in configs]
    paces: dict[tuple[float, int], tuple[float, float, Frontend | None] | None] = {}  # (rate, seed) -> _native_pace
    out = []
    for i, (rate, seed, c) in enumerate(todo, 1):
        out.append(simulate_run(spec, c, rate, seed, truth))
        fe = Frontend.load(frontend_path(live_dir, c.label, rate, seed)) if live_dir is not None else None
        if fe is not None:
            out.append(simulate_run(spec, c, rate, seed, truth, fe))
        run = runs.get((c.label, float(rate), int(seed)))
        live_itl = ((run or {}).get("vllm_timings") or {}).get("itl_mean_ms")
        if live_itl:
            late = late_share(run) if c.mode == "remote" else 0.0
            rec = match_speed(lambda t, c=c, rate=rate, seed=seed, fe=fe, late=late:
                              simulate_run(spec, c, rate, seed, t, fe, late), truth, float(live_itl),
                              first=None if late else out[-1])  # the replay just made, at the fitted speed
            out.append({**rec, "source": "sim+speed", "live_itl_mean_ms": float(live_itl)})
            if (rate, seed) not in paces:
                paces[(rate, seed)] = _native_pace(spec, rate, seed, truth, runs, live_dir)
            pace = paces[(rate, seed)]
            if pace is not None:
                rec = match_speed(lambda t, c=c, rate=rate, seed=seed, fe=fe, late=late:
                                  simulate_run(spec, c, rate, seed, t, fe, late),
                                  truth.scaled(rec["speed"], pace[1]), float(live_itl))
                out.append({**rec, "source": "sim+pace", "live_itl_mean_ms": float(live_itl)})
                if c.mode != "native":  # predicted from vLLM's run alone: its pace and its client's delays
                    out.append({**simulate_run(spec, c, rate, seed, truth.scaled(pace[0], pace[1]), pace[2], late),
                                "source": "sim+vllm"})
        if progress is not None:
            progress(i, len(todo), f"{c.label} at {rate:g} req/s, seed {seed} (simulated)")
    return out


def _native_pace(spec: LiveSpec, rate: float, seed: int, truth: FittedTruth,
                 runs: dict[tuple[str, float, int], dict[str, Any]], live_dir: Path | None
                 ) -> tuple[float, float, Frontend | None] | None:
    """The two factors (every iteration; more on those that carry prefill chunks) that make
    the replay of vLLM's own scheduler at ``rate`` and ``seed`` match both its mean
    inter-token latency and its mean prefill time (:func:`match_pace`), and that run's
    client delays where recorded; None without such a run.  The second is the engine's shape that day at
    that load, read where the prefill time is the engine's pace alone: every
    configuration's run at that rate and seed is replayed with it (``sim+pace``, at its own
    speed), and with both (``sim+vllm``: predicted from vLLM's run alone)."""
    for c in (c for c in spec.configs if c.mode == "native"):
        timings = (runs.get((c.label, float(rate), int(seed))) or {}).get("vllm_timings") or {}
        itl, pre = timings.get("itl_mean_ms"), timings.get("prefill_mean_ms")
        if itl and pre:
            fe = Frontend.load(frontend_path(live_dir, c.label, rate, seed)) if live_dir is not None else None
            rec = match_pace(lambda t, c=c, fe=fe: simulate_run(spec, c, rate, seed, t, fe), truth,
                             float(itl), float(pre))
            return float(rec["speed"]), float(rec["prefill_speed"]), fe
    return None
