"""Terminal tables and result files of a bench run.

Files (``--out DIR``):

* ``goodput.json``  everything except raw latency samples; its ``"goodput"``
  list holds one object per policy with ``policy, workload, profile,
  goodput_rps`` (mean over seeds), ``goodput_rps_by_seed``, std, min, max;
  ``"window"`` and ``"ablation"`` lists have the same shape;
* ``goodput.csv``   those rows flat, with an ``experiment`` column;
* ``probes.csv``    every probe of every search (rate, violation rate, passed…);
* ``runs.csv``      every fixed-rate run (reference, overload, burst, load, classes);
* ``latency_samples.json``  TTFT/TBT order statistics at the reference rate.

NaN (a percentile of no samples) is written as JSON ``null``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scheduler_service.core.plan import CODES

from .reasons import GROUPS
from .runner import OURS

__all__ = ["format_report", "reasons_table", "write_outputs"]

#: Columns of goodput.csv, probes.csv and runs.csv.
GOODPUT_COLUMNS = ["experiment", "policy", "base_policy", "params", "workload", "profile", "transport",
                   "n_requests", "goodput_rps", "goodput_rps_std", "goodput_rps_min", "goodput_rps_max",
                   "goodput_rps_by_seed", "converged", "tolerance", "probes", "fallback_decisions"]
PROBE_COLUMNS = ["policy", "seed", "step", "rate", "violation_rate", "passed", "stopped_early", "iterations",
                 "wall_s", "fallback_decisions"]
RUN_COLUMNS = ["experiment", "policy", "params", "seed", "rate_rps", "requests", "completed",
               "violation_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_max_s", "tbt_p50_s",
               "tbt_p90_s", "tbt_p99_s", "throughput_rps", "preemptions", "iterations", "decision_us_p50",
               "decision_us_p99", "fallback_decisions", "rejected", "weighted_goodput_rps", "wall_s"]


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the others right-aligned."""
    rows = list(rows)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        padded = (c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded)

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def goodput_table(rows: list[dict[str, Any]]) -> str:
    ours = next((r for r in rows if r["policy"] == OURS), None)
    header = ["policy", "goodput rps", "per seed", "std", "min-max"]
    if ours is not None:
        header += [f"{OURS} vs it", "per-seed ratio mean (min)"]
    out = []
    for r in rows:
        cells = [
            r["policy"] + ("" if r["converged"] else " *"),
            f"{r['goodput_rps']:.3f}",
            " ".join(f"{x:.2f}" for x in r["goodput_rps_by_seed"]),
            f"{r['goodput_rps_std']:.3f}",
            f"{r['goodput_rps_min']:.2f}-{r['goodput_rps_max']:.2f}",
        ]
        if ours is not None:
            if r is ours:
                cells += ["", ""]
            elif r["goodput_rps"] > 0:
                cells.append(f"{100 * (ours['goodput_rps'] / r['goodput_rps'] - 1):+.1f}%")
                ratio = seed_ratios(ours, r)
                cells.append(f"{sum(ratio) / len(ratio):.3f} ({min(ratio):.3f})" if ratio else "n/a")
            else:
                cells += ["n/a", "n/a"]
        out.append(cells)
    return _table(header, out)


def seed_ratios(ours: dict[str, Any], other: dict[str, Any]) -> list[float]:
    """Goodput ratio ours / other seed by seed (same seed = same arrivals); seeds where
    the other policy passed at no rate are left out."""
    a = dict(zip(ours.get("seeds", []), ours["goodput_rps_by_seed"], strict=False))
    b = dict(zip(other.get("seeds", []), other["goodput_rps_by_seed"], strict=False))
    return [a[s] / b[s] for s in sorted(set(a) & set(b)) if b[s] > 0]


def _load_table(rows: list[dict[str, Any]]) -> str:
    factors = sorted({k for r in rows for k in r if k != "policy"}, key=lambda k: float(k[:-1]))
    header = ["policy"] + [f"{f} viol/1k" for f in factors] + [f"{f} preempt/1k" for f in factors]
    return _table(header, [[r["policy"]]
                           + [f"{r[f]['violations_per_1000']:.0f}" if f in r else "-" for f in factors]
                           + [f"{r[f]['preemptions_per_1000']:.0f}" if f in r else "-" for f in factors]
                           for r in rows])


def _classes_table(res: dict[str, Any]) -> str:
    c = res["classes"]
    names = c["classes"]
    header = ["policy", "load", *[f"{n} %" for n in names], "weighted rps", "rejected/1k"]
    return _table(header, [[r["policy"], f"{f:g}x ({cell['rate_rps']:.2f} rps)",
                            *[_pct(cell["classes"][n]["attainment"]) for n in names],
                            f"{cell['weighted_goodput_rps']:.2f}",
                            " ".join(f"{cell['classes'][n]['rejected_per_1000']:.0f}" for n in names)]
                           for r in c["rows"] for f in c["factors"]
                           if (cell := r.get(f"{f:g}x")) is not None])


def _runs_table(rows: list[dict[str, Any]]) -> str:
    header = ["policy", "rate rps", "violations", "per seed", "TTFT p50 ms", "TTFT p99 ms", "TTFT max ms",
              "TBT p99 ms", "preempt", "rejected"]
    return _table(header, [[
        r["policy"], f"{r['rate_rps']:.3f}", _pct(r["violation_rate"]),
        " ".join(_pct(x) for x in r["violation_rate_by_seed"]),
        _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), _ms(r.get("ttft_max_s")), _ms(r["tbt_p99_s"]),
        f"{r['preemptions']:.0f}", f"{r.get('rejected', 0):.0f}",
    ] for r in rows])


def reasons_table(rows: list[dict[str, Any]]) -> str:
    """Per reason code (rows) and policy (columns): the share of the violated requests'
    waiting time, and in parentheses the met requests'; then the requests and their mean
    seconds waiting."""
    codes = [c for c in CODES if any(c in r[g]["share"] for r in rows for g in GROUPS)]

    def cell(r: dict[str, Any], c: str) -> str:
        v, m = (r[g]["share"].get(c, 0.0) if r[g]["share"] else None for g in GROUPS)
        return f"{_pct(v)} ({_pct(m)})" if v or m else "-"  # "-": the group never waited

    body = [[c, *(cell(r, c) for r in rows)] for c in codes]
    body.append(["requests", *(f"{r['violated']['requests']} ({r['met']['requests']})" for r in rows)])
    body.append(["mean s waiting", *(f"{r['violated']['waited_s_mean']:.2f} ({r['met']['waited_s_mean']:.2f})"
                                      for r in rows)])
    return _table(["reason: violated (met)", *(r["policy"] for r in rows)], body)


def format_report(res: dict[str, Any]) -> str:
    """The human-readable summary printed on stdout."""
    s = res["settings"]
    parts = [
        f"workload {s['workload']}, profile {s['profile']}, transport {s['transport']}, "
        f"{s['n_requests']} requests, seeds {s['first_seed']}..{s['first_seed'] + s['seeds'] - 1}",
        f"goodput = highest Poisson rate with <= {res['target_violation']:.0%} SLO violations; "
        f"search tolerance {res['tolerance']:.0%} (the threshold lies within [goodput, goodput x "
        f"{1 + res['tolerance']:g}])",
    ]
    titles = {"goodput": "Goodput", "window": "SlidingChunker window k", "ablation": "Ablation (Table 4)",
              "margin": "Margin (predicted times count this many times over)"}
    for key, title in titles.items():
        if res.get(key):
            parts += ["", f"{title}:", goodput_table(res[key])]
            if not all(r["converged"] for r in res[key]):
                parts.append("  * search did not converge for some seed (see probes.csv)")
            if fb := sum(r["fallback_decisions"] for r in res[key]):
                parts.append(f"  note: {fb} decisions fell back to the local policy (see runs/probes)")
    if ref := res.get("reference"):
        parts += ["", f"Reference rate {ref['rate_rps']:.3f} rps = {ref['basis']}."]
        if ref.get("note"):
            parts.append(ref["note"])
    if res.get("at_reference"):
        parts += ["", "All policies at the reference rate (runs to completion):",
                  _runs_table(res["at_reference"])]
    if o := res.get("overload"):
        parts += ["", f"Overload: {o['note']}.", "own:", _runs_table(o["own"]), "common:",
                  _runs_table(o["common"])]
    if res.get("burst"):
        parts += ["", f"Burst: {res['burst']['note']}.", _runs_table(res["burst"]["rows"])]
    if res.get("load"):
        parts += ["", f"Load: {res['load']['note']}.", _load_table(res["load"]["rows"])]
    if res.get("classes"):
        parts += ["", f"Classes: {res['classes']['note']}; rejected/1k per class in the same order.",
                  _classes_table(res)]
    if res.get("reasons", {}).get("rows"):
        parts += ["", f"Why violated requests waited: {res['reasons']['note']}.",
                  reasons_table(res["reasons"]["rows"])]
    parts += ["", f"wall time {res['wall_s']:.1f} s"]
    return "\n".join(parts)


def _write_json(path: Path, data: Any, indent: int | None = None) -> Path:
    path.write_text(json.dumps(_clean(data), indent=indent) + "\n")
    return path


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in _clean(r).items()})
    return path


def write_outputs(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the JSON and CSV files; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {k: v for k, v in res.items() if k != "latency_samples"}
    body.setdefault("goodput", [])
    written = [_write_json(out_dir / "goodput.json", body, indent=2)]
    if res.get("latency_samples"):
        written.append(_write_json(out_dir / "latency_samples.json", res["latency_samples"]))
    rows = [r | {"experiment": exp} for exp in ("goodput", "window", "ablation", "margin")
            for r in res.get(exp, [])]
    written.append(_write_csv(out_dir / "goodput.csv", rows, GOODPUT_COLUMNS))
    probes = [{"policy": s["policy"], "seed": s["seed"], "step": i} | pr
              for s in res.get("searches", []) for i, pr in enumerate(s["probes"])]
    written.append(_write_csv(out_dir / "probes.csv", probes, PROBE_COLUMNS))
    if res.get("runs"):
        written.append(_write_csv(out_dir / "runs.csv", res["runs"], RUN_COLUMNS))
    return written
