"""The goodput search, the bench command's files and its input errors.

Configurations are tiny (tens of requests) so that the whole file runs in
seconds; they check the machinery, not the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from clients.bench.goodput import GoodputSpec, Probe, goodput_job, initial_guess, search_goodput
from clients.bench.runner import RunSpec, run
from clients.cli import main
from clients.workloads import CLASS_MIXES


def _threshold_probe(threshold: float, calls: list[float]):  # type: ignore[no-untyped-def]
    def probe(rate: float) -> Probe:
        calls.append(rate)
        return Probe(rate, 0.0 if rate <= threshold else 0.5, rate <= threshold)

    return probe


@pytest.mark.parametrize("guess", [0.3, 2.9, 3.0, 40.0])
def test_search_brackets_then_bisects_to_tolerance(guess: float) -> None:
    calls: list[float] = []
    res = search_goodput(_threshold_probe(3.0, calls), guess, tolerance=0.05)
    assert res.converged
    assert res.lo is not None and res.hi is not None
    assert res.goodput_rps == res.lo <= 3.0 < res.hi
    assert res.hi - res.lo <= 0.05 * res.lo
    assert [p.rate for p in res.probes] == calls
    assert len(calls) < 20


def test_search_when_nothing_passes() -> None:
    res = search_goodput(lambda r: Probe(r, 1.0, False), 2.0, tolerance=0.05)
    assert res.goodput_rps == 0.0 and res.lo is None and not res.converged
    assert res.probes[-1].rate == pytest.approx(2.0 / 1000)


def test_search_gives_up_after_max_probes() -> None:
    res = search_goodput(lambda r: Probe(r, 0.0, True), 1.0, max_probes=5)
    assert not res.converged and len(res.probes) == 5 and res.goodput_rps == pytest.approx(1.5**4)


def test_search_stops_at_the_rate_cap() -> None:
    res = search_goodput(lambda r: Probe(r, 0.0, True), 1.0, max_rate=10.0)
    assert not res.converged and res.goodput_rps == 10.0 and res.hi is None
    assert len(res.probes) == 7  # 1, 1.5, ..., 7.59, then the cap


def test_initial_guess_depends_on_profile() -> None:
    a100 = initial_guess("mixed-v1", "a100-tp2-llama2-7b")
    h100 = initial_guess("mixed-v1", "h100-tp2-llama2-7b")
    assert 0.5 < a100 < h100 < 50


def test_goodput_search_on_real_simulation() -> None:
    """The rate found passes; the failing end of the final bracket fails."""
    base = RunSpec("vllm-fcfs", "sharegpt", 1.0, seed=1, n_requests=40)
    out = goodput_job(GoodputSpec(base, guess=6.0, tolerance=0.2))
    assert out["converged"]
    lo, hi = out["bracket"]
    assert out["goodput_rps"] == lo > 0 and hi <= lo * 1.2 + 1e-9
    at_lo = run(dataclasses.replace(base, rate=lo, stop_violation_fraction=0.01))
    at_hi = run(dataclasses.replace(base, rate=hi, stop_violation_fraction=0.01))
    assert at_lo["violation_rate"] <= 0.01
    assert at_hi["violation_rate"] > 0.01
    assert {p["passed"] for p in out["probes"]} == {True, False}


def test_grpc_transport_goes_through_the_service() -> None:
    s = run(RunSpec("slidingserve", "sharegpt", 2.0, seed=0, n_requests=15, transport="grpc"))
    assert s["completed"] == 15
    assert s["adapter"]["remote_decisions"] > 0
    assert s["transport"] == "grpc"


def test_bench_out_writes_goodput_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    rc = main(["bench", "--workload", "sharegpt", "--policies", "vllm-fcfs,slidingserve", "--requests", "40",
               "--seeds", "2", "--tolerance", "0.3", "--jobs", "1", "--quiet", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "goodput.json").read_text())
    rows = data["goodput"]
    assert [r["policy"] for r in rows] == ["vllm-fcfs", "slidingserve"]
    for r in rows:
        assert {"policy", "workload", "profile", "goodput_rps", "goodput_rps_by_seed"} <= set(r)
        assert r["workload"] == "sharegpt" and r["profile"] == "a100-tp2-llama2-7b"
        assert len(r["goodput_rps_by_seed"]) == 2
        assert r["goodput_rps"] == pytest.approx(sum(r["goodput_rps_by_seed"]) / 2)
    for name in ("goodput.csv", "probes.csv", "runs.csv", "slo_attainment.png", "latency_cdf.png",
                 "goodput.png"):
        assert (out / name).stat().st_size > 0, name
    assert "Goodput:" in capsys.readouterr().out


def test_bench_in_worker_processes_with_csv_workload(tmp_path: Path) -> None:
    csv = tmp_path / "w.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{200 + 37 * i},{20 + i}\n"
                                                                      for i in range(30)))
    rc = main(["bench", "--workload", str(csv), "--policies", "sarathi-edf,qoserve", "--requests", "20",
               "--seeds", "1", "--tolerance", "0.4", "--jobs", "2", "--quiet", "--out", str(tmp_path / "o")])
    assert rc == 0
    rows = json.loads((tmp_path / "o" / "goodput.json").read_text())["goodput"]
    assert [r["workload"] for r in rows] == [str(csv)] * 2
    assert all(r["goodput_rps"] > 0 for r in rows)


@pytest.mark.parametrize(("args", "needle"), [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--policies", "vllm-fcfs,nope"], "unknown policy 'nope'"),
    (["--profile", "tpu-v9"], "unknown profile 'tpu-v9'"),
    (["--experiments", "goodput,nope"], "unknown experiment 'nope'"),
    (["--transport", "carrier-pigeon"], "unknown transport"),
    (["--param", "slidingserve:window"], "POLICY:KEY=VALUE"),
    (["--param", "slidingserve:window=9"], "window"),
    (["--requests", "x"], "invalid int value"),
])
def test_bench_bad_input_is_one_line_exit_2(args: list[str], needle: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_ray_executor_missing_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    assert main(["bench", "--quiet", "--executor", "ray", "--requests", "10", "--seeds", "1",
                 "--policies", "vllm-fcfs"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the 'ray' package" in err and "\n" not in err


def test_bench_load_and_margin_experiments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    rc = main(["bench", "--workload", "code", "--policies", "qoserve,slidingserve", "--requests", "40",
               "--seeds", "2", "--tolerance", "0.4", "--jobs", "1", "--quiet", "--experiments", "load,margin",
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "goodput.json").read_text())
    assert [r["policy"] for r in data["margin"]] == [f"slidingserve[margin={m}]" for m in ("1.0", "1.05", "1.1", "1.2")]
    # margin 1.1 is the default: it shares the main search
    assert data["margin"][2]["goodput_rps_by_seed"] == data["goodput"][1]["goodput_rps_by_seed"]
    ref = data["reference"]["rate_rps"]
    load = {r["policy"]: r for r in data["load"]["rows"]}
    assert set(load) == {"qoserve", "slidingserve"}
    runs = [r for r in data["runs"] if r["policy"] == "slidingserve"]
    for factor, tag in (("1x", "reference"), ("1.5x", "load"), ("2x", "overload_common")):
        row = load["slidingserve"][factor]
        assert row["rate_rps"] == pytest.approx(float(factor[:-1]) * ref)
        mine = [r for r in runs if r["experiment"] == tag]
        assert len(mine) == 2
        assert row["preemptions_per_1000"] == pytest.approx(
            1000 * np.mean([r["preemptions"] / r["requests"] for r in mine]))
        assert row["violations_per_1000"] == pytest.approx(1000 * np.mean([r["violation_rate"] for r in mine]))
    text = capsys.readouterr().out
    assert "preempt/1k" in text and "per-seed ratio mean (min)" in text and "Margin" in text
    assert (out / "margin.png").stat().st_size > 0


def test_bench_classes_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Classes: every policy plus vllm-priority at 1x-3x the reference rate, attainment per
    class and the weighted goodput computed from the runs' own per-class counts."""
    out = tmp_path / "res"
    rc = main(["bench", "--workload", "mixed-v1", "--policies", "vllm-fcfs,slidingserve", "--requests", "60",
               "--seeds", "1", "--tolerance", "0.4", "--jobs", "1", "--quiet", "--experiments", "classes",
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "goodput.json").read_text())
    c = data["classes"]
    assert [r["policy"] for r in c["rows"]] == ["vllm-fcfs", "vllm-priority", "slidingserve"]
    assert c["classes"] == ["critical", "standard", "batch"] and c["factors"] == [1.0, 1.5, 2.0, 3.0]
    ref = data["reference"]["rate_rps"]
    for row in c["rows"]:
        for f in c["factors"]:
            cell = row[f"{f:g}x"]
            assert cell["rate_rps"] == pytest.approx(f * ref)
            for name in c["classes"]:
                assert 0.0 <= cell["classes"][name]["attainment"] <= 1.0
            # only the sheddable class is ever rejected
            assert cell["classes"]["critical"]["rejected_per_1000"] == 0
            assert cell["classes"]["standard"]["rejected_per_1000"] == 0
    mix = CLASS_MIXES["interactive-batch"]
    for done in (r for r in data["runs"] if r["experiment"].startswith("classes")):
        spec = RunSpec(done["policy"], "mixed-v1", done["rate_rps"], seed=done["seed"], n_requests=60,
                       classes="interactive-batch")
        again = run(spec)
        assert again["weighted_goodput_rps"] == pytest.approx(done["weighted_goodput_rps"])
        assert again["weighted_goodput_rps"] == pytest.approx(sum(
            k.weight * again["classes"][k.name]["met"] for k in mix.classes) / again["sim_time_s"])
        break
    text = capsys.readouterr().out
    assert "Classes: class mix interactive-batch" in text and "weighted rps" in text
    assert (out / "classes.png").stat().st_size > 0
