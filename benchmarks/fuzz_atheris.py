"""Coverage-guided fuzzing of the service's input edge with atheris (optional).

    .venv/bin/python -m pip install -e '.[fuzz]'        # atheris (PyPI package)
    .venv/bin/python -m benchmarks.fuzz_atheris --write-seeds corpus/   # seed corpus, once
    .venv/bin/python -m benchmarks.fuzz_atheris -max_total_time=120 corpus/

Where ``benchmarks.fuzz_service`` throws generated hostile input at a real server over
gRPC, this one lets libFuzzer evolve bytes towards new branches of the code that judges
them, in-process (thousands of inputs per second instead of hundreds): each input is a
``ScheduleRequest`` in wire bytes or a snapshot JSON document, and goes through exactly
what the server and the CLI do with it — decode, :func:`snapshot_from_pb` /
:meth:`Snapshot.from_json`, ``registry.create`` with the request's policy and params,
the policy's plan — and the plan through :func:`plan_violations`.  A crash is any
exception other than the two expected rejections (``DecodeError`` for bytes that are not
a message, :class:`ValidationError` for bad content), an invalid plan, or a numpy
RuntimeWarning (overflow on a valid snapshot), which the server turns into INTERNAL
under pytest.  Params are restricted to cheap values (see ``SAFE_PARAMS`` there) so the
fuzzer measures correctness, not the known O(grid^2) parameter costs.

libFuzzer options (``-max_total_time``, ``-runs``, ``-dict``, a corpus directory) pass
through; a crash leaves ``crash-<sha1>`` with the input, replayable by passing the file.
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path
from typing import Any

try:
    import atheris
except ImportError:  # pragma: no cover - optional tool
    sys.exit("atheris is not installed: .venv/bin/python -m pip install -e '.[fuzz]'")

with atheris.instrument_imports(include=["scheduler_service"]):
    from google.protobuf.message import DecodeError

    from scheduler_service.core import Snapshot, ValidationError, default_predictor, plan_violations, registry
    from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
    from scheduler_service.wire.convert import snapshot_from_pb

# After the block: the campaign's generators (they load the server and the CLI) are not instrumented.
from benchmarks.fuzz_service import hostile_json, hostile_request, valid_request

MAX_REQUESTS = 32
PREDICTOR = default_predictor()
POLICIES = ["", *registry.names()]
#: Cheap parameter names per policy: a request's other params are dropped, not fuzzed.
SAFE = {"window", "order", "alpha", "epsilon_s", "margin", "tie_tolerance_ms", "max_candidates",
        "batch_constructor", "kv_decode_reserve", "safety_factor", "hybrid_coef_s", "chunk_size"}


def _plan(snap: Snapshot, policy: str, params: dict[str, str]) -> None:
    try:
        pol = registry.create(policy or "slidingserve", params or None)
    except ValidationError:
        return
    plan = pol.plan(snap, PREDICTOR)
    problems = plan_violations(snap, plan)
    if problems:
        raise AssertionError(f"invalid plan: {problems}")


def one_input(data: bytes) -> None:
    """Byte 0 picks JSON (0) or protobuf, byte 1 the policy when the request names none,
    the rest is the document (a layout the seed corpus can write directly)."""
    if len(data) < 2:
        return
    kind, policy, raw = data[0] % 4, POLICIES[data[1] % len(POLICIES)], data[2:]
    if kind == 0:  # snapshot JSON, as the CLI and the Python client read it
        try:
            snap = Snapshot.from_json(raw, max_requests=MAX_REQUESTS)
        except ValidationError:
            return
        _plan(snap, policy, {})
        return
    try:
        req = pb.ScheduleRequest.FromString(raw)
    except DecodeError:
        return
    try:
        snap, _ = snapshot_from_pb(req.snapshot, max_requests=MAX_REQUESTS)
    except ValidationError:
        return
    params = {k: v for k, v in req.params.items() if k in SAFE}
    if snap.max_batch_tokens > 1 << 16 and kind == 1:
        return  # keep most inputs fast: large budgets cost O(budget) per decision
    _plan(snap, req.policy or policy, params)


def write_seeds(directory: str, n: int = 200) -> None:
    """A seed corpus: valid and hostile requests and JSON from the campaign's generators
    (random bytes alone take libFuzzer a long time to reach a valid snapshot)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    for i in range(n):
        head = bytes([i % 4, i % len(POLICIES)])
        if i % 4 == 0:
            body = hostile_json(rnd)[0]
        else:
            body = (valid_request(rnd) if i % 2 else hostile_request(rnd)[0]).SerializeToString()
        (out / f"seed-{i:04d}").write_bytes(head + body)


def main(argv: list[str] | None = None) -> Any:
    args = list(argv if argv is not None else sys.argv)
    if len(args) == 3 and args[1] == "--write-seeds":
        write_seeds(args[2])
        return
    warnings.simplefilter("error", RuntimeWarning)
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
