"""``python -m clients.live`` (``make live-bench``): the live benchmark's command line.

Bad input gives one line on stderr and exit code 2; a server that does not come up gives
its log's tail and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from .judge import TINY_LLAMA, write_model, write_tokenizer
from .measure import Slo
from .procs import EngineArgs
from .report import (
    aa_table,
    capacity_note,
    judge_table,
    markdown,
    noise_table,
    shared_note,
    sim_table,
    timing_table,
    write_plot,
    write_sim_plot,
)
from .runner import (
    NATIVE,
    NATIVE_AGAIN,
    OBSERVE,
    Config,
    LiveSpec,
    check_resumable,
    load_runs,
    resolve_rates,
    run_sweep,
)
from .workload import WorkloadSpec

__all__ = ["main"]

DEFAULT_CONFIGS = "vllm inproc:slidingserve remote:slidingserve"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _floats(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not out or any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        if "-" in text and "," not in text:
            a, b = (int(x) for x in text.split("-"))
            return tuple(range(a, b + 1))
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,3 or 1-5, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="live-bench", description="SLO attainment and goodput on a live vLLM (CPU build): vLLM's "
                "own scheduler against policies through the adapter, in process and remote.")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="configurations separated by spaces or ';': 'vllm' (vLLM's own scheduler) or "
                        f"MODE:POLICY[:k=v,...] with MODE inproc or remote (default: '{DEFAULT_CONFIGS}')")
    p.add_argument("--no-aa", action="store_true",
                   help=f"do not run vLLM's own scheduler a second time per seed ('{NATIVE_AGAIN}': the A/A noise "
                        "floor every comparison is read against; on by default with 'vllm')")
    p.add_argument("--max-foreign-load", type=float, default=0.3, metavar="CORES",
                   help="start a run only once processes outside the benchmark keep at most this many cores busy "
                        "(default 0.3)")
    p.add_argument("--quiet-wait", type=float, default=600.0, metavar="S",
                   help="how long to wait for that before stopping with a message (default 600 s)")
    p.add_argument("--allow-shared", action="store_true",
                   help="run on a busy machine all the same; such runs are flagged in runs.jsonl and the report")
    p.add_argument("--loads", type=_floats, default=(0.5, 0.75, 1.0, 1.25, 1.5), metavar="MULTIPLES",
                   help="rates as multiples of vLLM's capacity that day (default 0.5,0.75,1,1.25,1.5): the sweep "
                        "first finds the highest rate at which vLLM's own scheduler meets 90%% under TTFT+TPOT")
    p.add_argument("--capacity", type=float, default=None, metavar="RPS",
                   help="vLLM's capacity in req/s, instead of searching for it")
    p.add_argument("--capacity-seed", type=int, default=1000, help="the capacity probes' seed (default 1000)")
    p.add_argument("--rates", type=_floats, default=None,
                   help="absolute Poisson rates, req/s, instead of --loads (no capacity search)")
    _add_workload_args(p)
    _add_output_args(p)
    return p


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """Seeds, requests, SLOs and the engine's settings."""
    p.add_argument("--seeds", type=_ints, default=(1, 2, 3, 4, 5), help="seeds, e.g. 1-5 or 1,3 (default 1-5)")
    p.add_argument("--requests", type=int, default=100, help="measured requests per run (default 100)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured requests before them (default 20)")
    p.add_argument("--max-prompt", type=int, default=1024, help="prompts clipped to this many tokens (default 1024)")
    p.add_argument("--max-output", type=int, default=128, help="outputs clipped to this many tokens (default 128)")
    p.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT objective (default 1000)")
    p.add_argument("--tbt-ms", type=float, default=50.0, help="TBT / TPOT objective (default 50)")
    p.add_argument("--threshold", type=float, default=0.9,
                   help="attainment at which goodput is read (default 0.9: what vLLM's own scheduler reaches "
                        "on a shared 2-core machine; 0.99 is within its noise)")
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens (default 512)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="--max-num-seqs (default 64)")
    p.add_argument("--prefix-caching", action="store_true", help="turn vLLM's prefix caching on (default off)")
    p.add_argument("--record", action="store_true",
                   help="the adapter's engine records each run's traffic under OUT/recordings/ (for slidingserve "
                        "whatif); the configuration 'observe' is vLLM's own scheduler on that engine, recorded")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="the same N tokens (a system prompt) before every prompt, for runs with "
                        "--prefix-caching; vLLM's bench serve judge replays prompts without it (default 0: none)")
    p.add_argument("--turns", type=int, default=1, metavar="K",
                   help="multi-turn chat: K requests per conversation, each later one sent after the one "
                        "before finished, with the history as its prompt (default 1: independent requests)")
    p.add_argument("--think-s", type=float, default=1.0,
                   help="mean think time between a conversation's turns, seconds (default 1)")
    p.add_argument("--deadline-ms", type=float, default=20.0, help="the adapter's plan deadline (default 20)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """The judge, the output folder and the simulator's replay."""
    p.add_argument("--judge-seeds", type=_ints, default=None, help="seeds whose runs vLLM's own `bench serve` "
                   "replays as an independent judge (default 1, none with --turns; 0 = none)")
    p.add_argument("--out", type=Path, default=Path("live-bench"), help="output folder (default ./live-bench); "
                   "runs already in its runs.jsonl are not repeated")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from runs.jsonl")
    p.add_argument("--sim", nargs="?", const="", default=None, metavar="ENGINE_PREDICTOR_JSON",
                   help="also replay the sweep in the simulator on the engine's fitted cost model (the "
                        "sweep's own engine_predictor.json, saved by sweeps with a remote configuration; or "
                        "the one given, e.g. another sweep's, to check the replay on runs it was not fitted on)")
    p.add_argument("--sim-only", type=Path, metavar="ENGINE_PREDICTOR_JSON",
                   help="start no engine: replay the sweep in the simulator on this cost model (the "
                        "engine_predictor.json of an earlier sweep, e.g. docs/results/live/) and report it; "
                        "for trying engine settings (budget, SLOs) before measuring them live")
    p.add_argument("--sim-noise", type=float, default=None,
                   help="lognormal spread of the simulated iteration times (default: with --sim, read off the "
                        "sweep's remote runs (their overrun shares); else, and where they have none, 0.15)")


def spec_of(args: argparse.Namespace) -> LiveSpec:
    """The sweep the command line asks for; ValueError on a bad value."""
    engine = EngineArgs(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                        prefix_caching=args.prefix_caching)
    workload = WorkloadSpec(requests=args.requests, warmup=args.warmup, max_prompt=args.max_prompt,
                            max_output=args.max_output, vocab_size=int(TINY_LLAMA["vocab_size"]),
                            shared_prefix=args.shared_prefix, turns=args.turns, think_s=args.think_s)
    if (args.shared_prefix > 0 or args.turns > 1) and workload.longest_request() > engine.max_model_len:
        raise ValueError(f"a request may hold {workload.longest_request()} tokens (--shared-prefix + --turns x "
                         f"(--max-prompt + --max-output)), over the engine's {engine.max_model_len}")
    if args.turns > 1 and (args.sim is not None or args.sim_only is not None):
        raise ValueError("--sim and --sim-only replay independent requests: not with --turns > 1")
    judge = tuple(x for x in (args.judge_seeds or ((1,) if args.turns == 1 else ())) if x != 0)
    if args.turns > 1 and judge:
        raise ValueError("vLLM's bench serve replays independent requests: give --judge-seeds 0 with --turns > 1")
    if not args.max_foreign_load >= 0 or not args.quiet_wait >= 0:
        raise ValueError("--max-foreign-load and --quiet-wait must be 0 or more")
    configs = _configs(args.configs)
    labels = [c.label for c in configs]
    if not args.no_aa and NATIVE in labels and NATIVE_AGAIN not in labels:
        i = labels.index(NATIVE)
        configs = (*configs[:i + 1], Config.parse(NATIVE_AGAIN), *configs[i + 1:])
    if any(c.mode == OBSERVE for c in configs) and not args.record:
        raise ValueError(f"configuration {OBSERVE!r} records vLLM's own scheduling: it needs --record")
    if args.capacity is not None and not args.capacity > 0:
        raise ValueError(f"--capacity must be positive, got {args.capacity:g}")
    return LiveSpec(
        configs=configs, rates=args.rates or (), seeds=args.seeds,
        loads=() if args.rates else args.loads, capacity_rps=args.capacity, capacity_seed=args.capacity_seed,
        max_foreign=args.max_foreign_load, quiet_wait_s=args.quiet_wait, allow_shared=args.allow_shared,
        workload=workload,
        engine=engine,
        slo=Slo(args.ttft_ms, args.tbt_ms), model=dict(TINY_LLAMA), deadline_ms=args.deadline_ms,
        judge_seeds=judge, record=args.record)


#: the simulated iteration times' lognormal spread when nothing measured it
DEFAULT_SIM_NOISE = 0.15


def _configs(text: str) -> tuple[Config, ...]:
    items = [x for x in text.replace(";", " ").split() if x]
    if not items:
        raise ValueError("no configuration given")
    return tuple(Config.parse(x) for x in items)


def _simulate(spec: LiveSpec, out: Path, noise: float | None, live: Sequence[dict[str, Any]],
              model: str = "") -> list[dict[str, Any]]:
    from scheduler_service.core import BatchLatencyPredictor

    from .sim import noise_from_overruns, simulate_sweep

    path = _sim_model(out, model)
    if not path.exists():
        raise ValueError(f"--sim needs {path}: run a sweep with a remote configuration first, or name "
                         "another sweep's engine_predictor.json")
    try:
        pred = BatchLatencyPredictor.from_dict(json.loads(path.read_text())["predictor"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--sim {path}: not an engine_predictor.json ({e})") from e
    if model:
        print(f"the cost model: {path}", flush=True)
    if noise is None:
        found = noise_from_overruns(live)
        noise = DEFAULT_SIM_NOISE if found is None else round(found, 2)
        print(f"iteration-time noise σ {noise:g} " + ("(none of the runs measured it: the default)" if found is None
                                                      else "(read off the remote runs' overrun shares)"), flush=True)
    print(f"simulating {len(spec.order())} runs on the engine's fitted cost model (again with the client's "
          "delays where recorded, and at each run's own engine speed where vLLM's timings were)", flush=True)
    sim = simulate_sweep(spec, pred, noise, live_dir=out, live=live, progress=_progress(every=5))
    (out / "sim.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sim))
    return sim


def _progress(every: int = 1) -> Callable[[int, int, str], None]:
    """A progress line with elapsed time and estimate, every ``every`` runs and at the last."""
    t0 = time.monotonic()

    def progress(i: int, n: int, note: str) -> None:
        if i == n or i % every == 0:
            el = time.monotonic() - t0
            print(f"[{i}/{n}] {el:.0f}s, eta {el / i * (n - i):.0f}s  {note}", flush=True)

    return progress


def _sim_only(spec: LiveSpec, out: Path, args: argparse.Namespace) -> int:
    from scheduler_service.core import BatchLatencyPredictor, ValidationError

    from .sim import simulate_sweep

    try:
        doc = json.loads(args.sim_only.read_text())
        pred = BatchLatencyPredictor.from_dict(doc.get("predictor", doc) if isinstance(doc, dict) else doc)
    except (OSError, ValueError, ValidationError) as e:
        print(f"live-bench: --sim-only {args.sim_only}: {e}", file=sys.stderr)
        return 2
    try:
        spec = resolve_rates(spec, out)
    except ValueError:
        print("live-bench: --sim-only starts no engine to find its capacity: give --rates or --capacity",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    noise = DEFAULT_SIM_NOISE if args.sim_noise is None else args.sim_noise
    sim = simulate_sweep(spec, pred, noise, progress=_progress(every=10))
    (out / "sim.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sim))
    text = (f"Simulated only (no live engine): the cost model {args.sim_only} with noise σ {noise:g}, "
            f"budget {spec.engine.max_num_batched_tokens}, TTFT {spec.slo.ttft_ms:g} ms, TBT {spec.slo.tbt_ms:g} ms; "
            "vLLM's own scheduler is modelled by vllm-fcfs.\n\n" + markdown(sim, args.threshold))
    (out / "report.md").write_text(text)
    png = write_plot(sim, out / "live.png", args.threshold)
    print(text)
    print(f"wrote {out / 'report.md'}, {out / 'sim.jsonl'}" + (f", {png}" if png else ""))
    return 0


def _sim_model(out: Path, model: str) -> Path:
    """The cost model ``--sim`` replays on: the one named, else the sweep's own."""
    return Path(model) if model else out / "engine_predictor.json"


def _cost(path: Path) -> str:
    """The cost structure of the engine_predictor.json at ``path`` (the replays' model), or nothing."""
    if not path.exists():
        return ""
    from scheduler_service.core import BatchLatencyPredictor

    from .sim import cost_structure

    info = json.loads(path.read_text())
    c = cost_structure(BatchLatencyPredictor.from_dict(info["predictor"]))
    return (f"The replays' cost model ({path}: the service's predictor fitted on {info['reports_accepted']} iteration "
            "reports): "
            f"a lone decode {c['one_decode_ms']:.1f} ms, each more decode {c['per_decode_ms']:.3f} ms, each prefill "
            f"token {c['per_prefill_token_ms']:.4f} ms, a 512-token prefill {c['prefill_512_ms']:.1f} ms.\n")


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # through the runner's cleanup: no vllm serve is left behind


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    args = parser().parse_args(argv)
    try:
        spec = spec_of(args)
        if not 0 < args.threshold <= 1:
            raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    except ValueError as e:
        print(f"live-bench: {e}", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.sim_only is not None:
        return _sim_only(spec, out, args)
    runs = out / "runs.jsonl"
    if not args.report_only:
        try:
            check_resumable(out, spec)
        except ValueError as e:
            print(f"live-bench: {e}", file=sys.stderr)
            return 2
        model = out / "work" / "model"
        write_model(model, TINY_LLAMA)
        write_tokenizer(model, int(TINY_LLAMA["vocab_size"]))
        try:
            run_sweep(spec, out, str(model), log=lambda m: print(m, flush=True), progress=_progress())
        except RuntimeError as e:
            print(f"live-bench: {e}", file=sys.stderr)
            return 1
    if not runs.exists():
        print(f"live-bench: no runs in {out}", file=sys.stderr)
        return 2
    data = load_runs(runs)
    try:
        spec = resolve_rates(spec, out)
    except ValueError:
        spec = replace(spec, rates=tuple(sorted({float(r["rate"]) for r in data})))
    try:
        sim = _simulate(spec, out, args.sim_noise, data, args.sim) if args.sim is not None else []
    except ValueError as e:
        print(f"live-bench: {e}", file=sys.stderr)
        return 2
    text = "\n".join(x for x in (capacity_note(out), markdown(data, args.threshold), aa_table(data), shared_note(data, args.max_foreign_load),
                                  judge_table(data), timing_table(data),
                                  noise_table(data), sim_table(data, sim),
                                  _cost(_sim_model(out, args.sim or ""))) if x)
    (out / "report.md").write_text(text)
    png = write_plot(data, out / "live.png", args.threshold, sim)
    sim_png = write_sim_plot(data, sim, out / "sim.png") if sim else None
    print(text)
    print(f"wrote {out / 'report.md'}" + "".join(f", {x}" for x in (png, sim_png) if x))
    return 0
