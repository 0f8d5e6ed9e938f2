"""``slidingserve whatif`` against the live engine: each live run's recording predicts the
other policy's run on the same arrivals, and a lower rate's recordings predict the higher
rates' runs.

    make live-bench LIVE_ARGS="--configs 'observe inproc:slidingserve' --record --rates 1.5,2.5,3.5,4.5 \\
        --seeds 41-42 --judge-seeds 0 --out SWEEP"
    .venv/bin/python -m benchmarks.whatif_validation SWEEP [SWEEP ...] [--from-rate 2.5]

``observe`` is vLLM's own scheduler with the adapter recording; the live runs at one seed
share their arrivals and lengths (at another rate the arrival times are the same draws,
scaled), so a recording at rate r replayed at load f is the run at rate f·r.  For every run
and definition the table gives the what-if's prediction, the live run as its engine
recorded it (the what-if's own view: engine-side times, no HTTP or client) and as the
benchmark's client measured it, and the served policy's replay error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clients.whatif import Candidate, recorded_outcome, run_whatif
from scheduler_service.recording import read_recording

LABELS = {"observe": ("vllm", "vllm-fcfs"), "inproc:slidingserve": ("slidingserve", "slidingserve")}
DIRS = {"observe": "observe", "inproc:slidingserve": "inproc_slidingserve"}


def _runs(sweeps: list[Path]) -> dict[tuple[str, float, int], tuple[Path, dict[str, Any]]]:
    out = {}
    for sweep in sweeps:
        for line in (sweep / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            d = sweep / "recordings" / DIRS.get(r["config"], "-") / f"{r['rate']:g}-{r['seed']}"
            if r["config"] in LABELS and d.is_dir():
                out[(r["config"], float(r["rate"]), int(r["seed"]))] = (d, r)
    return out


def _predict(rec_dir: Path, target: str, load: float) -> tuple[dict[str, Any], dict[str, float]]:
    """The what-if's row for ``target``'s policy at ``load``, and its served replay's error."""
    name = LABELS[target][1]
    w = run_whatif(read_recording(rec_dir), [Candidate(name, name, {})], [load])
    rows = {r["policy"].removesuffix(" (served)"): r for r in w.rows}
    return rows[name if name in rows else "vllm"], w.error


def validate(sweeps: list[Path], from_rate: float | None) -> list[dict[str, Any]]:
    runs = _runs(sweeps)
    out = []
    for (config, rate, seed), (_, live) in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        sources = [(c, rate) for c in LABELS if c != config]  # the other policy, same run
        if from_rate is not None and rate > from_rate:
            sources += [(c, from_rate) for c in LABELS]  # both policies' runs at the lower rate
        truth = recorded_outcome(read_recording(runs[(config, rate, seed)][0]))
        for src, src_rate in sources:
            if (src, src_rate, seed) not in runs:
                continue
            row, err = _predict(runs[(src, src_rate, seed)][0], config, rate / src_rate)
            for k in ("attain_f1", "attain_tpot"):
                out.append({"policy": LABELS[config][0], "rate": rate, "seed": seed, "slo": k,
                            "from": f"{LABELS[src][0]} at {src_rate:g}", "predicted": row[k],
                            "live_engine": truth[k], "live_client": live[k], "replay_error": err[k]})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | SLO | predicted from | predicted | live, engine | live, client | served replay error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        slo = "formula (1)" if r["slo"] == "attain_f1" else "TTFT+TPOT"
        lines.append(f"| {r['policy']} {r['rate']:g} rps seed {r['seed']} | {slo} | {r['from']} rps | "
                     f"{100 * r['predicted']:.0f}% | {100 * r['live_engine']:.0f}% | {100 * r['live_client']:.0f}% | "
                     f"{r['replay_error']:+.1f} |")
    for view in ("live_engine", "live_client"):
        errs = [abs(r["predicted"] - r[view]) * 100 for r in rows]
        within = sum(e <= 10 for e in errs)
        lines.append(f"\n{view.replace('_', ', ')}: {within} of {len(errs)} predictions within 10 points, "
                     f"largest error {max(errs):.0f} points")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.whatif_validation", description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="live-bench --record output folders")
    ap.add_argument("--from-rate", type=float, help="also predict every higher rate's runs from this rate's recordings")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    from clients.bench.runner import quiet_logs

    quiet_logs()
    rows = validate(args.sweeps, args.from_rate)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
