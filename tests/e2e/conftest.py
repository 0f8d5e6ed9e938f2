"""Processes of the end-to-end test: the scheduling service and vLLM's OpenAI server.

Run by ``make e2e`` in ``.venv-e2e`` (the CPU build of vLLM, the ``openai`` package and this
project); the main ``pytest`` run does not collect this folder (``--ignore`` in pyproject).
Everything is local: the model is a folder holding a ``config.json`` written here, vLLM draws
its weights (``--load-format dummy``), and no process may reach for a model hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.live.procs import free_port, scrape

from .command import ServeCommand

#: A Llama small enough for two CPU cores; CPU attention needs a head size of at least 32.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
BIN = Path(sys.executable).parent


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float, *, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None, every_s: float = 0.25) -> None:
    """Poll ``ok`` until it holds; fail with ``what`` (and the process's output) otherwise."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}\n"
                                 + (tail(log) if log else ""))
        with contextlib.suppress(Exception):
            if ok():
                return
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s\n" + (tail(log) if log else ""))


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def labels_of(samples: list[tuple[str, dict[str, str], float]], name: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples if n == name]


class Service:
    """``slidingserve serve`` from this checkout, killed and restarted on the same ports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.metrics_port = free_port()
        self.policies = root / "policies.yaml"
        self.write_policies("v1")
        self.config = root / "server.yaml"
        self.config.write_text(
            f"host: 127.0.0.1\nport: {self.port}\nmetrics_port: {self.metrics_port}\n"
            # refit often: the test's engine reports a few hundred iterations
            "refit_every: 32\nrefit_min_samples: 30\n"
            f"policy_config: {self.policies}\npolicy_config_poll_s: 0.2\n")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / f"service-{self.starts}.log"

    def write_policies(self, default: str) -> None:
        """The policy config, replaced in one step (as a Kubernetes ConfigMap update is)."""
        tmp = self.policies.with_suffix(".tmp")
        tmp.write_text(f"default: {default}\nversions:\n  v1: {{policy: slidingserve}}\n"
                       "  v2: {policy: slidingserve, params: {window: 3}}\n")
        os.replace(tmp, self.policies)

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(BIN / "slidingserve"), "serve", "--config", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.root)
        # the service compiles its numba kernels before it answers: a few seconds from the
        # on-disk cache, about a minute on a busy 2-core machine when the cache is cold
        wait_for("slidingserve serve answering", self.healthy, 300, proc=self.proc, log=self.log)

    def healthy(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING) and bool(scrape(self.metrics_port))

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye to the engines."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self.proc = None

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        return scrape(self.metrics_port)

    def logs(self) -> str:
        return "\n".join((self.root / f"service-{i}.log").read_text(errors="replace")
                         for i in range(1, self.starts + 1))


class VllmServer:
    """vLLM's OpenAI-compatible server on the tiny model with the adapter as its scheduler."""

    def __init__(self, root: Path, model: str, service: Service, *, tp: int, engine_id: str,
                 async_scheduling: bool = False) -> None:
        self.root = root
        self.engine_id = engine_id
        self.cmd = ServeCommand(model=model, port=free_port(), address=service.address,
                                metrics_port=free_port(), tp=tp, async_scheduling=async_scheduling)
        self.log = root / f"vllm-tp{tp}{'-async' if async_scheduling else ''}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.cmd.port}/v1"

    def start(self, timeout_s: float = 600) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIDINGSERVE_", "VLLM_"))}
        env.update(self.cmd.env())
        # the harness's additions: a name for the engine in the service's logs, caches in the
        # test's folder, no usage statistics
        env.update({"SLIDINGSERVE_ENGINE_ID": self.engine_id, "HF_HOME": str(self.root / "hf-home"),
                    "VLLM_CACHE_ROOT": str(self.root / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        with open(self.log, "wb") as out:
            # own session: stopping it takes the engine core and the workers along
            self.proc = subprocess.Popen(self.cmd.argv(sys.executable), stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.root, start_new_session=True)
        wait_for(f"vLLM (TP{self.cmd.tp}) serving /health", lambda: http_get(
            f"http://127.0.0.1:{self.cmd.port}/health") is not None, timeout_s, proc=self.proc, log=self.log,
            every_s=1.0)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # the engine core and workers share the session; make sure none is left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def adapter_metrics(self) -> list[tuple[str, dict[str, str], float]]:
        return scrape(self.cmd.metrics_port)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def model(root: Path) -> str:
    d = root / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


@pytest.fixture(scope="session")
def service(root: Path) -> Iterator[Service]:
    s = Service(root)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def vllm_server(root: Path, model: str, service: Service, tp: int,
                async_scheduling: bool = False) -> Iterator[VllmServer]:
    v = VllmServer(root, model, service, tp=tp, engine_id=f"e2e-tp{tp}{'-async' if async_scheduling else ''}",
                   async_scheduling=async_scheduling)
    try:
        v.start()
        yield v
    finally:
        v.stop()


@pytest.fixture(scope="class")
def vllm_tp1(root: Path, model: str, service: Service) -> Iterator[VllmServer]:
    yield from vllm_server(root, model, service, 1)


@pytest.fixture(scope="class")
def vllm_tp2(root: Path, model: str, service: Service) -> Iterator[VllmServer]:
    yield from vllm_server(root, model, service, 2)


def pytest_report_header(config: Any) -> str:
    return f"e2e: python {sys.executable}"
