"""The traffic recording (scheduler_service/recording.py) and ``slidingserve whatif``
(clients/whatif.py): a simulated engine on a real trace and real profile records its
traffic, in process and through the service over real gRPC; the what-if reads it back."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.bench.runner import profile_predictor
from clients.whatif import Candidate, parse_candidates, parse_loads, recorded_outcome, run_whatif
from clients.workloads import make_workload
from engine_adapter.core import AdapterCore, AdapterSettings
from engine_adapter.inprocess import InProcessBackend
from engine_adapter.remote import GrpcBackend
from engine_adapter.sim.engine import EngineConfig, SimulatedEngine, Workload
from engine_adapter.sim.groundtruth import DEFAULT_PROFILE, PROFILES, load_ground_truth
from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.recording import FORMAT, Recorder, RecordingError, read_recording
from tests.grpc_support import make_server, mixed_snapshot

KEY = PROFILES[DEFAULT_PROFILE].key


def _run(w: Workload, settings: AdapterSettings, backend: object | None = None) -> tuple[float, AdapterCore]:
    """``w`` through the simulated engine; its SLO attainment and the adapter core."""
    pred = profile_predictor(DEFAULT_PROFILE)
    core = AdapterCore(backend or InProcessBackend(settings, pred), settings, pred)  # type: ignore[arg-type]
    try:
        res = SimulatedEngine(w, load_ground_truth(DEFAULT_PROFILE), PROFILES[DEFAULT_PROFILE], core,
                              EngineConfig(noise_seed=1)).run()
    finally:
        core.close()
    return 1.0 - res.summary()["violation_rate"], core


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workload, float]:
    """mixed-v1 past vLLM's capacity, served by vllm-fcfs in process, recorded."""
    d = tmp_path_factory.mktemp("rec")
    w = make_workload("mixed-v1", 240, 2.5, seed=3)
    s = AdapterSettings(policy="vllm-fcfs", profile=KEY, report_inline=True, record=str(d), engine_id="e1")
    attained, _ = _run(w, s)
    return d, w, attained


def test_the_recording_holds_each_request_as_the_engine_ran_it(recorded: tuple[Path, Workload, float]) -> None:
    d, w, attained = recorded
    rec = read_recording(d)
    assert rec.engine == "e1" and rec.policies == {"vllm-fcfs": len(w)}
    assert rec.info["max_batch_tokens"] == 2048
    np.testing.assert_array_equal(rec.requests["prompt"], w.prompt_tokens)
    np.testing.assert_array_equal(rec.requests["output"], w.output_tokens)
    np.testing.assert_allclose(rec.requests["ttft_slo"], w.ttft_slo)
    assert len(rec.latency_ms) > 1000 and rec.features.shape == (len(rec.latency_ms), 7)
    # each iteration is stamped on the requests' clock, in order, the gaps its measured times
    at = rec.iteration_at
    assert at.shape == rec.latency_ms.shape and np.isfinite(at).all() and (np.diff(at) >= 0).all()
    assert rec.requests["arrival"].min() <= at[0] < np.nanmax(rec.requests["first_token"])
    busy = np.diff(at) < 0.5  # not across an idle stretch
    assert np.median(np.abs(np.diff(at)[busy] * 1e3 - rec.latency_ms[1:][busy])) < 0.05 * np.median(rec.latency_ms)
    # the outcome read off the snapshots is the engine's own, to a request or two
    assert abs(recorded_outcome(rec)["attain_f1"] - attained) <= 2 / len(w)


def test_no_text_token_or_request_ids_are_recorded(tmp_path: Path) -> None:
    w = make_workload("code", 30, 1.0, seed=1)
    s = AdapterSettings(policy="slidingserve", profile=KEY, report_inline=True, record=str(tmp_path))
    _run(w, s)
    lines = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert lines[0]["format"] == FORMAT
    keys = set().union(*(x.keys() for x in lines))
    assert not keys & {"id", "ids", "prompt_ids", "text", "request_id"}
    ids = {f"r{i}" for i in range(len(w))}  # the simulated engine's request ids
    assert not any(v in ids for x in lines for v in x.values() if isinstance(v, str))
    assert len([x for x in lines if x.get("t") == "request"]) == len(w)


def test_the_service_records_its_engines_and_answers_whatif_over_grpc(tmp_path: Path) -> None:
    """An engine scheduled by the service through a real ScheduleStream, reporting its
    iterations: the service's recording names the engine and the deployment that served it,
    and the WhatIf RPC replays it; bad requests get INVALID_ARGUMENT with the fields."""
    server = make_server(record=str(tmp_path / "rec")).start()
    try:
        s = AdapterSettings(policy="sarathi", params={"chunk_size": "256"}, profile=KEY, engine_id="gpu-7",
                            deadline_ms=2000)
        w = make_workload("mixed-v1", 40, 1.0, seed=2)
        _, core = _run(w, s, GrpcBackend(server.target, s))
        assert core.remote_decisions > 0, core.stats()
        with SchedulerClient(server.target, timeout_s=600) as client:
            # decisions go on while the what-if replays (in a process of its own)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(client.whatif, ["qoserve"], [1.0])
                time.sleep(0.3)  # the what-if takes seconds: its child has barely started
                with pytest.raises(SchedulerError) as busy:  # one what-if at a time
                    client.whatif()
                decided = 0
                while not running.done():
                    decided += bool(client.schedule(mixed_snapshot(1, 4, 4), policy="slidingserve").allocations)
                    time.sleep(0.2)
                doc = running.result()
            assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and decided > 3
            with pytest.raises(SchedulerError) as bad:
                client.whatif(["x,y"], [0.0, 2.0])
            with pytest.raises(SchedulerError) as unknown:
                client.whatif(engine_id="gpu-9")
    finally:
        server.stop(0)
    assert doc["served"] == "sarathi:chunk_size=256 (served)"
    assert {r["policy"] for r in doc["rows"]} == {"sarathi:chunk_size=256 (served)", "vllm-fcfs", "qoserve"}
    assert "| 1x" in doc["table"]
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert {v.field for v in bad.value.violations} == {"deployments[0]", "loads[0]"}
    assert unknown.value.code == grpc.StatusCode.FAILED_PRECONDITION and "gpu-9" in str(unknown.value)
    rec = read_recording(tmp_path / "rec")
    assert rec.engine == "gpu-7" and set(rec.policies) == {"sarathi:chunk_size=256"}
    assert len(rec) == 40 and len(rec.latency_ms) > 1000


def test_whatif_needs_the_service_to_record() -> None:
    server = make_server().start()
    try:
        with SchedulerClient(server.target, timeout_s=10) as client, pytest.raises(SchedulerError) as e:
            client.whatif()
    finally:
        server.stop(0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "record" in str(e.value)


def test_the_recording_stays_within_its_bound(tmp_path: Path) -> None:
    w = make_workload("mixed-v1", 400, 3.0, seed=4)
    s = AdapterSettings(policy="vllm-fcfs", profile=KEY, report_inline=True, engine_id="e")
    r = Recorder(tmp_path, max_bytes=200_000, file_bytes=50_000, inline=True)
    for sample in _samples(w, s):
        r.offer_iteration("e", *sample)
    r.close()
    sizes = [f.stat().st_size for f in tmp_path.glob("recording-*.jsonl")]
    assert 1 < len(sizes) <= 4 and sum(sizes) <= 200_000 + 4096
    with pytest.raises(RecordingError, match="no finished request"):
        read_recording(tmp_path)


def _samples(w: Workload, s: AdapterSettings) -> list[tuple[np.ndarray, int, float]]:
    from scheduler_service.core.features import batch_features

    rng = np.random.default_rng(0)
    out = []
    for _ in range(4000):
        c = rng.integers(1, 64, rng.integers(1, 30))
        x, sc = batch_features(c, rng.integers(0, 2000, len(c)))
        out.append((x, sc, float(rng.uniform(5, 50))))
    return out


@pytest.mark.parametrize(("setup", "message"), [
    (lambda d: None, "no recording files"),
    (lambda d: (d / "recording-x.jsonl").write_text('{"format": "slidingserve-recording", "version": 9}\n'),
     "format version 9"),
    (lambda d: (d / "recording-x.jsonl").write_text("hello\n"), "not a recording"),
    (lambda d: (d / "recording-x.jsonl").write_text(
        '{"format": "slidingserve-recording", "version": 1}\n{"t": "request", "arri\n{}\n'), "truncated or corrupt"),
    (lambda d: (d / "recording-x.jsonl").write_text('{"format": "slidingserve-recording", "version": 1}\n'),
     "no finished request"),
])
def test_a_recording_it_cannot_use_gets_one_line(tmp_path: Path, setup, message: str) -> None:  # type: ignore[no-untyped-def]
    setup(tmp_path)
    with pytest.raises(RecordingError, match=message) as e:
        read_recording(tmp_path)
    assert "\n" not in str(e.value)


def test_whatif_replays_the_served_policy_close_to_its_recording(recorded: tuple[Path, Workload, float]) -> None:
    d, _, _ = recorded
    w = run_whatif(read_recording(d), [Candidate("slidingserve", "slidingserve", {})], [1.0, 1.5])
    assert {r["policy"] for r in w.rows} == {"vllm-fcfs (served)", "slidingserve"}
    assert abs(w.error["attain_f1"]) <= 5 and abs(w.error["attain_tpot"]) <= 5
    assert not any("misses what this engine recorded" in n for n in w.notes)
    at = {(r["policy"], r["load"]): r for r in w.rows}
    # more load, no more requests within SLO, for the same policy
    assert at[("vllm-fcfs (served)", 1.5)]["attain_f1"] <= at[("vllm-fcfs (served)", 1.0)]["attain_f1"]


def test_whatif_predicts_slidingserve_from_a_vllm_recording(recorded: tuple[Path, Workload, float],
                                                           tmp_path: Path) -> None:
    """Recorded under vllm-fcfs, predicted for slidingserve; then slidingserve run on the
    same arrivals and recorded: the prediction within 10 points of the run."""
    d, w, _ = recorded
    pred = run_whatif(read_recording(d), parse_candidates("slidingserve"), [1.0])
    guess = next(r for r in pred.rows if r["policy"] == "slidingserve")
    s = AdapterSettings(policy="slidingserve", profile=KEY, report_inline=True)
    attained, _ = _run(w, s)
    assert abs(guess["attain_f1"] - attained) <= 0.10


def test_the_cost_model_needs_enough_iterations(tmp_path: Path) -> None:
    w = make_workload("code", 25, 0.5, seed=1)
    s = AdapterSettings(policy="vllm-fcfs", profile=KEY, report_inline=True, record=str(tmp_path))
    _run(w, s)
    rec = read_recording(tmp_path)
    rec = type(rec)(rec.engine, rec.info, rec.policies, rec.requests, rec.features[:50], rec.scenarios[:50],
                    rec.latency_ms[:50], rec.files)
    with pytest.raises(RecordingError, match="needs at least 200"):
        run_whatif(rec, [], [1.0])


def test_bad_candidates_and_loads_are_refused() -> None:
    with pytest.raises(ValueError, match="nosuch"):
        parse_candidates("nosuch")
    with pytest.raises(ValueError, match="key=value"):
        parse_candidates("slidingserve:margin")
    with pytest.raises(ValueError, match="margin"):
        parse_candidates("slidingserve:margin=-3")
    assert parse_candidates("v2,qoserve", {"v2": ("slidingserve", {"margin": "1.2"})})[0] == Candidate(
        "v2", "slidingserve", {"margin": "1.2"})
    with pytest.raises(ValueError, match="--load"):
        parse_loads("1,x")
    with pytest.raises(ValueError, match=r"\(0, 20\]"):
        parse_loads("0")


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path: Path, recorded: tuple[Path, Workload, float]) -> None:
    bad = subprocess.run([sys.executable, "-m", "clients.cli", "whatif", "--recording", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such directory" in bad.stderr
    d, _, _ = recorded
    ok = subprocess.run([sys.executable, "-m", "clients.cli", "whatif", "--recording", str(d), "--load", "1",
                         "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert "| 1x" in ok.stdout and "vllm-fcfs (served)" in ok.stdout
    assert (tmp_path / "out" / "whatif.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "whatif.json").read_text())["served"] == "vllm-fcfs (served)"


def test_whatif_says_when_several_policies_served(recorded: tuple[Path, Workload, float], tmp_path: Path) -> None:
    """A deployment switched in the middle of the recording: the requests written after it
    count for the new policy, and the answer says the traffic is replayed as the last one."""
    d, _, _ = recorded
    src = sorted(d.glob("recording-*.jsonl"))[0].read_text().splitlines()
    at = [i for i, ln in enumerate(src) if '"t":"request"' in ln][99] + 1  # after the 100th request
    switch = json.dumps({"t": "engine", "engine": "e1", "policy": "slidingserve", "params": {}, "deployment": "v2",
                         "max_batch_tokens": 2048, "max_num_seqs": 256})
    (tmp_path / "recording-a.jsonl").write_text("\n".join([*src[:at], switch, *src[at:]]) + "\n")
    rec = read_recording(tmp_path)
    assert rec.policies["vllm-fcfs"] + rec.policies["slidingserve"] == 240 and rec.policies["vllm-fcfs"] == 100
    w = run_whatif(rec, [], [1.0])
    assert w.served == "slidingserve (served)" and any("several policies" in n for n in w.notes)


def test_whatif_warns_when_its_replay_misses_the_recording(recorded: tuple[Path, Workload, float],
                                                           tmp_path: Path) -> None:
    """Every third request recorded late (formula (1)) that the replay serves on time: the
    answer names the replay's error and the differences it cannot tell apart."""
    d, _, _ = recorded
    lines = []
    for k, ln in enumerate(sorted(d.glob("recording-*.jsonl"))[0].read_text().splitlines()):
        doc = json.loads(ln)
        if doc.get("t") == "request" and doc["finished"] and k % 3 == 0:
            doc["late_s"] = 0.5
        lines.append(json.dumps(doc))
    (tmp_path / "recording-a.jsonl").write_text("\n".join(lines) + "\n")
    w = run_whatif(read_recording(tmp_path), [], [1.0])
    assert w.error["attain_f1"] > 5
    note = next(n for n in w.notes if "misses what this engine recorded" in n)
    assert f"{w.error['attain_f1']:+.1f} points under formula (1)" in note and "TTFT+TPOT" not in note
