"""The live benchmark (``make live-bench``) end to end, small: a real ``vllm serve`` with
vLLM's own scheduler and one with the adapter, in process and through a real
``slidingserve serve``, driven by the streaming ``openai`` client and judged by vLLM's own
``bench serve``; the report and plot it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = ("vllm", "inproc:slidingserve", "remote:slidingserve")


def _live(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIDINGSERVE_", "VLLM_"))}
    return subprocess.run([sys.executable, "-m", "clients.live", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.timeout(1500)
def test_live_bench_small_sweep(tmp_path: Path) -> None:
    out = tmp_path / "live"
    # the rate as a multiple of a given capacity; vLLM's own scheduler runs twice (the A/A floor)
    r = _live(["--configs", " ".join(CONFIGS), "--capacity", "2", "--loads", "1", "--seeds", "1", "--requests", "12",
               "--warmup", "6", "--judge-seeds", "1", "--out", str(out)], timeout=1400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(x["config"] for x in runs) == sorted([*CONFIGS, "vllm-again"])
    assert all((x["rate"], x["load"], x["capacity_rps"]) == (2.0, 1.0, 2.0) for x in runs)
    assert all(x["foreign_before"] >= 0 and isinstance(x["shared"], bool) for x in runs)
    for x in runs:
        # every request answered in full; nothing lost whatever the policy did
        assert (x["requests"], x["completed"], x["errors"]) == (12, 12, 0), x
        assert 0.0 <= x["attain_tpot"] <= 1.0 and 0.0 <= x["attain_f1"] <= 1.0
        assert 0 < x["ttft_p50_ms"] <= x["ttft_max_ms"]
        j = x["judge"]  # vLLM's own client replayed the same requests
        assert j["completed"] == 12 and j["failed"] == 0, j
        # vLLM's own timings of the same requests, beside the client's
        t = x["vllm_timings"]
        assert 0 < t["ttft_mean_ms"] <= x["client"]["ttft_mean_ms"] and t["itl_mean_ms"] > 0, (t, x["client"])
        assert x["client"]["send_late_max_ms"] >= 0
        if x["mode"] != "native":
            a = x["adapter"]
            # the policy planned the run: most iterations from plans, not vLLM's fallback
            assert a["planned"] > 0.5 * a["iterations"] > 0, a
    remote = next(x for x in runs if x["mode"] == "remote")
    assert remote["service_reports"] > 0 and remote["service_mae_ms"] is not None
    # how the service's predictor held up: iterations over prediction (× its learned margin)
    over = remote["overrun_share"]
    assert 0.0 <= over["learned"] <= over["none"] <= 1.0 and remote["service_margin"] >= 1.0, remote
    report = (out / "report.md").read_text()
    assert all(f"| {c} |" in report for c in CONFIGS), report
    assert "The A/A noise floor" in report and "| 2 rps (1×) | 1 |" in report, report
    assert "Where the time goes" in report and "on this engine's noise" in report, report
    assert (out / "live.png").stat().st_size > 10_000
    # a second call finds every run done and only rebuilds the report
    again = _live(["--configs", " ".join(CONFIGS), "--capacity", "2", "--loads", "1", "--seeds", "1", "--requests",
                   "12", "--warmup", "6", "--out", str(out)], timeout=120)
    assert again.returncode == 0 and "already in" in again.stdout, again.stdout + again.stderr


@pytest.mark.timeout(900)
def test_multi_turn_chat_with_prefix_caching(tmp_path: Path) -> None:
    """``--turns``: each later turn is sent after the one before it finished, with that turn's
    prompt and output before its own, so vLLM's prefix cache holds most of it, and every
    request is answered in full; each run starts from an empty cache."""
    out = tmp_path / "chat"
    r = _live(["--configs", "inproc:vllm-fcfs inproc:slidingserve", "--rates", "2", "--seeds", "1", "--requests", "12",
               "--warmup", "3", "--turns", "3", "--think-s", "0.2", "--max-prompt", "200", "--max-output", "24",
               "--prefix-caching", "--shared-prefix", "64", "--out", str(out)], timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(x["config"] for x in runs) == ["inproc:slidingserve", "inproc:vllm-fcfs"]
    for x in runs:
        assert (x["requests"], x["completed"], x["errors"]) == (12, 12, 0), x
        # two of three turns resend a history the cache holds: far more hits than the system prompt alone
        assert x["vllm_timings"]["prefix_hit_rate"] > 0.4, x["vllm_timings"]
        assert x["prefix_cache_reset"], x
    # the cache was emptied before each run: the same chats hit alike in both (without the
    # reset, the second configuration on the engine found the first one's prompts cached)
    rates = [x["vllm_timings"]["prefix_hit_rate"] for x in runs]
    assert abs(rates[0] - rates[1]) < 0.1, rates
    assert json.loads((out / "spec.json").read_text())["workload"]["turns"] == 3


def test_sim_only_replays_settings_without_an_engine(tmp_path: Path) -> None:
    """``--sim-only``: the sweep on a live engine's cost model (the one in docs/results/live),
    for trying settings before measuring them."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sim"
    r = _live(["--sim-only", str(root / "docs/results/live/engine_predictor.json"), "--configs",
               "vllm inproc:slidingserve", "--no-aa", "--rates", "2,6", "--seeds", "1", "--budget", "1024",
               "--out", str(out)],
              timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sim = [json.loads(x) for x in (out / "sim.jsonl").read_text().splitlines()]
    assert sorted((x["config"], x["rate"]) for x in sim) == [("inproc:slidingserve", 2.0), ("inproc:slidingserve", 6.0),
                                                             ("vllm", 2.0), ("vllm", 6.0)]
    assert all(x["source"] == "sim" and x["requests"] > 0 for x in sim)
    # overload shows: attainment falls with the rate
    assert min(x["attain_tpot"] for x in sim if x["rate"] == 6.0) < max(x["attain_tpot"] for x in sim if x["rate"] == 2.0)
    assert "budget 1024" in (out / "report.md").read_text()
    bad = _live(["--sim-only", str(tmp_path / "missing.json"), "--out", str(tmp_path / "y")], timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "missing.json" in bad.stderr


@pytest.mark.parametrize("args, says", [
    (["--configs", "inproc:no-such-policy"], "no-such-policy"),
    (["--configs", "gpu:slidingserve"], "expected 'vllm', 'vllm-again' or MODE:POLICY"),
    (["--capacity", "-1"], "--capacity must be positive"),
    (["--rates", "0"], "positive"),
    (["--threshold", "2"], "--threshold"),
])
def test_live_bench_bad_input_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    r = _live([*args, "--out", str(tmp_path / "x")], timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert not (tmp_path / "x").exists()
