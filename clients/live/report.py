"""Tables and plots of a live sweep (``runs.jsonl``): attainment per rate under both SLO
definitions, goodput per definition with its spread over seeds and its ratio to vLLM's own
scheduler taken seed by seed, latency percentiles, and the service's predictor error."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from clients.bench.plots import pyplot

from .measure import goodput

__all__ = ["aa_band", "aa_table", "capacity_note", "goodputs", "judge_table", "markdown", "noise_table",
           "shared_note", "sim_table", "timing_table", "verdicts", "write_plot", "write_sim_plot"]

Run = dict[str, Any]
DEFS = (("attain_f1", "formula (1)"), ("attain_tpot", "TTFT+TPOT"))
#: vLLM's own scheduler and its second run of the same seeds: the A/A pair
AA = ("vllm", "vllm-again")
#: the simulator's replays (``source`` in sim.jsonl): column name, plot line style
SIM_SOURCES = (("sim", "sim", "--"), ("sim+client", "+client", ":"), ("sim+speed", "+speed", "-."),
               ("sim+pace", "+pace", (0, (5, 1, 1, 1))), ("sim+vllm", "+vLLM's", (0, (1, 3))))


def _configs(runs: Iterable[Run]) -> list[str]:
    return list(dict.fromkeys(r["config"] for r in runs))


def _rates(runs: Iterable[Run]) -> list[float]:
    return sorted({float(r["rate"]) for r in runs})


def _at(runs: Iterable[Run], c: str, rate: float) -> list[Run]:
    return [r for r in runs if r["config"] == c and float(r["rate"]) == rate]


def _by(runs: Sequence[Run]) -> dict[tuple[str, float, int], Run]:
    """(config, rate, seed) -> run; the last run recorded wins."""
    return {(r["config"], float(r["rate"]), int(r["seed"])): r for r in runs}


def _table(intro: str, head: Sequence[str], rows: Iterable[Iterable[str]]) -> str:
    """A markdown table under its introduction, a blank line between them."""
    lines = ["| " + " | ".join(cells) + " |" for cells in [head, *rows]]
    return "\n".join([intro, "", lines[0], "|" + "---|" * len(head), *lines[1:]]) + "\n"


def _rate(rate: float, runs: Sequence[Run]) -> str:
    """A rate as a table heading, with its multiple of the day's capacity where measured."""
    load = next((r["load"] for r in runs if float(r["rate"]) == rate and "load" in r), None)
    return f"{rate:g} rps" + (f" ({load:g}×)" if load is not None else "")


def _spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Mean (min–max); "—" for none."""
    if not xs:
        return "—"
    return f"{fmt.format(float(np.mean(xs)))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def _mean_at(runs: Iterable[Run], c: str, rate: float, key: str) -> float:
    xs = [100 * r[key] for r in _at(runs, c, rate)]
    return float(np.mean(xs)) if xs else math.nan


def capacity_note(out: Path) -> str:
    """What the sweep's capacity search found (``out/capacity.json``); empty without one."""
    path = out / "capacity.json"
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    probes = ", ".join(f"{p['rate']:g} rps {100 * p['attain_tpot']:.0f}%" for p in doc["probes"])
    return (f"vLLM's capacity that day: **{doc['capacity_rps']:g} req/s**, the highest rate at which its "
            f"own scheduler met {doc['bar']:.0%} under {doc['definition']} (seed {doc['seed']}; probes: "
            f"{probes}). Rates below are multiples of it.\n")


def goodputs(runs: Sequence[Run], key: str, threshold: float) -> dict[str, dict[int, float]]:
    """config -> seed -> goodput (req/s) under attainment ``key``, over the rates that seed ran."""
    by = _by(runs)
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for c in _configs(runs):
        for seed in sorted({s for (cc, _, s) in by if cc == c}):
            rates = sorted(r for (cc, r, s) in by if cc == c and s == seed)
            out[c][seed] = goodput(rates, [by[(c, r, seed)][key] for r in rates], threshold)
    return out


def _ratio(mine: dict[int, float], base: dict[int, float]) -> str:
    """Mean (min–max) of the per-seed ratios where the baseline's goodput is not 0; the seeds
    where it is 0 and ours is not are counted apart ("∞ on k")."""
    seeds = [s for s in mine if s in base and base[s] > 0]
    inf = sum(1 for s in mine if s in base and base[s] == 0 and mine[s] > 0)
    if not seeds:
        return f"∞ on {inf}" if inf else "—"
    r = [mine[s] / base[s] for s in seeds]
    return f"{np.mean(r):.2f}× ({min(r):.2f}–{max(r):.2f})" + (f", ∞ on {inf}" if inf else "")


def _fallbacks(rs: Sequence[Run]) -> str:
    """Share of the adapter's iterations vLLM scheduled natively because the plan was late,
    failed or did not validate (idle steps aside)."""
    ad = [v["adapter"] for v in rs if v.get("adapter")]
    it = sum(a.get("iterations", 0.0) for a in ad)
    fb = sum(v for a in ad for k, v in a.items() if k.startswith("fallback_") and k != "fallback_empty_plan")
    return f"{fb / it:.1%}" if it else "—"


def markdown(runs: Sequence[Run], threshold: float, baseline: str = "vllm") -> str:
    """The report: attainment by rate, then goodput and tails by configuration."""
    configs, rates, runs_ = _configs(runs), _rates(runs), list(_by(runs).values())
    gp = {key: goodputs(runs, key, threshold) for key, _ in DEFS}

    def attainment(c: str, rate: float) -> str:
        rs = _at(runs_, c, rate)
        return " / ".join(_spread([100 * v[k] for v in rs], "{:.0f}") for k, _ in DEFS) if rs else "—"

    def goodput_row(c: str) -> list[str]:
        rs = [v for v in runs_ if v["config"] == c]
        cells = [c]
        for k, _ in DEFS:
            cells += [_spread(list(gp[k][c].values())), _ratio(gp[k][c], gp[k].get(baseline, {}))]
        med = {k: np.median([v[k] for v in rs]) for k in ("ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}
        return [*cells, f"{med['ttft_p99_ms'] / 1e3:.2f} / {max(v['ttft_max_ms'] for v in rs) / 1e3:.2f}",
                f"{med['tpot_p50_ms']:.1f} / {med['tpot_p99_ms']:.1f}", _fallbacks(rs)]

    return (_table("SLO attainment, formula (1) / TTFT+TPOT, mean over seeds (min–max):",
                   ["configuration", *(_rate(r, runs) for r in rates)],
                   ([c, *(attainment(c, rate) for rate in rates)] for c in configs)) + "\n"
            + _table(f"Goodput (highest rate with attainment ≥ {threshold:.0%}, req/s), mean (min–max) over "
                     f"seeds; ÷ {baseline} seed by seed; tails over every run:",
                     ["configuration", "goodput, formula (1)", f"÷ {baseline}", "goodput, TTFT+TPOT",
                      f"÷ {baseline}", "TTFT p99 / max (s)", "TPOT p50 / p99 (ms)", "fallbacks"],
                     map(goodput_row, configs)))


def aa_band(runs: Sequence[Run]) -> dict[float, dict[str, float]]:
    """rate -> the A/A band of each measure: the largest difference, over the seeds run twice,
    between vLLM's own scheduler's two runs of one seed (attainment in points under both
    definitions, TTFT p99 and maximum in s).  Rates without both runs are left out."""
    by = _by(runs)
    out: dict[float, dict[str, float]] = {}
    for rate in _rates(runs):
        pairs = [(by[(AA[0], rate, s)], by[(AA[1], rate, s)]) for (c, rr, s) in by
                 if c == AA[0] and rr == rate and (AA[1], rate, s) in by]
        if not pairs:
            continue
        out[rate] = {k: max(abs(a[k] - b[k]) * f for a, b in pairs)
                     for k, f in (("attain_f1", 100), ("attain_tpot", 100), ("ttft_p99_ms", 1e-3),
                                  ("ttft_max_ms", 1e-3))}
        out[rate]["seeds"] = len(pairs)
    return out


def verdicts(runs: Sequence[Run], config: str, rate: float, key: str,
             band: dict[float, dict[str, float]]) -> tuple[float, str] | None:
    """(mean difference from vLLM over the seeds (points; per seed, against the mean of its
    two runs where both exist), "ahead" / "behind" / "within noise" against the A/A band)."""
    by = _by(runs)
    diffs = []
    for (c, rr, s), v in by.items():
        base = [by[(n, rate, s)][key] for n in AA if (n, rate, s) in by]
        if c == config and rr == rate and base:
            diffs.append(100 * (v[key] - float(np.mean(base))))
    if not diffs or rate not in band:
        return None
    d = float(np.mean(diffs))
    return d, "within noise" if abs(d) <= band[rate][key] else ("ahead" if d > 0 else "behind")


def aa_table(runs: Sequence[Run]) -> str:
    """The A/A noise floor per rate and each configuration's difference from vLLM read
    against it; empty without runs of vLLM's scheduler twice on one seed."""
    band = aa_band(runs)
    if not band:
        return ""
    text = _table("The A/A noise floor: vLLM's own scheduler run twice on the same arrivals, the largest "
                  "difference between its two runs of one seed (attainment in points, formula (1) / "
                  "TTFT+TPOT; TTFT p99 / maximum in s):", ["rate", "seeds", "attainment", "TTFT p99 / max"],
                  ([_rate(rate, runs), f"{int(b['seeds'])}", f"{b['attain_f1']:.0f} / {b['attain_tpot']:.0f}",
                    f"{b['ttft_p99_ms']:.2f} / {b['ttft_max_ms']:.2f}"] for rate, b in band.items()))
    others = [c for c in _configs(runs) if c not in AA]
    if not others:
        return text

    def cell(c: str, rate: float) -> str:
        vs = [verdicts(runs, c, rate, k, band) for k, _ in DEFS]
        return " / ".join("—" if v is None else f"{v[0]:+.0f} ({v[1]})" for v in vs)

    return text + "\n" + _table(
        "Each configuration against vLLM (mean over seeds of its difference from vLLM's runs of the "
        "same seed, points), formula (1) / TTFT+TPOT: \"ahead\" and \"behind\" only outside the A/A band:",
        ["configuration", *(_rate(r, runs) for r in band)],
        ([c, *(cell(c, r) for r in band)] for c in others))


def shared_note(runs: Sequence[Run], limit: float) -> str:
    """A warning naming the runs that shared the machine (other processes kept more than
    ``limit`` cores busy before or during them); empty when every run had it alone."""
    shared = [r for r in runs if r.get("shared")
              or max(r.get("foreign_before") or 0.0, r.get("foreign_during") or 0.0) > limit]
    unknown = sum(1 for r in runs if "foreign_before" not in r)
    out = []
    if shared:
        names = ", ".join(f"{r['config']} {float(r['rate']):g} rps seed {r['seed']}" for r in shared[:12])
        more = f" and {len(shared) - 12} more" if len(shared) > 12 else ""
        out.append(f"**{len(shared)} of {len(runs)} runs shared the machine** (other processes kept more "
                   f"than {limit:g} cores busy): {names}{more}. Their figures are not comparable with quiet "
                   "runs.")
    if unknown:
        out.append(f"{unknown} runs predate the quiet check (no record of other processes' load).")
    return "\n".join(out) + "\n" if out else ""


def noise_table(runs: Sequence[Run]) -> str:
    """How the service's predictor held up on the engine's noise, remote configurations only:
    its error, the margin it learned, the share of iterations measured above the prediction
    and above prediction × margin, and what its refits did."""
    # remote runs only: a report of another run can reach the service after it ended
    rows = [r for r in runs if r.get("overrun_share") and r.get("mode") == "remote"]
    if not rows:
        return ""

    def row(c: str) -> list[str]:
        rs = [r for r in rows if r["config"] == c]
        mae = [r["service_mae_ms"] for r in rs if r.get("service_mae_ms") is not None]
        margins = [r["service_margin"] for r in rs if r.get("service_margin") is not None]
        refits: Counter[str] = Counter()
        for r in rs:
            refits.update(r.get("service_refits_run") or {})
        return [c, f"{len(rs)}", _spread(mae, "{:.1f}"), _spread(margins),
                *(_spread([100 * r["overrun_share"][k] for r in rs], "{:.0f}%") for k in ("none", "learned")),
                ", ".join(f"{int(v)} {k}" for k, v in refits.items()) or "—"]

    return _table("The service's predictor on this engine's noise (remote runs; reports of every iteration): "
                  "mean absolute error, the learned margin at the end of the runs, the share of iterations "
                  "measured above the prediction and above prediction × margin (mean, min–max over runs), "
                  "and the refits:",
                  ["configuration", "runs", "MAE (ms)", "learned margin", "over prediction",
                   "over prediction × margin", "refits"], map(row, _configs(rows)))


def _path_mean(rs: Sequence[Run], path: str, fmt: str = "{:.0f}") -> str:
    """The mean of ``r[a][b]…`` (``path`` "a.b…") over the runs that have it, formatted; "—" for none."""
    xs = []
    for r in rs:
        v: Any = r
        for k in path.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            xs.append(float(v))
    return fmt.format(np.mean(xs)) if xs else "—"


def _per_rate(rows: Sequence[Run], cells: Callable[[Callable[..., str]], list[str]]) -> list[list[str]]:
    """A row per configuration and rate the runs have: its cells read the means over that
    group's runs through ``_path_mean`` bound to them."""
    return [[c, f"{rate:g}", *cells(partial(_path_mean, _at(rows, c, rate)))]
            for c in _configs(rows) for rate in _rates(r for r in rows if r["config"] == c)]


def timing_table(runs: Sequence[Run]) -> str:
    """Where a request's time goes, per configuration and rate (means over runs, ms): the
    client's TTFT beside vLLM's own (from its API server's arrival), vLLM's queueing and
    prefill time, its inter-token latency, and how late the client sent requests.  A client
    TTFT far above vLLM's is time outside the engine (client, HTTP, the API server)."""
    rows = [r for r in runs if r.get("vllm_timings")]
    if not rows:
        return ""
    return _table(
        "Where the time goes (means over runs, ms; every request of a run, warm-up included): the client's "
        "TTFT, vLLM's (its API server's arrival to first token), vLLM's queue and prefill time, its "
        "inter-token latency, how late the client sent requests (mean / max), the adapter's engine-thread "
        "time per iteration (snapshot, waiting for the plan, execution), how long the scheduler took to "
        "answer as the engine saw it (remote: the round trip; mean, and the share of answers over 20 ms) "
        "and, remote, the service's own time per decision:",
        ["configuration", "rate", "TTFT, client", "TTFT, vLLM", "queue", "prefill", "inter-token",
         "sent late", "adapter / iteration", "answer, engine-side", "service / decision"],
        _per_rate(rows, lambda m: [
            m("client.ttft_mean_ms"),
            *(m(f"vllm_timings.{k}_mean_ms") for k in ("ttft", "queue", "prefill", "itl")),
            f"{m('client.send_late_mean_ms')} / {m('client.send_late_max_ms')}",
            m("adapter.own_ms_per_iter", "{:.2f}"),
            f"{m('adapter.decision_ms_mean', '{:.2f}')} / {m('adapter.decision_over_20ms', '{:.1%}')}",
            m("service_decision_ms", "{:.2f}")])) + _cpu_table(rows)


def _cpu_table(runs: Sequence[Run]) -> str:
    """Where the CPU went during the runs that recorded it (``cpu``): how busy the worker's
    core and the others were, and the CPU seconds of each process per run."""
    rows = [r for r in runs if r.get("cpu")]
    if not rows:
        return ""
    return "\n" + _table(
        "Where the CPU went (means over runs): the share of the run's time the worker's core and the "
        "other cores were busy, and the CPU seconds per run of vLLM's API server, of its engine core (of "
        "which on the worker's core: the forward pass and the threads bound with it), of the scheduling "
        "service and of the client:",
        ["configuration", "rate", "worker core busy", "other cores busy", "API server",
         "engine core (on the worker's core)", "service", "client"],
        _per_rate(rows, lambda m: [
            m("cpu.worker_core_busy", "{:.0%}"), m("cpu.other_cores_busy", "{:.0%}"),
            m("cpu.api_server_s", "{:.1f} s"),
            f"{m('cpu.engine_s', '{:.1f} s')} ({m('cpu.engine_on_worker_s', '{:.1f} s')})",
            m("cpu.service_s", "{:.1f} s"), m("cpu.client_s", "{:.1f} s")]))


def judge_table(runs: Sequence[Run]) -> str:
    """Our measurement beside vLLM's own ``bench serve`` replaying the same requests at the
    same arrival times right after (TTFT+TPOT definition; good requests per second)."""
    rows = sorted((r for r in runs if r.get("judge")), key=lambda r: (r["config"], r["rate"], r["seed"]))
    if not rows:
        return ""
    return _table("Independent judge: vLLM's `bench serve --goodput` on the same requests and arrival times, "
                  "run right after ours (good req/s = requests within TTFT and TPOT / duration):",
                  ["configuration", "rate", "seed", "good req/s, ours / judge", "TTFT max (s), ours / judge",
                   "TPOT p50 (ms), ours / judge"],
                  ([r["config"], f"{r['rate']:g}", f"{r['seed']}",
                    f"{r['good_rps_tpot']:.2f} / {r['judge']['goodput']:.2f}",
                    f"{r['ttft_max_ms'] / 1e3:.2f} / {r['judge']['ttft_max_ms'] / 1e3:.2f}",
                    f"{r['tpot_p50_ms']:.1f} / {r['judge']['tpot_p50_ms']:.1f}"] for r in rows))


def sim_table(live: Sequence[Run], sim: Sequence[Run]) -> str:
    """Attainment live vs simulated on the live engine's fitted cost model, same requests,
    and (where the sweep recorded them) with the client's delays added back and at each
    run's own engine speed; gaps over 10 points marked."""
    if not sim:
        return ""
    rates = _rates(live)
    srcs = [(name, rs) for src, name, _ in SIM_SOURCES
            if (rs := [r for r in sim if r.get("source", "sim") == src])]

    def cells(c: str, rate: float) -> list[str]:
        lv = [_mean_at(live, c, rate, k) for k, _ in DEFS]
        out = [f"{lv[0]:.0f} / {lv[1]:.0f}"]
        for _, src in srcs:
            sv = [_mean_at(src, c, rate, k) for k, _ in DEFS]
            warn = " ⚠" if any(abs(a - b) > 10 for a, b in zip(lv, sv, strict=True)) else ""
            out.append("—" if any(math.isnan(x) for x in sv) else f"{sv[0]:.0f} / {sv[1]:.0f}{warn}")
        return out

    text = _table("Live vs simulated (the same requests on the live engine's fitted cost model; "
                  "\"+client\": with the client's recorded delays added back; \"+speed\": with them, at the "
                  "speed that gives the replay the live run's own mean inter-token latency; \"+pace\": as "
                  "+speed, with the iterations that carry prefill chunks slower or faster by the factor "
                  "under which vLLM's own run at that rate and seed also has its mean prefill time; "
                  "\"+vLLM's\": predicted from vLLM's run alone, at its two factors and with its client's "
                  "delays), mean over seeds, formula (1) / TTFT+TPOT; ⚠ marks a gap over 10 points from "
                  "live:",
                  ["configuration", *(h for r in rates for h in [f"{r:g} rps live", *(n for n, _ in srcs)])],
                  ([c, *(x for rate in rates for x in cells(c, rate))] for c in _configs(live)))
    noise = ", ".join(f"{x:g}" for x in sorted({float(r["noise_sigma"]) for r in sim if "noise_sigma" in r}))
    text += _speeds(sim)
    return text + (f"\nThe replays' iteration-time noise: lognormal σ {noise}.\n" if noise else "")


def _speeds(sim: Sequence[Run]) -> str:
    """How fast the engine ran, run by run, against the cost model fitted over the sweep."""
    fast = [r for r in sim if r.get("source") == "sim+speed"]
    if not fast:
        return ""
    parts = [f"{c} {_spread([float(r['speed']) for r in fast if r['config'] == c])}" for c in _configs(fast)]
    text = ("\nIteration time of each run's engine against the fitted cost model (the \"+speed\" factor), "
            "mean (min–max) over runs: " + "; ".join(parts) + ".\n")
    paced = {(float(r["rate"]), int(r["seed"])): float(r["prefill_speed"]) for r in sim
             if r.get("source") == "sim+pace" and r.get("mode") == "native"}
    if paced:
        by_rate = [f"{rate:g} rps {_spread([v for (rr, _), v in paced.items() if rr == rate])}"
                   for rate in sorted({k[0] for k in paced})]
        text += ("\nThe \"+pace\" factor on iterations that carry prefill chunks, fitted on vLLM's own run, "
                 "by rate, mean (min–max) over seeds: " + "; ".join(by_rate) + ".\n")
    return text


def write_plot(runs: Sequence[Run], path: Path, threshold: float, sim: Sequence[Run] = ()) -> Path | None:
    """attainment vs rate under both definitions, TTFT max vs rate, and the service's
    predictor error run by run (where remote runs reported it: no empty panel otherwise);
    None when matplotlib is missing."""
    try:
        plt = pyplot()
    except ImportError:
        return None
    rates, runs_ = _rates(runs), list(_by(runs).values())
    remote = sorted((v for v in runs if v.get("service_mae_ms") is not None), key=lambda v: v["time"])
    fig, axes = plt.subplots(1, 4 if remote else 3, figsize=(19 if remote else 14.5, 4.2))
    for c in _configs(runs):
        for ax, (key, title) in zip(axes[:2], DEFS, strict=True):
            _plot_attainment(ax, runs_, c, key, rates, sim)
            ax.set_title(f"SLO attainment, {title}")
        tmax = [max((v["ttft_max_ms"] / 1e3 for v in _at(runs_, c, r)), default=math.nan) for r in rates]
        axes[2].plot(rates, tmax, marker="o", label=c)
    _plot_aa_band(axes[:2], runs, runs_)
    cap = next((r["capacity_rps"] for r in runs if "capacity_rps" in r), None)
    xlabel = "request rate (req/s)" + (f"; vLLM's capacity {cap:g}" if cap else "")
    for ax in axes[:2]:
        ax.axhline(100 * threshold, color="grey", lw=0.8, ls="--")
        ax.set(xlabel=xlabel, ylabel="% of requests within SLO")
    axes[0].legend(fontsize=7)
    axes[2].set(title="TTFT maximum", xlabel=xlabel, ylabel="s")
    if remote:
        axes[3].plot(range(1, len(remote) + 1), [v["service_mae_ms"] for v in remote], marker=".")
        axes[3].set(title="service predictor: |predicted − measured|",
                    xlabel="run (in order; remote runs report)", ylabel="mean absolute error (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_attainment(ax: Any, runs: Sequence[Run], c: str, key: str, rates: list[float],
                     sim: Sequence[Run]) -> None:
    """One configuration's attainment under one definition (``runs``: one per configuration,
    rate and seed): mean and range over seeds, and the simulator's replays of it, dashed."""
    xs = [[100 * v[key] for v in _at(runs, c, rate)] for rate in rates]
    (line,) = ax.plot(rates, [np.mean(x) if x else math.nan for x in xs], marker="o", label=c)
    ax.fill_between(rates, [min(x, default=math.nan) for x in xs], [max(x, default=math.nan) for x in xs],
                    color=line.get_color(), alpha=0.15)
    for src, _, ls in SIM_SOURCES:
        mine = [r for r in sim if r.get("source", "sim") == src and r["config"] == c]
        if mine:
            ax.plot(rates, [_mean_at(mine, c, rate, key) for rate in rates], ls=ls, lw=1,
                    color=line.get_color(), label=f"{c} ({src})")


def _plot_aa_band(axes: Any, runs: Sequence[Run], runs_: Sequence[Run]) -> None:
    """vLLM's A/A band: its mean over both runs, ± the largest difference between them
    (``runs_``: one run per configuration, rate and seed)."""
    band = aa_band(runs)
    if not band:
        return
    br = sorted(band)
    aa = [v for v in runs_ if v["config"] in AA]
    for ax, (key, _) in zip(axes, DEFS, strict=True):
        mid = np.array([np.mean([100 * v[key] for v in aa if float(v["rate"]) == r]) for r in br])
        half = np.array([band[r][key] for r in br])
        ax.fill_between(br, mid - half, mid + half, color="black", alpha=0.12, label="vLLM A/A band")


def write_sim_plot(live: Sequence[Run], sim: Sequence[Run], path: Path) -> Path | None:
    """Sim-to-real run by run: each run's attainment live (x) against its replay's (y),
    one panel per definition and replay kind ("sim", "+client", "+speed", "+pace"), the ±10-point
    band shaded; None without matplotlib or replays."""
    srcs = [(src, name) for src, name, _ in SIM_SOURCES if any(r.get("source", "sim") == src for r in sim)]
    if not srcs:
        return None
    try:
        plt = pyplot()
    except ImportError:
        return None
    by = _by(live)
    fig, axes = plt.subplots(len(DEFS), len(srcs), figsize=(4.2 * len(srcs), 7.6), squeeze=False)
    for row, (key, title) in enumerate(DEFS):
        for col, (src, name) in enumerate(srcs):
            ax = axes[row][col]
            ax.fill_between([0, 100], [-10, 90], [10, 110], color="grey", alpha=0.15, lw=0)
            ax.plot([0, 100], [0, 100], color="grey", lw=0.8)
            for c in _configs(live):
                pts = [(100 * by[k][key], 100 * r[key]) for r in sim
                       if r.get("source", "sim") == src and r["config"] == c
                       and (k := (c, float(r["rate"]), int(r["seed"]))) in by]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    far = sum(abs(x - y) > 10 for x, y in pts)
                    ax.scatter(xs, ys, s=18, label=f"{c} ({far}/{len(pts)} off by > 10)")
            ax.set(xlim=(-3, 103), ylim=(-3, 103), xlabel="live (% within SLO)", ylabel=f"replayed, {name}",
                   title=f"{title}: {name}")
            ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
