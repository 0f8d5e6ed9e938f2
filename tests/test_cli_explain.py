"""``slidingserve explain``: one row per request, a reason for every one not fully served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.snapshots import busy_snapshot
from clients.cli import main
from scheduler_service.core import Snapshot, default_predictor, registry
from scheduler_service.core.reasons import CODES, plan_explained

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def snap_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "busy.json"
    path.write_text(busy_snapshot(n_decode=40, n_queued=60, seed=3).to_json())
    return path


def _table(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    assert lines[1].split() == ["id", "state", "remaining", "slack_ms", "tokens", "reason", "value"]
    return {cells[0]: cells for cells in (line.split() for line in lines[2:])}


def test_every_request_not_fully_served_shows_a_known_code(snap_file: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    assert main(["explain", "--snapshot", str(snap_file)]) == 0
    out = capsys.readouterr().out
    table = _table(out)
    snap = Snapshot.from_json(snap_file.read_text())
    assert set(table) == set(snap.ids)
    plan = registry.create("slidingserve").plan(snap, default_predictor())
    got = plan.tokens_by_id()
    need = dict(zip(snap.ids, snap.remaining_prefill.tolist(), strict=True))
    waiting = [rid for rid, dec in zip(snap.ids, snap.is_decoding.tolist(), strict=True)
               if got.get(rid, 0) < (1 if dec else need[rid])]
    assert waiting, "the busy snapshot leaves requests waiting"
    for rid, cells in table.items():
        if rid in waiting:
            assert len(cells) == 7 and cells[5] in CODES, cells
            assert cells[1] in ("decode", "prefill", "waiting")
        else:
            assert len(cells) == 5, cells  # reason and value blank
    ids = list(table)  # the waiting ones first
    assert set(ids[:len(waiting)]) == set(waiting)
    assert "waiting:" in out.splitlines()[0]


def test_json_is_the_explained_plan(snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--snapshot", str(snap_file), "--policy", "sarathi", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    snap = Snapshot.from_json(snap_file.read_text())
    expected = plan_explained(registry.create("sarathi"), snap, default_predictor())
    assert out["reasons"] == [{"id": r.id, "code": r.code, "value": r.value} for r in expected.reasons]
    assert out["allocations"] == [{"id": a.id, "tokens": a.tokens} for a in expected.allocations]


def test_the_installed_command_runs(snap_file: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "clients.cli", "explain", "--snapshot", str(snap_file),
                        "--param", "window=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert any(code in r.stdout for code in CODES)


@pytest.mark.parametrize("content", [None, "{not json", '{"now": "x"}'])
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path: Path, content: str | None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "snap.json"
    if content is not None:
        path.write_text(content)
    code = main(["explain", "--snapshot", str(path)])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
    assert "Traceback" not in err


def test_unknown_policy_and_bad_param(snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--policy", "nope"], ["--param", "window"], ["--param", "window=-3"]):
        assert main(["explain", "--snapshot", str(snap_file), *argv]) != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
