"""The WhatIf RPC's work: ``slidingserve whatif`` on the service's recording, in a child
process.

The replays take seconds to minutes of CPU; in a process of their own they hold no lock or
GIL of the decisions', and ``nice`` keeps them behind the decisions for the cores.  The
service passes its recording, its policy config (so that deployments are named as in
``ListPolicies``) and the caller's tenant (a tenant replays only its own engines).
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import grpc

from scheduler_service.core import FieldViolation, ValidationError
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb

from .config import ServerConfig
from .identity import DEFAULT_TENANT, scoped_key

__all__ = ["MAX_DEPLOYMENTS", "MAX_LOADS", "run_child", "whatif_args"]

MAX_DEPLOYMENTS = 8
MAX_LOADS = 6
_MAX_NAME = 200


def whatif_args(request: pb.WhatIfRequest, tenant: str) -> list[str]:
    """The command line's arguments for ``request`` (ValidationError naming each bad field)."""
    errs = []
    if len(request.deployments) > MAX_DEPLOYMENTS:
        errs.append(FieldViolation("deployments", f"at most {MAX_DEPLOYMENTS}, got {len(request.deployments)}"))
    for i, d in enumerate(request.deployments):
        if not d or len(d) > _MAX_NAME or "," in d or not d.isprintable():
            errs.append(FieldViolation(f"deployments[{i}]", f"must be a name of 1 to {_MAX_NAME} printable "
                                                            "characters without commas"))
    if len(request.loads) > MAX_LOADS:
        errs.append(FieldViolation("loads", f"at most {MAX_LOADS}, got {len(request.loads)}"))
    for i, x in enumerate(request.loads):
        if not (math.isfinite(x) and 0 < x <= 20):
            errs.append(FieldViolation(f"loads[{i}]", f"must be in (0, 20], got {x}"))
    if len(request.engine_id) > _MAX_NAME or not request.engine_id.isprintable():
        errs.append(FieldViolation("engine_id", f"at most {_MAX_NAME} printable characters"))
    if errs:
        raise ValidationError(errs)
    args = ["--load", ",".join(f"{x:g}" for x in request.loads) or "1,1.5"]
    if request.deployments:
        args += ["--deployments", ",".join(request.deployments)]
    if request.engine_id:
        args += ["--engine", scoped_key(tenant, request.engine_id)]
    elif tenant != DEFAULT_TENANT:
        args += ["--engine-prefix", scoped_key(tenant, "")]
    return args


def run_child(cfg: ServerConfig, args: list[str]) -> tuple[Any, str]:
    """(None, the answer's JSON), or (a gRPC status code, a one-line message)."""
    cmd = [sys.executable, "-m", "clients.cli", "whatif", "--recording", cfg.record, "--json", *args]
    if cfg.policy_config:
        cmd += ["--policy-config", cfg.policy_config]
    try:
        done = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True,
                              timeout=cfg.whatif_timeout_s)
    except subprocess.TimeoutExpired:
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"the what-if ran past whatif_timeout_s ({cfg.whatif_timeout_s:g} s)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["the what-if failed"])[-1]
        return grpc.StatusCode.FAILED_PRECONDITION, last.removeprefix("error: ")
    return None, done.stdout
