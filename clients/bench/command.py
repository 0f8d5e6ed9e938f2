"""``slidingserve bench`` and ``slidingserve demo``.

Progress goes to stderr, the summary table to stdout, files to ``--out``.
Every input is validated in this process before any worker starts, so a typo
costs one line and exit code 2, not a pool of crashed workers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clients.errors import CliError
from clients.workloads import DEFINITIONS, MIXES, make_workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES
from scheduler_service.core import registry

from .executor import EXECUTORS, ExecutorUnavailable, describe
from .experiments import EXPERIMENTS, BenchConfig, run_bench
from .plots import write_plots
from .progress import ProgressBar
from .report import format_report, write_outputs
from .runner import MAIN_POLICIES, TRANSPORTS, quiet_logs

__all__ = ["add_subcommands", "cmd_bench", "cmd_demo"]

DEMO_REQUESTS = 600
DEMO_SEEDS = 2


def _csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse_params(items: list[str] | None, policies: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        pol, sep, rest = item.partition(":")
        key, sep2, value = rest.partition("=")
        if not sep or not sep2 or not pol or not key:
            raise CliError(f"--param expects POLICY:KEY=VALUE, got {item!r}")
        if pol not in policies:
            raise CliError(f"--param {item!r}: unknown policy {pol!r}; valid: {', '.join(policies)}")
        out.setdefault(pol.strip(), {})[key.strip()] = value.strip()
    return out


def _check_workload(name: str) -> None:
    if name not in MIXES and not Path(name).is_file():
        raise CliError(f"unknown workload {name!r}; valid: {', '.join(MIXES)} or a CSV path")
    try:
        make_workload(name, 4, 1.0, seed=0)
    except (OSError, ValueError) as e:
        raise CliError(f"workload {name}: {e}") from None


def build_config(args: argparse.Namespace) -> BenchConfig:
    """Validate the flags into a :class:`~clients.bench.experiments.BenchConfig`."""
    known = registry.names()
    policies = _csv_list(args.policies)
    if not policies:
        raise CliError("--policies is empty")
    for p in policies:
        if p not in known:
            raise CliError(f"unknown policy {p!r}; valid: {', '.join(known)}")
    if args.profile not in PROFILES:
        raise CliError(f"unknown profile {args.profile!r}; valid: {', '.join(sorted(PROFILES))}")
    if args.transport not in TRANSPORTS:
        raise CliError(f"unknown transport {args.transport!r}; valid: {', '.join(TRANSPORTS)}")
    if args.executor not in EXECUTORS:
        raise CliError(f"unknown executor {args.executor!r}; valid: {', '.join(EXECUTORS)}")
    exps = _csv_list(args.experiments)
    for e in exps:
        if e not in EXPERIMENTS:
            raise CliError(f"unknown experiment {e!r}; valid: {', '.join(EXPERIMENTS)}")
    if args.requests < 10:
        raise CliError("--requests must be >= 10")
    if args.seeds < 1:
        raise CliError("--seeds must be >= 1")
    if not 0 < args.tolerance < 1:
        raise CliError("--tolerance must be in (0, 1)")
    if not args.deadline_ms > 0:
        raise CliError("--deadline-ms must be > 0")
    if not 0 <= args.shed_after <= 1000:
        raise CliError("--shed-after must be in [0, 1000] (times the TTFT SLO)")
    if args.jobs is not None and args.jobs < 1:
        raise CliError("--jobs must be >= 1")
    _check_workload(args.workload)
    params = _parse_params(args.param, known)
    for pol, prm in params.items():
        registry.create(pol, prm)  # ValidationError → one line, exit 2 (cli.main)
    return BenchConfig(
        workload=args.workload, profile=args.profile, policies=tuple(policies), transport=args.transport,
        n_requests=args.requests, seeds=args.seeds, first_seed=args.seed, tolerance=args.tolerance,
        experiments=tuple(exps), params=params, workers=args.jobs or os.cpu_count() or 1,
        executor=args.executor, deadline_ms=args.deadline_ms, slo_definition=args.slo_definition,
        shed_after=args.shed_after,
    )


def _progress(stream: Any) -> Callable[[str, int], Callable[[Any, dict[str, Any]], None]]:
    def phase(label: str, total: int) -> Callable[[Any, dict[str, Any]], None]:
        bar = ProgressBar(total, label, stream)

        def done(job: Any, res: dict[str, Any]) -> None:
            note = describe(job)
            if "goodput_rps" in res:
                note += f" -> {res['goodput_rps']:.3f} rps ({len(res['probes'])} probes)"
            else:
                note += f" -> {100 * res['violation_rate']:.1f}% violations"
            bar.advance(note)

        return done

    return phase


def _run(cfg: BenchConfig, out: Path | None, quiet: bool) -> int:
    quiet_logs()
    t0 = time.perf_counter()
    try:
        res = run_bench(cfg, progress=None if quiet else _progress(sys.stderr))
    except ExecutorUnavailable as e:
        raise CliError(str(e)) from None
    print(format_report(res))
    if out is not None:
        files = write_outputs(res, out)
        try:
            files += write_plots(res, out)
        except ImportError:
            print("plots skipped: matplotlib is not installed", file=sys.stderr)
        print(f"\nwrote {', '.join(str(f) for f in files)}")
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return _run(build_config(args), Path(args.out) if args.out else None, args.quiet)


def cmd_demo(args: argparse.Namespace) -> int:
    return _run(build_config(args), Path(args.out), args.quiet)


def _common(s: argparse.ArgumentParser, requests: int, seeds: int) -> None:
    s.add_argument("--workload", default="mixed-v1",
                   help="sharegpt, arxiv, mixed-v1, mixed-v2 or a CSV path (default mixed-v1)")
    s.add_argument("--profile", default=DEFAULT_PROFILE, help=f"GPU profile (default {DEFAULT_PROFILE})")
    s.add_argument("--policies", default=",".join(MAIN_POLICIES), help="comma-separated policy names")
    s.add_argument("--transport", default="inproc", help="inproc (default) or grpc (embedded service, loopback)")
    s.add_argument("--requests", type=int, default=requests, help=f"requests per run (default {requests})")
    s.add_argument("--seeds", type=int, default=seeds, help=f"seeds per goodput (default {seeds})")
    s.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    s.add_argument("--tolerance", type=float, default=0.05,
                   help="relative width at which the goodput search stops (default 0.05)")
    s.add_argument("--deadline-ms", type=float, default=20.0,
                   help="per-iteration scheduler deadline; a miss falls back to vllm-fcfs (default 20)")
    s.add_argument("--shed-after", type=float, default=0.0, metavar="X",
                   help="the engine's wait bound: a request without its first token X times its TTFT SLO after "
                        "it arrived may be rejected (reason wait_bound) by a policy that sheds; 0 = off (default)")
    s.add_argument("--jobs", type=int, help="parallel worker processes (default: CPU count)")
    s.add_argument("--executor", default="process", help="process (default) or ray (RAY_ADDRESS for a cluster)")
    s.add_argument("--param", action="append", metavar="POLICY:KEY=VALUE",
                   help="policy parameter override (repeatable)")
    s.add_argument("--slo-definition", default="formula1", choices=DEFINITIONS,
                   help="how requests are judged and planned for: formula1 (every token by its cumulative "
                        "deadline, the default) or tpot (TTFT, then the mean time per output token, as "
                        "`vllm bench serve --goodput` counts)")
    s.add_argument("--quiet", action="store_true", help="no progress output")


def add_subcommands(sub: Any) -> None:
    """Register ``bench`` and ``demo`` on the ``slidingserve`` subparsers."""
    s = sub.add_parser("bench", help="goodput benchmark on the simulated engine")
    _common(s, requests=1000, seeds=3)
    s.add_argument("--out", help="write goodput.json, CSVs and PNG plots here")
    s.add_argument("--experiments", default="goodput",
                   help="comma-separated: goodput, overload, burst, load, window, ablation, margin, classes, "
                        "reasons (default goodput)")
    s.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help=f"the four main policies on mixed-v1, {DEMO_SEEDS} seeds: table and plots")
    _common(d, requests=DEMO_REQUESTS, seeds=DEMO_SEEDS)
    d.add_argument("--out", default="demo-out", help="output folder (default ./demo-out)")
    d.set_defaults(func=cmd_demo, experiments="goodput")
