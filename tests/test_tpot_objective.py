"""The TPOT objective (``tpot_slo``): a request judged as ``vllm bench serve --goodput``
judges it (TTFT, then the mean time per output token), through the snapshot, its
validation, the simulated engine's judge, the workloads and the vLLM adapter's SLO parsing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.snapshots import busy_snapshot
from clients.bench.runner import profile_predictor, quiet_logs
from clients.workloads import SLOConfig, make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.sim.engine import SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from engine_adapter.vllm.snapshot import ClassSlo, SloDefaults, request_slo
from scheduler_service.core import Snapshot, ValidationError
from scheduler_service.core.columns import COLUMNS


def _cols(snap: Snapshot) -> dict[str, np.ndarray]:
    return {c.name: np.array(getattr(snap, c.name)) for c in COLUMNS}


def _scalars(snap: Snapshot) -> dict[str, object]:
    return {"now": snap.now, "max_batch_tokens": snap.max_batch_tokens, "max_num_seqs": snap.max_num_seqs,
            "free_kv_tokens": snap.free_kv_tokens}


def _paced(seed: int, share: float = 0.5) -> tuple[Snapshot, Snapshot]:
    """A busy snapshot, and the same with a TPOT objective on about ``share`` of the rows
    (decodes get a first-token time between arrival and now)."""
    base = busy_snapshot(40, 60, seed=seed)
    rng = np.random.default_rng(seed)
    cols = _cols(base)
    n = len(base)
    on = rng.uniform(size=n) < share
    cols["tpot_slo"] = np.where(on, rng.uniform(0.005, 0.2, n), 0.0)
    span = np.maximum(base.now - cols["arrival"], 0.0)
    cols["first_token_time"] = cols["arrival"] + rng.uniform(0, 1, n) * span
    return base, Snapshot.from_columns(ids=base.ids, **_scalars(base), **cols)


@pytest.mark.parametrize("seed", range(5))
def test_a_paced_decode_counts_its_slack_from_its_first_token(seed: int) -> None:
    base, snap = _paced(seed)
    k = np.where(snap.is_decoding, snap.output_tokens, 0)
    f1 = snap.arrival + snap.ttft_slo + k * snap.tbt_slo - snap.now
    pace = snap.first_token_time + k * snap.tpot_slo - snap.now
    paced = snap.is_decoding & (snap.tpot_slo > 0)
    assert 5 <= paced.sum() < snap.is_decoding.sum()  # both kinds are there
    assert np.array_equal(snap.paced, paced)
    assert np.array_equal(snap.slack, np.where(paced, pace, f1))
    # a prefill with a TPOT objective still has its TTFT slack; no objective: formula (1), bit for bit
    assert np.array_equal(snap.slack[~snap.is_decoding], f1[~snap.is_decoding])
    assert base.slack.tobytes() == f1.tobytes() and not base.any_tpot and snap.any_tpot


def test_a_paced_decode_without_a_first_token_time_is_refused_with_the_field_named() -> None:
    _, snap = _paced(1)
    row = int(np.flatnonzero(snap.paced)[0])
    cols = _cols(snap)
    cols["first_token_time"][row] = cols["arrival"][row] - 1.0
    with pytest.raises(ValidationError) as e:
        Snapshot.from_columns(ids=snap.ids, **_scalars(snap), **cols)
    assert f"requests[{row}].first_token_time" in str(e.value)
    doc = json.loads(snap.to_json())
    del doc["requests"][row]["first_token_time"]
    with pytest.raises(ValidationError, match=rf"requests\[{row}\]\.first_token_time: must be set"):
        Snapshot.from_json(json.dumps(doc))
    # the fast path (engines' typed columns) refuses it too
    cols["tpot_slo"][row] = -1.0
    with pytest.raises(ValidationError, match=rf"requests\[{row}\]\.tpot_slo"):
        Snapshot.from_arrays(ids=snap.ids, columns=cols, **_scalars(snap))  # type: ignore[arg-type]


# ---------------------------------------------------------------- the simulated judge
def _one(tbt: float, tpot: float, out: int = 40) -> Workload:
    return Workload(arrival=np.array([0.0]), prompt_tokens=np.array([200]), output_tokens=np.array([out]),
                    ttft_slo=np.array([0.3]), tbt_slo=np.array([tbt]), protected=np.zeros(1, bool),
                    tpot_slo=np.array([tpot]))


def _violated(w: Workload) -> tuple[bool, float, bool]:
    quiet_logs()
    pred = profile_predictor(DEFAULT_PROFILE)
    settings = AdapterSettings(policy="slidingserve", profile=DEFAULT_PROFILE, report_inline=True)
    adapter = AdapterCore(InProcessBackend(settings, pred), settings, pred)
    try:
        eng = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILES[DEFAULT_PROFILE], adapter)
        res = eng.run()
    finally:
        adapter.close()
    mean = (eng.last_token[0] - eng.first_token[0]) / (w.output_tokens[0] - 1)
    return bool(res.violated[0]), float(mean), bool(eng.late_f1[0])


def test_the_simulator_judges_a_tpot_request_by_ttft_and_its_mean() -> None:
    # a per-token TBT no engine meets: violated under formula (1) ...
    bad_f1, mean, late = _violated(_one(tbt=1e-4, tpot=0.0))
    assert bad_f1 and late
    # ... met under a TPOT objective of twice the mean it gets (formula (1) still records
    # the late tokens), missed under half of it
    assert _violated(_one(tbt=1e-4, tpot=2 * mean)) == (False, pytest.approx(mean, rel=0.2), True)
    assert _violated(_one(tbt=1e-4, tpot=mean / 2))[0]
    # TTFT still counts: a prompt that cannot be prefilled in 1 µs misses
    w = _one(tbt=1.0, tpot=1.0)
    w2 = Workload(arrival=w.arrival, prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens,
                  ttft_slo=np.array([1e-6]), tbt_slo=w.tbt_slo, protected=w.protected, tpot_slo=w.tpot_slo)
    assert _violated(w2)[0]


def test_workloads_under_the_tpot_definition_carry_the_objective() -> None:
    a = make_workload("sharegpt", 50, 2.0, seed=3)
    b = make_workload("sharegpt", 50, 2.0, seed=3, slo=SLOConfig(definition="tpot"))
    assert not a.tpot_slo.any()
    assert np.array_equal(b.tpot_slo, b.tbt_slo) and np.array_equal(a.arrival, b.arrival)
    with pytest.raises(ValueError, match="unknown SLO definition 'p99'"):
        SLOConfig(definition="p99")


def test_bench_refuses_an_unknown_definition_in_one_line() -> None:
    p = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "--slo-definition", "p99"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "invalid choice: 'p99'" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- vLLM's extra_args
def test_vllm_requests_carry_a_tpot_objective_from_extra_args_or_their_class() -> None:
    d = SloDefaults(ttft_s=1.0, classes={3: ClassSlo(tpot_s=0.08)})
    assert request_slo(None, 100, d).tpot_s == 0.0
    assert request_slo({"slo_tpot_ms": 40}, 100, d).tpot_s == 0.04
    assert request_slo({"slo": {"tpot_ms": 25}}, 100, d).tpot_s == 0.025
    assert request_slo(None, 100, d, priority=3).tpot_s == 0.08
    assert request_slo({"slo_tpot_ms": 30}, 100, d, priority=3).tpot_s == 0.03  # the request's own wins
    for bad in ("fast", -5, float("nan"), None, [1]):
        assert request_slo({"slo_tpot_ms": bad}, 100, d).tpot_s == 0.0  # malformed: no objective, no error
    assert request_slo({"slo_tpot_ms": 1e300}, 100, d).tpot_s == 1e12  # within the snapshot's bound


# ---------------------------------------------------------------- the policies plan for it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from scheduler_service.core import BatchLatencyPredictor, default_predictor, plan_violations, registry  # noqa: E402
from tests.reach import Reached  # noqa: E402
from tests.strategies import NOW, predictors, snapshots  # noqa: E402

SITTING = [registry.create("slidingserve", {}), registry.create("slidingserve", {"sit_out_when": "waiting"}),
           registry.create("slidingserve", {"decode_skip_tbts": 2}),
           registry.create("slidingserve", {"decode_skip_tbts": 2, "sit_out_when": "waiting"}),
           registry.create("sarathi-edf+sc+mlps", {})]
REACHED = Reached()


@st.composite
def paced_crowds(draw: st.DrawFn) -> Snapshot:
    """Random snapshots a little later, with fresh prompts waiting, room for every decode
    (no KV, sequence or budget limit), and a TPOT objective on some decodes whose first token came
    at random times: paced decodes ahead of and behind their pace beside live prefills."""
    snap = draw(snapshots(max_n=12, max_prompt=160, max_bmax=256))
    d = snap.to_dict()
    d["now"] = NOW + draw(st.sampled_from([0.0, 0.3, 1.0]))
    d["max_num_seqs"], d["free_kv_tokens"] = 1000, None
    d["max_batch_tokens"] = max(d["max_batch_tokens"], len(d["requests"]) + 3)  # every decode fits the budget
    for i in range(draw(st.integers(1, 3))):
        d["requests"].append({"id": f"fresh{i}", "arrival": d["now"] - 0.01 * i,
                              "prompt_tokens": draw(st.integers(16, 400)), "computed_tokens": 0,
                              "output_tokens": 0, "ttft_slo": draw(st.sampled_from([0.05, 0.3, 2.0])),
                              "tbt_slo": 0.05})
    for r in d["requests"]:
        if r["output_tokens"] > 0 and draw(st.booleans()):
            r["tpot_slo"] = draw(st.sampled_from([0.005, 0.02, 0.05, 0.2]))
            at = draw(st.one_of(st.floats(0, 1), st.sampled_from([0.0, 0.9, 1.0])))  # 1: first token just now
            r["first_token_time"] = r["arrival"] + at * max(d["now"] - r["arrival"], 0.0)
    return Snapshot.from_json(d)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(paced_crowds(), st.sampled_from(range(len(SITTING))),
       st.one_of(st.just(default_predictor()), predictors(), predictors(negative=True)))
def _paced_decodes_sit_out_only_ahead_of_their_pace(snap: Snapshot, k: int, pred: BatchLatencyPredictor) -> None:
    policy = SITTING[k]
    plan = policy.plan(snap, pred)
    assert not plan_violations(snap, plan)
    got = plan.tokens_by_id()
    skip = float(policy.params.decode_skip_tbts)
    paced = np.flatnonzero(snap.paced)
    if not len(paced):
        return
    REACHED()
    for i in paced:
        if got.get(snap.ids[i], 0) == 0:  # sat out: only far ahead of its pace
            REACHED("sat out")
            assert snap.slack[i] > skip * snap.tpot_slo[i], (snap.ids[i], snap.slack[i], snap.tpot_slo[i])
        elif snap.slack[i] <= 0:
            REACHED("behind its pace, served")


def test_paced_decodes_sit_out_only_ahead_of_their_pace() -> None:
    REACHED.floor(_paced_decodes_sit_out_only_ahead_of_their_pace, checked=80, **{"sat out": 20,
                  "behind its pace, served": 20})
