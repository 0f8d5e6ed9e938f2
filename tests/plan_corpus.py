"""The plan corpus: snapshots every policy plans the same way before and after a refactor.

A redesign of the policy core must not change one plan.  This module holds the corpus
that checks it (``tests/test_plan_corpus.py``):

* **random** snapshots, built here from a seed: every awkward input at once (partly
  prefilled requests, prefix-cached tokens, classes, sheddable requests, end-to-end and
  TPOT objectives, tight KV and ``max_num_seqs``), from empty to a few hundred requests;
* **recorded** snapshots (``tests/data/plan_corpus.jsonl.gz``): every 15th iteration of
  the simulated engine serving the real traces at and past capacity, under SlidingServe
  and vLLM's first-come scheduler, with and without request classes.

Each (policy configuration, snapshot, predictor) plan is reduced to a canonical text (path,
budget, predicted time to the last bit, allocations, rejections, preemptions and the reason
of every request it does not fully serve, from both the decision and the replayed rules);
the corpus digest is the SHA-256 of those texts, per configuration.  The expected digests
live in ``tests/data/plan_digests.json``.

Re-record (only when the simulator or the traces change, never to make a policy change
pass): ``.venv/bin/python -m tests.plan_corpus --record``.  Re-pin the digests (only for a
change that is meant to change plans, said in its commit): ``... --pin``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from clients.bench.runner import RunSpec, profile_predictor, quiet_logs
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine
from engine_adapter.sim.groundtruth import PROFILES, load_ground_truth
from scheduler_service.core import BatchLatencyPredictor, Plan, Snapshot, default_predictor, registry
from scheduler_service.core.reasons import explain, plan_explained
from tests.factories import dyadic_predictor, random_predictor

DATA = Path(__file__).resolve().parent / "data"
RECORDED = DATA / "plan_corpus.jsonl.gz"
DIGESTS = DATA / "plan_digests.json"

#: (label, registry name, parameter overrides): every registered policy at its defaults,
#: and SlidingServe with each switch of its rules turned the other way.
CONFIGS: tuple[tuple[str, str, dict[str, object]], ...] = (
    *((n, n, {}) for n in ("vllm-fcfs", "vllm-priority", "sarathi", "sarathi-edf", "qoserve", "slidingserve",
                           "sarathi-edf+sc", "sarathi-edf+sc+mlps")),
    ("slidingserve:window=1,edf", "slidingserve", {"window": 1, "order": "edf"}),
    ("slidingserve:window=3,granularity=8", "slidingserve", {"window": 3, "granularity": 8, "max_grid": 64}),
    ("slidingserve:lost=alone,waiting", "slidingserve", {"lost_rule": "alone", "sit_out_when": "waiting",
                                                         "skip_late_decodes": False}),
    ("slidingserve:no-fcfs,no-starve", "slidingserve", {"fcfs_when_safe": False, "starve_after": 0.0}),
    ("slidingserve:no-classes", "slidingserve", {"class_sit_out": False, "preempt": False, "shed": False,
                                                 "class_rescue": False, "class_reserve": 0.0}),
    ("slidingserve:no-bc,margin=1", "slidingserve", {"batch_constructor": False, "margin": 1.0,
                                                     "tie_tolerance_ms": 0.0}),
)


def predictors() -> list[tuple[str, BatchLatencyPredictor]]:
    """The bundled predictor, random positive and non-monotone ones, and dyadic ones
    (whose exact ties the orders must break the same way)."""
    return [("default", default_predictor()), ("random", random_predictor(7)),
            ("random-negative", random_predictor(8, allow_negative=True)), ("dyadic", dyadic_predictor(9)),
            ("dyadic-negative", dyadic_predictor(10, allow_negative=True))]


def _random_columns(rng: np.random.Generator, n: int, now: float) -> dict[str, np.ndarray]:
    prompt = rng.integers(1, rng.choice([8, 64, 600, 4000]) + 1, n)
    kind = rng.choice(3, n, p=[0.4, 0.2, 0.4])  # waiting, partly prefilled, decoding
    computed = np.where(kind == 2, prompt, np.where(kind == 1, (prompt * rng.uniform(0, 1, n)).astype(np.int64), 0))
    computed = np.minimum(computed, prompt)
    output = np.where(computed == prompt, rng.integers(1, 300, n), 0)
    cached = np.where((output == 0) & (rng.random(n) < 0.3), computed, 0)  # not admitted: all computed is cached
    arrival = now - rng.exponential(rng.choice([0.2, 2.0, 20.0]), n)
    ttft = rng.uniform(0.05, 3.0, n)
    tbt = rng.uniform(0.01, 0.3, n)
    tpot = np.where(rng.random(n) < 0.3, tbt, 0.0)
    return {
        "arrival": arrival, "prompt_tokens": prompt, "computed_tokens": computed, "output_tokens": output,
        "ttft_slo": ttft, "tbt_slo": tbt, "protected": rng.random(n) < 0.1,
        "priority": rng.integers(0, rng.choice([1, 2, 4]), n), "sheddable": rng.random(n) < 0.3,
        "e2e_slo": np.where(rng.random(n) < 0.2, ttft + rng.uniform(1, 60, n), 0.0), "tpot_slo": tpot,
        "first_token_time": np.where((tpot > 0) & (output > 0), arrival + ttft * rng.uniform(0.2, 2, n), 0.0),
        "cached_tokens": cached,
    }


def random_snapshots(count: int = 120, seed: int = 2026) -> Iterator[Snapshot]:
    """``count`` random valid snapshots (sizes 0 to 300; some limits tight)."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        n = int(rng.choice([0, 1, 2, 5, 12, 40, 120, 300]))
        now = float(rng.uniform(5, 500))
        cols = _random_columns(rng, n, now)
        yield Snapshot.from_columns(
            now=now, max_batch_tokens=int(rng.choice([16, 256, 2048, 8192])),
            max_num_seqs=int(rng.choice([1, 4, 64, 256])), ids=[f"s{i}r{j}" for j in range(n)],
            free_kv_tokens=None if rng.random() < 0.3 else int(rng.integers(0, 20_000)),
            prefill_throughput=None if rng.random() < 0.3 else float(rng.uniform(500, 20_000)), **cols)


def recorded_snapshots() -> list[Snapshot]:
    with gzip.open(RECORDED, "rt") as f:
        return [Snapshot.from_json(line) for line in f if line.strip()]


def corpus() -> list[Snapshot]:
    return [*random_snapshots(), *recorded_snapshots()]


def plan_text(plan: Plan) -> str:
    """Everything a plan decides, floats to the last bit."""
    parts = [plan.path, str(plan.token_budget), float(plan.predicted_latency_ms).hex(),
             ",".join(f"{a.id}:{a.tokens}" for a in plan.allocations),
             ",".join(f"{r.id}:{r.reason}" for r in plan.rejections), ",".join(plan.preemptions),
             ",".join(f"{r.id}:{r.code}:{float(r.value).hex()}" for r in plan.reasons)]
    return "|".join(parts)


def config_digest(label: str, snaps: list[Snapshot]) -> str:
    """The digest of one configuration's plans over ``snaps`` and every predictor: the
    plan, its reasons as the decision classified them, and as the rules' replay does."""
    _, name, params = next(c for c in CONFIGS if c[0] == label)
    h = hashlib.sha256()
    for pname, pred in predictors():
        policy = registry.create(name, params)  # fresh per predictor: a policy may learn
        for snap in snaps:
            explained = plan_explained(policy, snap, pred)
            replayed = explain(policy, snap, pred, policy.plan(snap, pred))
            h.update(f"{pname}\n{plan_text(explained)}\n{plan_text(replayed)}\n".encode())
    return h.hexdigest()


def digests(snaps: list[Snapshot] | None = None) -> dict[str, str]:
    snaps = corpus() if snaps is None else snaps
    return {label: config_digest(label, snaps) for label, _, _ in CONFIGS}


def record(spec: RunSpec, every: int, limit: int) -> list[Snapshot]:
    """Every ``every``-th snapshot (at most ``limit``) of the simulated engine serving ``spec``
    in process (``clients.bench.runner.run``'s engine, with its snapshots kept)."""
    workload = make_workload(spec.workload, spec.n_requests, spec.rate, seed=spec.seed, classes=spec.classes)
    predictor = profile_predictor(spec.profile)
    profile = PROFILES[spec.profile]
    settings = AdapterSettings(policy=spec.policy, profile=profile.key, report_inline=True)
    adapter = AdapterCore(InProcessBackend(settings, predictor), settings, predictor)
    kept: list[Snapshot] = []
    seen = [0]

    def keep(engine: SimulatedEngine, snap: Snapshot, decision: object) -> None:
        seen[0] += 1
        if len(snap) and len(kept) < limit and seen[0] % every == 0:
            kept.append(snap)

    engine = SimulatedEngine(workload, load_ground_truth(spec.profile), profile, adapter,
                             EngineConfig(noise_seed=spec.seed))
    engine.on_iteration = keep
    try:
        engine.run()
    finally:
        adapter.close()
    return kept


def _record() -> None:
    quiet_logs()
    runs = [RunSpec(policy="slidingserve", workload="mixed-v1", rate=4.0, seed=1, n_requests=300),
            RunSpec(policy="vllm-fcfs", workload="code", rate=8.0, seed=2, n_requests=300),
            RunSpec(policy="slidingserve", workload="mixed-v1", rate=4.0, seed=3, n_requests=300,
                    classes="interactive-batch")]
    lines = [s.to_json() for spec in runs for s in record(spec, every=15, limit=50)]
    DATA.mkdir(exist_ok=True)
    with gzip.open(RECORDED, "wt") as f:
        f.write("\n".join(lines) + "\n")
    print(f"recorded {len(lines)} snapshots into {RECORDED}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="re-record the simulated engine's snapshots")
    ap.add_argument("--pin", action="store_true", help="write the corpus digests as the expected ones")
    args = ap.parse_args(argv)
    if args.record:
        _record()
    if args.pin:
        DIGESTS.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
        print(f"pinned {len(CONFIGS)} digests into {DIGESTS}")


if __name__ == "__main__":
    main()
