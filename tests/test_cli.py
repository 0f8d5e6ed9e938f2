"""The ``slidingserve`` CLI: its names, formats and exit codes are public interface."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from clients.cli import main
from scheduler_service.core import (
    BatchLatencyPredictor,
    Snapshot,
    batch_features,
    default_predictor,
    registry,
)
from scheduler_service.core.predictor import N_FEATURES
from tests.grpc_support import make_server, mixed_snapshot

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "snapshot.json"
PLAN_KEYS = {"policy", "policy_version", "predictor_version", "path", "token_budget",
             "predicted_latency_ms", "allocations", "decision_us"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_offline_prints_the_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--snapshot", str(EXAMPLE))
    assert code == 0, err
    plan = json.loads(out)
    assert PLAN_KEYS <= set(plan)
    snap = Snapshot.from_json(EXAMPLE.read_text())
    expected = registry.create("slidingserve").plan(snap, default_predictor())
    assert plan["allocations"] == [{"id": a.id, "tokens": a.tokens} for a in expected.allocations]
    assert plan["token_budget"] == sum(a["tokens"] for a in plan["allocations"])


def test_plan_param_window_overrides_and_changes_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "plan", "--snapshot", str(EXAMPLE), "--param", "window=1")
    plan = json.loads(out)
    assert plan["policy_version"] != registry.describe("slidingserve")["version"]
    assert plan["policy_version"].startswith(registry.describe("slidingserve")["version"] + "+")


def test_plan_with_every_policy_and_a_predictor_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pfile = tmp_path / "p.json"
    pfile.write_text(default_predictor().to_json())
    for name in registry.names():
        code, out, err = run(capsys, "plan", "--snapshot", str(EXAMPLE), "--policy", name,
                             "--predictor", str(pfile))
        assert code == 0, err
        assert json.loads(out)["policy"] == name


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--snapshot", "/nonexistent.json"], "cannot read snapshot"),
        (["plan", "--snapshot", str(EXAMPLE), "--param", "windw=1"], "params.windw"),
        (["plan", "--snapshot", str(EXAMPLE), "--param", "window=9"], "params.window"),
        (["plan", "--snapshot", str(EXAMPLE), "--param", "window"], "KEY=VALUE"),
        (["plan", "--snapshot", str(EXAMPLE), "--policy", "nope"], "unknown policy 'nope'"),
        (["plan"], "--snapshot"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err
    assert "Traceback" not in err


def test_bad_snapshot_content_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(EXAMPLE.read_text())
    data["requests"][0]["computed_tokens"] = 5000
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, _, err = run(capsys, "plan", "--snapshot", str(bad))
    assert code == 2
    assert "requests[0].computed_tokens" in err
    bad.write_text("{not json")
    code, _, err = run(capsys, "plan", "--snapshot", str(bad))
    assert code == 2 and "not valid JSON" in err


def test_policies_lists_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "policies", "--json")
    assert code == 0
    info = json.loads(out)
    assert [p["name"] for p in info["policies"]] == registry.names()
    code, out, _ = run(capsys, "policies")
    assert code == 0 and "--param window=2" in out


def test_plan_and_policies_through_a_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    snap = mixed_snapshot(seed=3)
    f = tmp_path / "s.json"
    f.write_text(snap.to_json())
    with make_server() as server:
        code, out, err = run(capsys, "plan", "--snapshot", str(f), "--server", server.target,
                             "--param", "window=3")
        assert code == 0, err
        remote = json.loads(out)
        code, out, _ = run(capsys, "plan", "--snapshot", str(f), "--param", "window=3")
        local = json.loads(out)
        assert remote["allocations"] == local["allocations"]
        assert remote["path"] == local["path"]
        code, out, _ = run(capsys, "policies", "--json", "--server", server.target)
        assert code == 0
        assert [p["name"] for p in json.loads(out)["policies"]] == registry.names()
        code, out, err = run(capsys, "plan", "--snapshot", str(f), "--server", server.target,
                             "--param", "window=0")
        assert code == 2 and "params.window" in err and len(err.strip().splitlines()) == 1


def test_server_unreachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "--snapshot", str(EXAMPLE), "--server", "127.0.0.1:1",
                       "--timeout", "0.5")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _write_samples(path: Path, pred: BatchLatencyPredictor, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([f"x{i}" for i in range(1, N_FEATURES + 1)] + ["latency_ms"])
        for _ in range(n):
            n_dec = int(rng.integers(0, 64))
            chunk = int(rng.integers(0, 2048)) if n_dec else int(rng.integers(2, 2048))
            c = np.concatenate([np.ones(n_dec), [chunk] if chunk > 1 else []])
            u = rng.integers(0, 4096, len(c)).astype(float)
            x, _ = batch_features(c, u)
            w.writerow([*x.tolist(), pred.predict_batch_ms(c, u) * (1 + rng.normal(0, 0.01))])


def test_predictor_fit_recovers_a_known_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = default_predictor()
    samples = tmp_path / "samples.csv"
    _write_samples(samples, truth, 600, seed=1)
    out_file = tmp_path / "fitted.json"
    code, _, err = run(capsys, "predictor", "fit", "--csv", str(samples), "--out", str(out_file))
    assert code == 0, err
    assert "held-out" in err and "R²" in err
    fitted = BatchLatencyPredictor.from_json(out_file.read_text())
    rng = np.random.default_rng(2)
    for _ in range(50):
        c = np.concatenate([np.ones(int(rng.integers(1, 32))), [int(rng.integers(2, 1024))]])
        u = rng.integers(0, 2048, len(c)).astype(float)
        assert fitted.predict_batch_ms(c, u) == pytest.approx(truth.predict_batch_ms(c, u), rel=0.1)
    code, out, _ = run(capsys, "predictor", "show", "--file", str(out_file))
    assert code == 0 and json.loads(out)["version"] == fitted.version


def test_predictor_fit_bad_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("x1,x2\n1,2\n")
    code, _, err = run(capsys, "predictor", "fit", "--csv", str(bad))
    assert code == 2 and "missing columns" in err


def test_policies_lists_the_servers_deployments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    conf = tmp_path / "p.json"
    conf.write_text(json.dumps({"default": "v2", "deployments": {"v1": {"policy": "vllm-fcfs"},
                                "v2": {"policy": "slidingserve", "params": {"window": 3}}}, "shadow": "v1"}))
    with make_server(policy_config=str(conf)) as server:
        code, out, err = run(capsys, "policies", "--server", server.target)
        assert code == 0, err
        lines = [ln for ln in out.splitlines() if ln.startswith("deployment ")]
        assert len(lines) == 2
        assert lines[0].startswith("deployment v1 (shadow): vllm-fcfs  (policy version ")
        assert lines[1].startswith("deployment v2 (default): slidingserve window=3  (policy version ")
        code, out, _ = run(capsys, "policies", "--json", "--server", server.target)
        info = json.loads(out)
        assert [d["name"] for d in info["deployments"]] == ["v1", "v2"]
        assert info["versions"] == info["deployments"]  # the pre-rename key, kept for scripts
        # plan --deployment pins one (the wire's ScheduleRequest.policy); the default otherwise
        snap = tmp_path / "s.json"
        snap.write_text(mixed_snapshot(seed=3).to_json())
        for argv, want in ((["--deployment", "v1"], "v1"), ([], "v2"), (["--policy", "v1"], "v1")):
            code, out, err = run(capsys, "plan", "--snapshot", str(snap), "--server", server.target, *argv)
            assert code == 0, err
            assert json.loads(out)["deployment"] == want
        code, _, err = run(capsys, "plan", "--snapshot", str(snap), "--server", server.target,
                           "--deployment", "v9")
        assert code == 2 and "v9" in err and len(err.strip().splitlines()) == 1


def test_plan_deployment_needs_a_server_and_excludes_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "--snapshot", str(EXAMPLE), "--deployment", "v1")
    assert code == 2 and "needs --server" in err
    code, _, err = run(capsys, "plan", "--snapshot", str(EXAMPLE), "--server", "localhost:1",
                       "--deployment", "v1", "--policy", "sarathi")
    assert code == 2 and "not both" in err
