"""``slidingserve`` — the command line.

Subcommands (their names, flags and output formats are the public interface):

* ``serve``     run the gRPC scheduling service
* ``health``    standard gRPC health check of a running service (container/K8s probes)
* ``plan``      decide one iteration for a snapshot JSON file, offline or via a server
* ``explain``   why each request of a snapshot waits: the plan's reason codes (:mod:`clients.explain`)
* ``policies``  list policies, their versions and parameters, and a server's deployments
* ``predictor`` ``fit`` a predictor from a CSV of batch features and latencies;
  ``show`` one (a file, the built-in default, or a server's)
* ``token``     ``new`` bearer token + tokens-file entry, ``hash`` of a token (docs/security.md)
* ``bench``     goodput benchmark on the simulated engine (:mod:`clients.bench`)
* ``demo``      a small bench: the four main policies on mixed-v1, table and plots

Bad input gives one line on stderr and exit code 2; nothing prints a traceback
(:mod:`clients.errors` maps every failure to its line and exit code).

``--server`` reaches a secured service (docs/security.md) with the vLLM adapter's variables:
``SLIDINGSERVE_TLS_CA``, ``SLIDINGSERVE_TLS_CERT`` + ``SLIDINGSERVE_TLS_KEY`` (mutual TLS),
``SLIDINGSERVE_TOKEN_FILE`` or ``SLIDINGSERVE_TOKEN``; and ``SLIDINGSERVE_TLS_SERVER_NAME``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.bench.command import add_subcommands
from clients.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNHEALTHY, CliError, describe
from clients.explain import add_subcommand as add_explain
from clients.explain import cmd_explain as _cmd_explain
from engine_adapter.sim.groundtruth import PROFILES
from engine_adapter.sim.profiling import profile_predictor_with_holdout
from scheduler_service.client import ClientSecurity, SchedulerClient
from scheduler_service.core import (
    BatchLatencyPredictor,
    Snapshot,
    default_predictor,
    evaluate,
    fit_predictor,
    registry,
)
from scheduler_service.core.predictor import scenario_codes

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}")


def _read_json(path: str, what: str) -> Any:
    try:
        text = Path(path).read_text() if path != "-" else sys.stdin.read()
    except OSError as e:
        raise CliError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{what} {path} is not valid JSON: {e}") from None


def _params(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _load_predictor(path: str | None) -> BatchLatencyPredictor:
    if path is None:
        return default_predictor()
    return BatchLatencyPredictor.from_dict(_read_json(path, "predictor"))


def _client(args: argparse.Namespace) -> SchedulerClient:
    """A client of ``--server``, secured by the environment (see the module docstring)."""
    return SchedulerClient(args.server, timeout_s=args.timeout, security=ClientSecurity.from_env())


# ------------------------------------------------------------------ commands
def cmd_plan(args: argparse.Namespace) -> int:
    snapshot = Snapshot.from_json(_read_json(args.snapshot, "snapshot"))
    params = _params(args.param)
    if args.deployment and not args.server:
        raise CliError("--deployment names a deployment of a server's policy config; "
                       "it needs --server")
    if args.deployment and args.policy:
        raise CliError("give --deployment or --policy, not both")
    if args.server:
        if args.predictor:
            raise CliError("--predictor applies offline only; a server uses its own predictor")
        with _client(args) as client:
            plan = client.schedule(snapshot, policy=args.deployment or args.policy, params=params)
    else:
        policy = registry.create(args.policy or "slidingserve", params)
        plan = policy.plan(snapshot, _load_predictor(args.predictor))
    print(plan.to_json(indent=2))
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    if args.server:
        with _client(args) as client:
            info = client.list_policies().to_dict()
    else:
        info = {"policies": [registry.describe(n) for n in registry.names()], "default": "slidingserve"}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for p in info["policies"]:
        mark = " (default)" if p["name"] == info.get("default") else ""
        print(f"{p['name']}  {p['version']}{mark}\n    {p['doc']}")
        for prm in p["params"]:
            bounds = ""
            if prm.get("choices"):
                bounds = f" one of {prm['choices']}"
            elif prm.get("min") is not None or prm.get("max") is not None:
                bounds = f" in [{_num(prm.get('min'))}, {_num(prm.get('max'))}]"
            print(f"    --param {prm['name']}={prm['default']}  ({prm['type']}{bounds}) {prm['doc']}")
    for d in info.get("deployments", ()):  # a server with a policy config (docs/operations.md)
        marks = "".join(m for m, on in ((" (default)", d["name"] == info.get("default")),
                                        (" (shadow)", d["name"] == info.get("shadow"))) if on)
        params = " ".join(f"{k}={v}" for k, v in sorted(d["params"].items()))
        print(f"deployment {d['name']}{marks}: {d['policy']} {params}".rstrip()
              + f"  (policy version {d['policy_version']})")
    return 0


def _num(v: Any) -> str:
    """Bounds print as written (1024, not 1024.0), whatever the transport turned them into."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def cmd_predictor_fit(args: argparse.Namespace) -> int:
    features, latency = _read_samples_csv(args.csv)
    scen = scenario_codes(features[:, 3], features[:, 5])
    perm = np.random.default_rng(args.seed).permutation(len(latency))
    n_test = int(len(perm) * args.holdout)
    test, train = perm[:n_test], perm[n_test:]
    pred = fit_predictor(features[train], scen[train], latency[train], min_samples=args.min_samples,
                         meta={"source": f"slidingserve predictor fit {Path(args.csv).name}"})
    metrics = evaluate(pred, features[test], scen[test], latency[test]) if n_test >= 2 else {}
    return _emit_predictor(pred, metrics, args.out)


def _emit_predictor(pred: Any, metrics: dict[str, dict[str, float]], out: str | None) -> int:
    """Print the held-out errors on stderr and the predictor JSON to ``out`` (or stdout)."""
    for name, m in metrics.items():
        print(f"held-out {name:7s} n={m['n']:6d}  MAE {m['mae_ms']:.3f} ms  RMSE {m['rmse_ms']:.3f} ms  "
              f"R² {m['r2']:.4f}", file=sys.stderr)
    text = pred.to_json()
    if out:
        Path(out).write_text(text + "\n")
        print(f"wrote predictor {pred.version} to {out}", file=sys.stderr)
    else:
        print(text)
    return 0


def cmd_predictor_sweep(args: argparse.Namespace) -> int:
    """Fit from a seeded profiling sweep of a simulated engine profile (the
    command that regenerates the bundled default predictor)."""
    if args.profile not in PROFILES:
        raise CliError(f"unknown profile {args.profile!r}; known: {', '.join(sorted(PROFILES))}")
    if args.samples < 30:
        raise CliError(f"--samples must be at least 30, got {args.samples}")
    pred, metrics = profile_predictor_with_holdout(args.profile, n=args.samples, seed=args.seed)
    return _emit_predictor(pred, metrics, args.out)


def _read_samples_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Columns x1..x7 and latency_ms (any order, extra columns ignored)."""
    need = [f"x{i}" for i in range(1, 8)] + ["latency_ms"]
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in need if c not in (reader.fieldnames or [])]
            if missing:
                raise CliError(f"{path}: missing columns {', '.join(missing)} (need {', '.join(need)})")
            rows = []
            for lineno, row in enumerate(reader, start=2):
                try:
                    rows.append([float(row[c]) for c in need])
                except (TypeError, ValueError):
                    raise CliError(f"{path}:{lineno}: non-numeric value") from None
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None
    data = np.array(rows, dtype=np.float64).reshape(-1, len(need))
    if len(data) < 10:
        raise CliError(f"{path}: need at least 10 samples, got {len(data)}")
    if not np.all(np.isfinite(data)) or np.any(data[:, -1] <= 0):
        raise CliError(f"{path}: values must be finite and latency_ms > 0")
    return data[:, :7], data[:, 7]


def cmd_predictor_show(args: argparse.Namespace) -> int:
    if args.server:
        with _client(args) as client:
            print(json.dumps(client.get_predictor(args.profile or None).to_dict(), indent=2, default=str))
    else:
        print(_load_predictor(args.file).to_json())
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """One ``grpc.health.v1.Health/Check``; exit 0 only on SERVING.

    Fail-fast (no ``wait_for_ready``): a probe must answer within its own timeout, and a
    refused connection is an answer.
    """
    if not args.address.strip():
        raise CliError("--address must not be empty")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CliError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    what = f"{args.address} service {args.service!r}" if args.service else args.address
    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(args.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            detail = " ".join((e.details() or "").split())
            status = f"{e.code().name}: {detail}" if detail else e.code().name
            if e.code() == grpc.StatusCode.NOT_FOUND:
                status = "unknown service"
    if status != "SERVING":
        print(f"unhealthy: {what}: {status}", file=sys.stderr)
        return EXIT_UNHEALTHY
    print(status)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from scheduler_service.server import ServerConfig, serve  # deferred: only `serve` loads the server

    config = ServerConfig.from_file(args.config) if args.config else ServerConfig()
    flags = ("port", "host", "metrics_port", "workers")
    serve(config.replace(**{k: getattr(args, k) for k in flags if getattr(args, k) is not None}))
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    """``token new`` and ``token hash``; they live with the server's auth, imported only here."""
    from scheduler_service.server import tokens

    return tokens.cmd_token_new(args) if args.action == "new" else tokens.cmd_token_hash(args)


def cmd_whatif(args: argparse.Namespace) -> int:
    from clients import whatif

    if args.server:
        return whatif.ask_server(args)
    if not args.recording:
        raise CliError("whatif: give --recording DIR, or --server HOST:PORT")
    return whatif.main(args)


# -------------------------------------------------------------------- parser
def _opt(flag: str, **kw: Any) -> tuple[str, dict[str, Any]]:
    """One option of a subcommand: its flag and ``add_argument``'s keywords."""
    return flag, kw


_SERVER = _opt("--server", metavar="HOST:PORT")
_TIMEOUT = _opt("--timeout", type=float, default=5.0)
_OUT = _opt("--out", help="write the predictor JSON here (default: stdout)")


def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], help_text: str,
             *opts: tuple[str, dict[str, Any]]) -> argparse.ArgumentParser:
    """Subcommand ``name`` with ``opts``, run by ``func``."""
    s = sub.add_parser(name, help=help_text)
    for flag, kw in opts:
        s.add_argument(flag, **kw)
    s.set_defaults(func=func)
    return s


def _group(sub: Any, name: str, help_text: str) -> Any:
    """Subcommand ``name`` whose actions are subcommands (``predictor fit``): their subparsers."""
    s = sub.add_parser(name, help=help_text)
    return s.add_subparsers(dest="action", required=True, parser_class=_Parser)


def build_parser() -> argparse.ArgumentParser:
    from clients.whatif import add_arguments as add_whatif_arguments

    p = _Parser(prog="slidingserve", description="SLO-aware batch scheduling service for LLM engines.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _command(sub, "serve", cmd_serve, "run the gRPC scheduling service",
             _opt("--port", type=int, help="gRPC port (default from config: 50051)"),
             _opt("--host", help="bind address (default from config: 0.0.0.0)"),
             _opt("--metrics-port", type=int, help="Prometheus port, 0 disables"),
             _opt("--config", help="YAML/TOML/JSON server config file"),
             _opt("--workers", type=int,
                  help="worker processes sharing the port (default from config: 1); see docs/operations.md"))
    _command(sub, "health", cmd_health, "gRPC health check of a running service; exit 0 when SERVING",
             _opt("--address", required=True, metavar="HOST:PORT", help="service address (any gRPC target)"),
             _opt("--service", default="",
                  help="service name, e.g. slidingserve.v1.SchedulerService (default: the whole server)"),
             _opt("--timeout", type=float, default=2.0, help="seconds to wait for the answer"))
    _command(sub, "plan", cmd_plan, "decide one iteration for a snapshot JSON file",
             _opt("--snapshot", required=True, help="snapshot JSON (docs/usage.md), '-' for stdin"),
             _opt("--policy", help="policy name (default slidingserve; see `slidingserve policies`)"),
             _opt("--deployment", help="with --server: a deployment of its policy config (default: the "
                                       "server's default deployment; see `slidingserve policies --server`)"),
             _opt("--predictor", help="predictor JSON (default: the built-in one)"),
             _opt("--param", action="append", metavar="KEY=VALUE", help="policy parameter override"),
             _opt("--server", metavar="HOST:PORT", help="ask a running service instead of deciding locally"),
             _opt("--timeout", type=float, default=5.0, help="per-call deadline in seconds (with --server)"))
    add_explain(sub, lambda args: _cmd_explain(args, _read_json, _params, _load_predictor))
    _command(sub, "policies", cmd_policies,
             "list policies and their parameters (with --server, its deployments too)",
             _SERVER, _TIMEOUT, _opt("--json", action="store_true", help="print JSON"))
    _add_predictor(sub)
    token = _group(sub, "token", "bearer tokens for the server's auth_tokens_file (docs/security.md)")
    _command(token, "new", cmd_token, "print a fresh token and its tokens-file entry",
             _opt("--identity", required=True, help="engine (or token) name, shown in logs and metrics"),
             _opt("--tenant", required=True, help="isolation domain of the engine's predictors"),
             _opt("--token-out", help="write the token to this file (mode 0600) instead of stdout"))
    _command(token, "hash", cmd_token, "SHA-256 of a token read from stdin, for a tokens-file entry")
    w = _command(sub, "whatif", cmd_whatif, "how other policies would do on an engine's recorded traffic "
                                            "(docs/operations.md, 'Before you switch')")
    add_whatif_arguments(w)
    w.add_argument("--server", metavar="HOST:PORT", help="ask a running service, on its own recording")
    w.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the service's answer")
    add_subcommands(sub)  # bench, demo
    return p


def _add_predictor(sub: Any) -> None:
    pred = _group(sub, "predictor", "fit or show batch-latency predictors")
    _command(pred, "fit", cmd_predictor_fit, "fit from a CSV with columns x1..x7,latency_ms",
             _opt("--csv", required=True), _OUT,
             _opt("--min-samples", type=int, default=30, help="samples a scenario needs for its own model"),
             _opt("--holdout", type=float, default=0.2, help="fraction held out for the printed errors"),
             _opt("--seed", type=int, default=0))
    _command(pred, "sweep", cmd_predictor_sweep,
             "fit from a seeded profiling sweep of a simulated engine profile",
             _opt("--profile", default="a100-tp2-llama2-7b", help="simulated engine profile"),
             _opt("--samples", type=int, default=3000, help="batches timed for the fit"),
             _opt("--seed", type=int, default=0,
                  help="seed of the fit sweep (the held-out one uses seed + 1)"),
             _OUT)
    _command(pred, "show", cmd_predictor_show, "print a predictor",
             _opt("--file", help="predictor JSON (default: the built-in one)"), _SERVER,
             _opt("--profile", help="engine profile key (with --server)"), _TIMEOUT)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `slidingserve plan ... | head`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # input, remote and any other errors: one line, no traceback
        line, code = describe(e)
        print(line, file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
