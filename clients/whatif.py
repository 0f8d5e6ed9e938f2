"""``slidingserve whatif``: how other policies would have done on an engine's own traffic.

From a recording (:mod:`scheduler_service.recording`) alone:

1. **The engine's cost model.** A monotone batch-latency predictor fitted on the recorded
   iterations (:func:`~scheduler_service.core.predictor.fit_predictor`, the service's own
   refit), with the noise of the measured times around it (a lognormal σ).
2. **Its pace.** The served policy's replay at the recorded load is matched to what was
   recorded: the mean time between tokens (one factor on every iteration) and, when vLLM's
   own scheduler served, the mean prefill time too (a second factor on iterations that carry
   a prefill chunk; :func:`clients.live.sim.match_pace`).  A policy that holds chunks back
   adds its own waits to the prefill time, so under another policy only the first is read.
3. **The replays.** The recorded arrivals, prompt and output lengths, SLOs and classes go
   through the simulated engine (the engine's token budget and sequence limit) under the
   served policy, vLLM's own scheduler (``vllm-fcfs``) and every candidate, at the recorded
   load and at scaled ones (arrival times divided by the factor).  Each policy starts from
   the fitted cost model and refits online, as the service would.

Each row gives attainment under formula (1) and TTFT+TPOT, goodput (good requests per
second, TTFT+TPOT, what ``vllm bench serve --goodput`` reports), and TTFT p99 and maximum.
The served policy's replay at load 1 is also compared with what was recorded: the replay's
own error.  Prompts the engine found in its prefix cache are replayed whole (the simulated
engine has no prefix cache); the report says how many tokens that was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clients.errors import CliError
from engine_adapter.sim.engine import Workload
from scheduler_service.core import BatchLatencyPredictor, ValidationError, registry
from scheduler_service.core.predictor import fit_predictor
from scheduler_service.recording import NATIVE, Recording, RecordingError, policy_label, read_recording

from .live.sim import FittedTruth, itl_mean_ms, match_pace, match_speed, prefill_mean_ms, replay_engine

__all__ = ["MIN_ITERATIONS", "Candidate", "WhatIf", "fit_cost_model", "parse_candidates", "recorded_outcome",
           "run_whatif"]

#: Fewest recorded iterations a cost model is fitted on.
MIN_ITERATIONS = 200
#: Fewest finished requests a replay is worth running on.
MIN_REQUESTS = 20
#: The served policy's replay error (points) past which the table warns: the replay's own
#: error bounds the differences it can tell apart.
TRUSTED_ERROR = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """A policy to replay: its label in the table, registry name and parameters."""

    label: str
    policy: str
    params: dict[str, str]


def parse_candidates(text: str, deployments: dict[str, tuple[str, dict[str, str]]] | None = None) -> list[Candidate]:
    """``v2,slidingserve:margin=1.2,...``: deployment names (from ``deployments``) or registry
    policies with ``:k=v`` parameters.  ValueError (one line) for an unknown name or parameter."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, *kvs = item.split(":")
        if deployments and name in deployments:
            if kvs:
                raise ValueError(f"{item!r}: a deployment takes no parameters here; name a policy instead")
            pol, params = deployments[name]
            out.append(Candidate(name, pol, dict(params)))
            continue
        params = {}
        for kv in kvs:
            k, sep, v = kv.partition("=")
            if not sep or not k:
                raise ValueError(f"{item!r}: parameters are written name:key=value[:key=value]")
            params[k] = v
        try:
            registry.create(name, params or None)
        except ValidationError as e:
            known = f"; deployments: {', '.join(sorted(deployments))}" if deployments else ""
            raise ValueError(f"{item!r}: {e}{known}") from None
        out.append(Candidate(item, name, params))
    return out


def fit_cost_model(rec: Recording) -> tuple[BatchLatencyPredictor, float]:
    """The engine's cost model fitted on the recorded iterations, and the lognormal σ of the
    measured times around it.  RecordingError when too few were recorded."""
    n = len(rec.latency_ms)
    if n < MIN_ITERATIONS:
        raise RecordingError(f"the recording holds {n} iterations of engine {rec.engine!r}; fitting its cost model "
                             f"needs at least {MIN_ITERATIONS} (record longer, or check that the engine reports)")
    ok = np.isfinite(rec.latency_ms) & (rec.latency_ms > 0)
    pred = fit_predictor(rec.features[ok], rec.scenarios[ok], rec.latency_ms[ok],
                         meta={"source": "whatif fit", "engine": rec.engine})
    p = np.maximum(pred.predict_ms(rec.features[ok], rec.scenarios[ok]), 1e-3)
    resid = np.log(rec.latency_ms[ok] / p)
    sigma = float(np.clip(np.std(resid), 0.02, 1.0))
    return pred, sigma


# ---------------------------------------------------------------------- judging
def _judge(arrival: np.ndarray, first: np.ndarray, last: np.ndarray, n_out: np.ndarray, on_time: np.ndarray,
           ttft_slo: np.ndarray, tbt_slo: np.ndarray, tpot_slo: np.ndarray) -> dict[str, float]:
    """One run's figures from per-request outcomes (NaN first token: never served)."""
    served = np.isfinite(first) & (n_out >= 1)
    ttft = first - arrival
    tpot = np.where(n_out > 1, (last - first) / np.maximum(n_out - 1, 1), 0.0)
    tpot_obj = np.where(tpot_slo > 0, tpot_slo, tbt_slo)
    good = served & (ttft <= ttft_slo + 1e-9) & (tpot <= tpot_obj + 1e-9)
    start = float(np.min(arrival))
    end = float(np.nanmax(np.where(served, last, start))) if served.any() else start
    t = ttft[served] * 1e3
    gaps = (last - first)[served & (n_out > 1)].sum()
    return {"requests": len(arrival), "served": int(served.sum()),
            "attain_f1": float(np.mean(on_time & served)), "attain_tpot": float(np.mean(good)),
            "goodput_rps": float(good.sum() / max(end - start, 1e-9)),
            "ttft_p99_ms": float(np.percentile(t, 99)) if len(t) else math.nan,
            "ttft_max_ms": float(np.max(t)) if len(t) else math.nan,
            "itl_mean_ms": float(1e3 * gaps / max((n_out[served & (n_out > 1)] - 1).sum(), 1)),
            "prefill_mean_ms": math.nan}


def recorded_outcome(rec: Recording) -> dict[str, float]:
    """What the recording says happened, judged as the replays are."""
    r = rec.requests
    finished = r["finished"] > 0
    out = _judge(r["arrival"], np.where(finished, r["first_token"], np.nan), r["last_token"], r["output"],
                 finished & (r["late_s"] <= 1e-9), r["ttft_slo"], r["tbt_slo"], r["tpot_slo"])
    pre = (r["first_token"] - r["first_scheduled"])[finished]
    out["prefill_mean_ms"] = float(1e3 * np.nanmean(pre)) if np.isfinite(pre).any() else math.nan
    return out


# ---------------------------------------------------------------------- replays
def _workload(rec: Recording, load: float) -> tuple[Workload, np.ndarray]:
    """The recorded requests that reached the engine's queues and got an output length,
    arrivals scaled by ``load`` (and the mask of the recorded requests kept)."""
    r = rec.requests
    keep = (r["output"] >= 1) & (r["prompt"] >= 1)
    a = r["arrival"][keep]
    a = (a - a.min()) / load
    ints = {k: r[k][keep].astype(np.int64) for k in ("prompt", "output", "priority")}
    w = Workload(arrival=a, prompt_tokens=ints["prompt"], output_tokens=ints["output"],
                 ttft_slo=r["ttft_slo"][keep], tbt_slo=r["tbt_slo"][keep], protected=np.zeros(len(a), bool),
                 name=f"whatif-{load:g}", priority=ints["priority"], sheddable=r["sheddable"][keep] > 0,
                 e2e_slo=r["e2e_slo"][keep], tpot_slo=r["tpot_slo"][keep])
    return w, keep


def replay(rec: Recording, c: Candidate, load: float, truth: FittedTruth, start: BatchLatencyPredictor,
           seed: int = 0) -> dict[str, Any]:
    """``c`` on the recorded traffic at ``load`` times its rate, on ``truth``."""
    w, _ = _workload(rec, load)
    eng, _ = replay_engine(w, truth, c.policy, c.params, BatchLatencyPredictor.from_json(start.to_json()), seed=seed,
                           max_batch_tokens=int(rec.info.get("max_batch_tokens", 2048)),
                           max_num_seqs=int(rec.info.get("max_num_seqs", 256)))
    assert eng.token_times is not None
    tt = eng.token_times
    n = len(w)
    first = np.array([t[0] if t else np.nan for t in tt])
    last = np.array([t[-1] if t else np.nan for t in tt])
    n_out = np.array([len(t) for t in tt])
    done = np.asarray(eng.done, bool) & ~np.asarray(eng.rejected, bool) & (n_out >= w.output_tokens)
    on_time = np.array([bool(done[i]) and bool(np.all(
        np.asarray(tt[i]) <= w.arrival[i] + w.ttft_slo[i] + np.arange(len(tt[i])) * w.tbt_slo[i] + 1e-9))
        for i in range(n)])
    out = _judge(w.arrival, np.where(done, first, np.nan), last, n_out, on_time, w.ttft_slo, w.tbt_slo, w.tpot_slo)
    out.update(itl_mean_ms=itl_mean_ms(tt), prefill_mean_ms=prefill_mean_ms(eng), speed=truth.scale,
               prefill_speed=truth.prefill_scale)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class WhatIf:
    """A what-if's answer (see :func:`run_whatif`)."""

    engine: str
    served: str
    recorded: dict[str, float]
    #: the served policy replayed at load 1 minus what was recorded (attainment in points)
    error: dict[str, float]
    cost_model: dict[str, Any]
    rows: list[dict[str, Any]]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _key(c: Candidate) -> tuple[str, tuple[tuple[str, str], ...]]:
    return c.policy, tuple(sorted(c.params.items()))


def replayed(rec: Recording, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The policies a what-if replays: the served one first, vLLM's own, the candidates;
    each once."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], Candidate] = {}
    for c in (served_candidate(rec), Candidate("vllm-fcfs", "vllm-fcfs", {}), *candidates):
        out.setdefault(_key(c), c)
    return list(out.values())


def served_candidate(rec: Recording) -> Candidate:
    info = rec.info
    pol = str(info.get("policy") or "")
    params = dict(info.get("params") or {})
    if pol in ("", NATIVE):
        return Candidate(f"{NATIVE} (served)", "vllm-fcfs", {})
    return Candidate(f"{policy_label(pol, params)} (served)", pol, params)


def run_whatif(rec: Recording, candidates: Sequence[Candidate], loads: Sequence[float], *, seed: int = 0,
               progress: Callable[[str], None] | None = None) -> WhatIf:
    """Fit, match the pace, replay every policy at every load (see the module)."""
    n = int(((rec.requests["output"] >= 1) & (rec.requests["prompt"] >= 1)).sum())
    if n < MIN_REQUESTS:
        raise RecordingError(f"the recording holds {n} served requests of engine {rec.engine!r}; a replay needs "
                             f"at least {MIN_REQUESTS}")
    pred, sigma = fit_cost_model(rec)
    policies = replayed(rec, candidates)
    served = policies[0]
    recorded = recorded_outcome(rec)
    truth = FittedTruth(pred, sigma)
    tick = progress or (lambda _m: None)
    tick(f"pace: {served.label} at the recorded load")
    first = replay(rec, served, 1.0, truth, pred, seed)
    if served.policy == "vllm-fcfs" and math.isfinite(recorded["prefill_mean_ms"]) and recorded["prefill_mean_ms"] > 0:
        at_pace = match_pace(lambda t: replay(rec, served, 1.0, t, pred, seed), truth, recorded["itl_mean_ms"],
                             recorded["prefill_mean_ms"], first=first)
    else:
        at_pace = match_speed(lambda t: replay(rec, served, 1.0, t, pred, seed), truth, recorded["itl_mean_ms"],
                              first=first)
    truth = truth.scaled(at_pace["speed"], at_pace["prefill_speed"])
    rows = []
    for load in loads:
        for c in policies:
            tick(f"{c.label} at {load:g}x")
            row = at_pace if (c is served and load == 1.0) else replay(rec, c, load, truth, pred, seed)
            rows.append({"policy": c.label, "load": load, "rate_rps": recorded["requests"] / max(
                float(np.ptp(rec.requests["arrival"])), 1e-9) * load, **row})
    error = {k: 100 * (at_pace[k] - recorded[k]) for k in ("attain_f1", "attain_tpot")}
    error.update({k: at_pace[k] - recorded[k] for k in ("ttft_p99_ms", "itl_mean_ms")})
    cached = int(rec.requests["cached"].sum())
    notes = [f"{cached} prompt tokens were prefix-cache hits on the engine; the replays compute them"] if cached else []
    off = {k: v for k, v in (("formula (1)", error["attain_f1"]), ("TTFT+TPOT", error["attain_tpot"]))
           if abs(v) > TRUSTED_ERROR}
    if off:
        worst = max(abs(v) for v in off.values())
        notes.append(f"the replay of {served.label} misses what this engine recorded by "
                     + ", ".join(f"{v:+.1f} points under {k}" for k, v in off.items())
                     + f": read differences between policies smaller than {worst:.0f} points as noise")
    if len(rec.policies) > 1:
        mix = ", ".join(f"{k or '(unnamed)'}: {v}" for k, v in sorted(rec.policies.items()))
        notes.append(f"several policies served this traffic (requests: {mix}); it is replayed as {served.label}, "
                     "the last one")
    model = {"iterations": len(rec.latency_ms), "noise_sigma": sigma, "speed": at_pace["speed"],
             "prefill_speed": at_pace["prefill_speed"], "predictor": json.loads(pred.to_json())}
    return WhatIf(rec.engine, served.label, recorded, error, model, rows, notes)


# ---------------------------------------------------------------------- output
def format_table(w: WhatIf) -> str:
    head = (f"engine {w.engine or '(unnamed)'}: {w.recorded['requests']} requests, served by {w.served}; "
            f"cost model from {w.cost_model['iterations']} iterations (noise σ {w.cost_model['noise_sigma']:.2f}, "
            f"pace x{w.cost_model['speed']:.2f}, prefill x{w.cost_model['prefill_speed']:.2f})")
    r = w.recorded
    lines = [head, "",
             f"recorded:  formula (1) {100 * r['attain_f1']:.1f}%  TTFT+TPOT {100 * r['attain_tpot']:.1f}%  "
             f"goodput {r['goodput_rps']:.2f} rps  TTFT p99 {r['ttft_p99_ms']:.0f} ms  max {r['ttft_max_ms']:.0f} ms",
             f"replay error of the served policy at load 1: formula (1) {w.error['attain_f1']:+.1f} points, "
             f"TTFT+TPOT {w.error['attain_tpot']:+.1f} points", "",
             "| load | policy | formula (1) | TTFT+TPOT | goodput (rps) | TTFT p99 (ms) | TTFT max (ms) |",
             "|---|---|---|---|---|---|---|"]
    for row in w.rows:
        lines.append(f"| {row['load']:g}x ({row['rate_rps']:.2f} rps) | {row['policy']} | {100 * row['attain_f1']:.1f}% "
                     f"| {100 * row['attain_tpot']:.1f}% | {row['goodput_rps']:.2f} | {row['ttft_p99_ms']:.0f} "
                     f"| {row['ttft_max_ms']:.0f} |")
    lines += [f"note: {n}" for n in w.notes]
    return "\n".join(lines)


def write_plot(w: WhatIf, path: Path) -> Path | None:
    """Attainment against load, one line per policy, one panel per SLO definition."""
    try:
        from clients.bench.plots import pyplot

        plt = pyplot()
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in ((axes[0], "attain_f1", "formula (1)"), (axes[1], "attain_tpot", "TTFT+TPOT")):
        for pol in dict.fromkeys(r["policy"] for r in w.rows):
            rows = sorted((r for r in w.rows if r["policy"] == pol), key=lambda r: r["load"])
            ax.plot([r["load"] for r in rows], [100 * r[key] for r in rows], marker="o", label=pol)
        ax.axhline(100 * w.recorded[key], color="grey", ls=":", label="recorded")
        ax.set_title(title)
        ax.set_xlabel("load (x the recorded rate)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests within SLO (%)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"what-if on engine {w.engine or '(unnamed)'}'s recorded traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_loads(text: str) -> list[float]:
    try:
        loads = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--load {text!r}: give factors like 1,1.5,2") from None
    if not loads or any(not (0 < x <= 20) for x in loads):
        raise ValueError(f"--load {text!r}: each factor must be in (0, 20]")
    return sorted(set(loads))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recording", help="directory of a recording (record: DIR / SLIDINGSERVE_RECORD)")
    p.add_argument("--deployments", default="", help="policies to compare: deployment names (with --policy-config) "
                   "or registry policies with :key=value parameters, comma-separated")
    p.add_argument("--policy-config", default="", help="the service's policy config, to name its deployments")
    p.add_argument("--load", default="1,1.5", help="load factors on the recorded rate (default 1,1.5)")
    p.add_argument("--engine", default="", help="which engine's traffic (default: the one with most requests)")
    p.add_argument("--engine-prefix", default="", help=argparse.SUPPRESS)  # the service: its caller's tenant
    p.add_argument("--seed", type=int, default=0, help="seed of the replays' latency noise")
    p.add_argument("--out", default="", help="folder for whatif.json and whatif.png")
    p.add_argument("--json", action="store_true", help="print the answer as JSON instead of the table")


def _plain(x: Any) -> Any:
    return float(x) if isinstance(x, (np.floating, np.integer)) else str(x)


def deployments_of(path: str) -> dict[str, tuple[str, dict[str, str]]]:
    if not path:
        return {}
    from scheduler_service.server.deployments import PolicyConfig

    c = PolicyConfig.from_file(path)
    return {n: (d.policy, dict(d.params)) for n, d in c.deployments.items()}


def main(args: argparse.Namespace) -> int:
    """The CLI command; what it cannot use is a :class:`CliError` (one line, exit code 2)."""
    from clients.bench.progress import ProgressBar
    from clients.bench.runner import quiet_logs

    try:
        loads = parse_loads(args.load)
        candidates = parse_candidates(args.deployments, deployments_of(args.policy_config))
        rec = read_recording(args.recording, args.engine, prefix=args.engine_prefix)
        quiet_logs()
        bar = ProgressBar(1 + len(loads) * len(replayed(rec, candidates)), "whatif", stream=sys.stderr)
        w = run_whatif(rec, candidates, loads, seed=args.seed, progress=bar.advance)
    except (RecordingError, ValueError) as e:
        raise CliError(f"whatif: {e}") from None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "whatif.json").write_text(json.dumps(w.to_dict(), indent=1, default=_plain))
        write_plot(w, out / "whatif.png")
    table = format_table(w)
    print(json.dumps({**w.to_dict(), "table": table}, default=_plain) if args.json else table)
    return 0



def ask_server(args: argparse.Namespace) -> int:
    """``--server``: the service runs the what-if on its own recording (the WhatIf RPC)."""
    from scheduler_service.client import ClientSecurity, SchedulerClient

    try:
        loads = parse_loads(args.load)
    except ValueError as e:
        raise CliError(f"whatif: {e}") from None
    deployments = [d.strip() for d in args.deployments.split(",") if d.strip()]
    with SchedulerClient(args.server, timeout_s=args.timeout, security=ClientSecurity.from_env()) as client:
        doc = client.whatif(deployments, loads, args.engine)
    print(json.dumps(doc, default=_plain) if args.json else doc.get("table", ""))
    return 0
