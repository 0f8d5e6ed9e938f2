"""PNG figures of a bench run (matplotlib, Agg backend: no display needed).

* ``slo_attainment.png``  SLO attainment vs rate per policy from every probe
  of every search (hollow ▽: the probe stopped once 1% had violated, so all
  that is known is attainment < 99%), plus fixed-rate runs to completion;
* ``latency_cdf.png``     TTFT and TBT CDFs per policy at the common reference rate;
* ``goodput.png``         goodput bars (mean over seeds) with min–max whiskers;
  ``window.png``, ``ablation.png`` and ``margin.png`` the same for those experiments;
* ``classes.png``       SLO attainment per class and weighted goodput vs load per policy;
* ``reasons.png``       per policy, a stacked bar of the share of the violated (left) and
  met (right) requests' waiting time spent in each reason code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["pyplot", "write_plots"]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), imported on first use:
    matplotlib is slow to import and only the plots need it (ImportError without it: the
    plots are skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: list[str]) -> dict[str, Any]:
    plt = pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def _attainment(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = [r["policy"] for r in res.get("goodput", [])]
    colors = _colors(names)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name in names:
        probes = [p for s in res.get("searches", []) if s["policy"] == name for p in s["probes"]]
        if not probes:
            continue
        probes.sort(key=lambda p: p["rate"])
        c = colors[name]
        full = [p for p in probes if not p["stopped_early"]]
        early = [p for p in probes if p["stopped_early"]]
        ax.scatter([p["rate"] for p in full], [100 * (1 - p["violation_rate"]) for p in full], color=c,
                   s=22, label=name)
        # A stopped probe only knows that more than the target violated: plot the bound.
        ax.scatter([p["rate"] for p in early], [100 * (1 - res["target_violation"])] * len(early),
                   marker="v", facecolors="none", edgecolors=c, s=26)
        runs = [r for r in res.get("runs", []) if r["policy"] == name and r["experiment"] != "burst"]
        if runs:
            ax.scatter([r["rate_rps"] for r in runs], [100 * r["slo_attainment"] for r in runs], color=c,
                       marker="^", s=26)
        g = next(r["goodput_rps"] for r in res["goodput"] if r["policy"] == name)
        ax.axvline(g, color=c, lw=0.8, ls=":")
    ax.axhline(100 * (1 - res["target_violation"]), color="k", lw=0.8, ls="--")
    ax.set_xlabel("Poisson arrival rate (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    lo = min([100 * (1 - p["violation_rate"]) for s in res.get("searches", []) for p in s["probes"]
              if not p["stopped_early"]]
             + [100 * r["slo_attainment"] for r in res.get("runs", []) if r["experiment"] != "burst"] + [95])
    ax.set_ylim(max(0.0, lo - 2), 100.5)
    ax.set_title("SLO attainment vs rate", fontsize=10)
    fig.text(0.01, 0.01, "●: probes run to the end   ▽ hollow: probe stopped once "
             f"{res['target_violation']:.0%} had violated (attainment below the line)   "
             "▲: fixed-rate runs to the end   dotted: goodput", fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cdfs(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    samples = res["latency_samples"]
    colors = _colors(list(samples))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in samples.items():
        for ax, key in zip(axes, ("ttft_s", "tbt_s"), strict=True):
            x = np.sort(np.asarray(s[key], dtype=np.float64))
            if len(x):
                ax.plot(x * 1e3, np.arange(1, len(x) + 1) / len(x), color=colors[name], label=name)
    rate = res["reference"]["rate_rps"]
    axes[0].set_xscale("log")
    axes[0].set_xlabel("TTFT (ms, log)")
    axes[1].set_xlabel("TBT (ms; axis cut at the 99.9th percentile)")
    top = [np.percentile(s["tbt_s"], 99.9) for s in samples.values() if len(s["tbt_s"])]
    if top:
        axes[1].set_xlim(0, 1.1e3 * max(top))
    tbt_slo = res.get("slo", {}).get("tbt_s")
    if tbt_slo:
        axes[1].axvline(tbt_slo * 1e3, color="k", lw=0.8, ls="--")
    for ax in axes:
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Latency CDFs at {rate:.2f} req/s ({res['reference']['basis']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    plt = pyplot()
    names = [r["policy"] for r in rows]
    mean = np.array([r["goodput_rps"] for r in rows])
    lo = mean - np.array([r["goodput_rps_min"] for r in rows])
    hi = np.array([r["goodput_rps_max"] for r in rows]) - mean
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows) + 1), 4))
    colors = list(_colors(names).values())
    ax.bar(range(len(rows)), mean, yerr=np.vstack([lo, hi]), capsize=4, color=colors)
    pad = 0.01 * float(max(mean.max() + hi.max(), 1e-9))
    for i, m in enumerate(mean):
        ax.text(i, m + hi[i] + pad, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("goodput (requests/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _classes(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    c = res["classes"]
    names = [r["policy"] for r in c["rows"]]
    colors = _colors(names)
    panels = [*c["classes"], "weighted goodput"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), sharex=True)
    for ax, panel in zip(axes, panels, strict=True):
        for r in c["rows"]:
            fs = [f for f in c["factors"] if f"{f:g}x" in r]
            if panel == "weighted goodput":
                ys = [r[f"{f:g}x"]["weighted_goodput_rps"] for f in fs]
            else:
                ys = [100 * r[f"{f:g}x"]["classes"][panel]["attainment"] for f in fs]
            ax.plot(fs, ys, marker="o", color=colors[r["policy"]], label=r["policy"])
        ax.set_title(panel if panel == "weighted goodput" else f"{panel}: SLO attainment (%)", fontsize=9)
        ax.set_xlabel("load (x reference rate)")
        ax.grid(alpha=0.3)
    axes[-1].set_ylabel("weighted goodput (rps)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Request classes ({c['mix']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _reasons(res: dict[str, Any], title: str, path: Path) -> None:
    from scheduler_service.core.plan import CODES

    plt = pyplot()
    rows = res["reasons"]["rows"]
    codes = [c for c in CODES if any(c in r[g]["share"] for r in rows for g in ("violated", "met"))]
    cmap = plt.get_cmap("tab20")
    colors = {c: cmap(k % 20) for k, c in enumerate(codes)}
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.4 * len(rows) + 3), 4.4), sharey=True)
    for ax, g in zip(axes, ("violated", "met"), strict=True):
        bottom = np.zeros(len(rows))
        for c in codes:
            h = np.array([100 * r[g]["share"].get(c, 0.0) for r in rows])
            ax.bar(range(len(rows)), h, bottom=bottom, color=colors[c], label=c)
            bottom += h
        ax.set_xticks(range(len(rows)), [f"{r['policy']}\n({r[g]['requests']})" for r in rows], fontsize=8)
        ax.set_title(f"{g} requests (count)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("share of waiting time (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every figure the results support; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    s = res["settings"]
    where = f"{s['workload']}, {s['profile']}, {s['n_requests']} requests, {s['seeds']} seeds"
    written = []
    if res.get("goodput"):
        _attainment(res, out_dir / "slo_attainment.png")
        written.append(out_dir / "slo_attainment.png")
        _bars(res["goodput"], f"Goodput (mean, min-max over seeds) — {where}", out_dir / "goodput.png")
        written.append(out_dir / "goodput.png")
    if res.get("latency_samples"):
        _cdfs(res, out_dir / "latency_cdf.png")
        written.append(out_dir / "latency_cdf.png")
    for key, title in (("window", "SlidingChunker window k"), ("ablation", "Ablation (Table 4)"),
                       ("margin", "SlidingServe margin")):
        if res.get(key):
            _bars(res[key], f"{title} — {where}", out_dir / f"{key}.png")
            written.append(out_dir / f"{key}.png")
    if res.get("classes", {}).get("rows"):
        _classes(res, out_dir / "classes.png")
        written.append(out_dir / "classes.png")
    if res.get("reasons", {}).get("rows"):
        _reasons(res, f"Why requests waited, by reason — {where}", out_dir / "reasons.png")
        written.append(out_dir / "reasons.png")
    return written
