"""The built wheel carries the request traces and GPU profiles (issue 11).

The project is built into a wheel from a copy of what the Dockerfile copies, installed
(not editable) into a temporary folder, and run from outside the source tree with
``SLIDINGSERVE_DATA`` unset: the traces and profiles must come from the installed package,
not from this checkout or any folder beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What the code reads (engine_adapter/data/traces.py TRACES, engine_adapter/sim/groundtruth.py PROFILES).
DATA = [
    "processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz",
    "processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv.gz",
    "profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv.gz",
    "profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv.gz",
    "profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv.gz",
    "profiling/network/a100_pairwise_nvlink/all_reduce.csv.gz",
    "profiling/network/h100_pairwise_nvlink/all_reduce.csv.gz",
    "PROVENANCE.md",
    "LICENSE-vidur",
    "LICENSE-sarathi-serve",
]

_CHECK = """
import json
import numpy as np
import clients, engine_adapter
from engine_adapter.data import data_dir
from engine_adapter.data.traces import TRACES, load_trace
from engine_adapter.sim.groundtruth import PROFILES, load_ground_truth
print(json.dumps({
    "files": [clients.__file__, engine_adapter.__file__],
    "data_dir": str(data_dir()),
    "traces": {t: len(load_trace(t)) for t in TRACES},
    "profiles": {k: load_ground_truth(k).iteration_ms(np.array([512]), np.array([0])) > 0 for k in PROFILES},
}))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120,
         ) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd[:4]} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, target folder holding the installed project)."""
    tmp = tmp_path_factory.mktemp("pkg")
    # Build from a copy so that the build writes nothing (build/, *.egg-info) into the checkout.
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    for pkg in ("scheduler_service", "engine_adapter", "clients"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "whl"), str(src)],
         cwd=tmp)
    (wheel,) = (tmp / "whl").glob("slidingserve-*.whl")
    site = tmp / "site"
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], cwd=tmp)
    return wheel, site


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLIDINGSERVE_DATA", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)  # ahead of the checkout's editable install
    return env


def test_wheel_holds_the_data(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in DATA if f"engine_adapter/data/vidur/{f}" not in names]
    assert not missing, missing


def test_installed_package_reads_its_own_data(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, site = installed
    out = _run([sys.executable, "-c", _CHECK], cwd=tmp_path, env=_env(site)).stdout
    got = json.loads(out.strip().splitlines()[-1])
    for f in got["files"]:
        assert Path(f).resolve().is_relative_to(site.resolve()), f  # not the checkout's copy
    assert Path(got["data_dir"]).resolve() == (site / "engine_adapter" / "data" / "vidur").resolve()
    assert got["traces"] == {"sharegpt": 30731, "arxiv": 28257}
    assert all(got["profiles"].values()), got["profiles"]


def test_installed_cli_runs_a_bench(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, site = installed
    cli = site / "bin" / "slidingserve"
    assert cli.is_file()
    out = tmp_path / "out"
    # mixed-v1 reads both traces; the default profile (A100 TP2) reads mlp.csv and all_reduce.csv.
    p = _run([sys.executable, str(cli), "bench", "--workload", "mixed-v1", "--policies", "vllm-fcfs",
              "--requests", "20", "--seeds", "1", "--tolerance", "0.5", "--jobs", "1", "--quiet",
              "--out", str(out)], cwd=tmp_path, env=_env(site))
    assert "vllm-fcfs" in p.stdout
    res = json.loads((out / "goodput.json").read_text())
    assert res["settings"]["workload"] == "mixed-v1"
    assert (out / "goodput.csv").stat().st_size > 0
