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

from clients.live.runner import recording_path
from clients.whatif import Candidate, recorded_outcome, run_whatif
from scheduler_service.recording import read_recording

LABELS = {"observe": ("vllm", "vllm-fcfs"), "inproc:slidingserve": ("slidingserve", "slidingserve")}


def _runs(sweeps: list[Path]) -> dict[tuple[str, float, int], tuple[Path, dict[str, Any]]]:
    out = {}
    for sweep in sweeps:
        for line in (sweep / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            d = recording_path(sweep, r["config"], r["rate"], r["seed"])
            if r["config"] in LABELS and d.is_dir():
                out[(r["config"], float(r["rate"]), int(r["seed"]))] = (d, r)
    return out


def _predict(rec_dir: Path, target: str, load: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """The what-if's row for ``target``'s policy at ``load``, its row for the served policy
    at that load, and its served replay's error."""
    name = LABELS[target][1]
    w = run_whatif(read_recording(rec_dir), [Candidate(name, name, {})], [load])
    rows = {r["policy"].removesuffix(" (served)"): r for r in w.rows}
    served = next(r for r in w.rows if r["policy"].endswith("(served)"))
    return rows[name if name in rows else "vllm"], served, w.error


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
            row, served, err = _predict(runs[(src, src_rate, seed)][0], config, rate / src_rate)
            other = runs.get((src, rate, seed))  # the source policy's own run at this rate
            for k in ("attain_f1", "attain_tpot"):
                r = {"policy": LABELS[config][0], "rate": rate, "seed": seed, "slo": k,
                     "from": f"{LABELS[src][0]} at {src_rate:g}", "predicted": row[k],
                     "live_engine": truth[k], "live_client": live[k], "replay_error": err[k]}
                if other is not None and src != config:  # the difference between the two policies
                    r["predicted_diff"] = row[k] - served[k]
                    r["live_diff_client"] = live[k] - other[1][k]
                    r["live_diff_engine"] = truth[k] - recorded_outcome(read_recording(other[0]))[k]
                out.append(r)
    return out


def signs(rows: list[dict[str, Any]], band: tuple[float, float]) -> str:
    """Whether the predicted difference between the policies has the live one's sign, where
    the live one (the client's) is outside the A/A band (points, formula (1) / TTFT+TPOT)."""
    out = []
    for k, b in zip(("attain_f1", "attain_tpot"), band, strict=True):
        sel = [r for r in rows if r["slo"] == k and "predicted_diff" in r and abs(100 * r["live_diff_client"]) > b]
        right = sum((r["predicted_diff"] > 0) == (r["live_diff_client"] > 0) for r in sel)
        out.append(f"{'formula (1)' if k == 'attain_f1' else 'TTFT+TPOT'}: sign right in {right} of {len(sel)} "
                   f"differences outside a {b:g}-point band")
    return "; ".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | SLO | predicted from | predicted | live, engine | live, client | served replay error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        slo = "formula (1)" if r["slo"] == "attain_f1" else "TTFT+TPOT"
        lines.append(f"| {r['policy']} {r['rate']:g} rps seed {r['seed']} | {slo} | {r['from']} rps | "
                     f"{100 * r['predicted']:.0f}% | {100 * r['live_engine']:.0f}% | {100 * r['live_client']:.0f}% | "
                     f"{r['replay_error']:+.1f} |")
    lines.append("")
    for view in ("live_engine", "live_client"):
        for what, sel in (("same rate", lambda r: "at " + f"{r['rate']:g}" in r["from"]),
                          ("from a lower rate", lambda r: "at " + f"{r['rate']:g}" not in r["from"])):
            errs = [abs(r["predicted"] - r[view]) * 100 for r in rows if sel(r)]
            if errs:
                lines.append(f"- against {view.replace('_', ', ')}, {what}: {sum(e <= 10 for e in errs)} of "
                             f"{len(errs)} within 10 points, largest error {max(errs):.0f}")
    lines.append("")
    lines.append("| run | SLO | live difference, client / engine | predicted difference |")
    lines.append("|---|---|---|---|")
    for r in rows:
        if "predicted_diff" in r:
            slo = "formula (1)" if r["slo"] == "attain_f1" else "TTFT+TPOT"
            lines.append(f"| {r['policy']} − {r['from'].split()[0]}, {r['rate']:g} rps seed {r['seed']}, from "
                         f"{r['from']} rps | {slo} | "
                         f"{100 * r['live_diff_client']:+.0f} / {100 * r['live_diff_engine']:+.0f} | "
                         f"{100 * r['predicted_diff']:+.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.whatif_validation", description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="*", type=Path, help="live-bench --record output folders")
    ap.add_argument("--from-rate", type=float, help="also predict every higher rate's runs from this rate's recordings")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--band", default="22,26", help="the A/A band (points, formula (1),TTFT+TPOT) outside which a "
                    "live difference's sign must be predicted (default: vLLM's own at 1x, the load-curve issue's)")
    ap.add_argument("--rows", type=Path, help="read the rows a --json run wrote instead of replaying")
    args = ap.parse_args(argv)
    from clients.bench.runner import quiet_logs

    quiet_logs()
    rows = json.loads(args.rows.read_text()) if args.rows else validate(args.sweeps, args.from_rate)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    band = tuple(float(x) for x in args.band.split(","))
    print(table(rows))
    print(f"\n{signs(rows, (band[0], band[1]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
