"""Real vLLM 0.33 schedulers on CPU, driven by a fake model runner with ground-truth step times.

The configuration follows vLLM's own CPU scheduler tests: ``VLLM_TARGET_DEVICE=cpu``,
a local model folder holding only ``config.json`` (no hub, no tokenizer, no weights),
a hand-built ``KVCacheConfig``.  The driver plays EngineCore's role: ``schedule()``,
"execute" (a sampled token for every request whose chunk reaches its last known
token, the step's time taken from the simulated GPU's ground truth on a fake clock),
``update_from_output()``; with async scheduling step k+1 is scheduled before step k's
output is applied, as vLLM's batch queue does.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from engine_adapter.sim.groundtruth import load_ground_truth

BLOCK = 16
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def model_dir(root: Path) -> str:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


class FakeClock:
    """Advanced by the driver by each step's ground-truth time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


def scheduler_class(base: type, env: Mapping[str, str] | None = None, clock: Any = None) -> type:
    """``base`` with fixed settings and clock (our classes' test hooks)."""
    ns: dict[str, Any] = {}
    if env is not None:
        ns["slidingserve_env"] = dict(env)
    if clock is not None:
        ns["slidingserve_clock"] = staticmethod(clock)
    return type(base.__name__ + "UnderTest", (base,), ns) if ns else base


def build_scheduler(cls: type, mdir: str, *, async_scheduling: bool, num_blocks: int = 512,
                    max_num_batched_tokens: int = 512, max_num_seqs: int = 32,
                    max_model_len: int = 2048, enable_prefix_caching: bool = True) -> Any:
    model_config = ModelConfig(model=mdir, tokenizer=mdir, skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=0, async_scheduling=async_scheduling, scheduler_cls=cls,
    )
    cache_config = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config)
    # the CPU platform turns async scheduling off; the async class needs it on
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return sched_cls(vllm_config=vllm_config, kv_cache_config=kv,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK, log_stats=True)


_hasher: Any = None
_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int, *, extra_args: dict[str, Any] | None = None,
                 arrival: float | None = None, rid: str | None = None) -> Request:
    """Unique prompt tokens (no accidental prefix-cache hits)."""
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    i = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    return Request(request_id=rid or f"q{i}", prompt_token_ids=[3 + (i * 131 + k * 7919) % 990 for k in range(prompt_len)],
                   sampling_params=sp, pooling_params=None,
                   arrival_time=time.time() if arrival is None else arrival, block_hasher=_hasher)


def workload(n: int, seed: int = 0, *, max_prompt: int = 600, max_out: int = 24) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(8, max_prompt)), int(rng.integers(1, max_out))) for _ in range(n)]


def fake_output(sched: Any, so: Any) -> ModelRunnerOutput:
    """One sampled token per request whose chunk reaches its last known token."""
    ids = list(so.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [100 + sched.requests[r].num_output_tokens]
               for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def batch_cu(so: Any) -> tuple[np.ndarray, np.ndarray]:
    computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    computed.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                        strict=False))
    c = np.array(list(so.num_scheduled_tokens.values()), np.int64)
    u = np.array([computed[r] for r in so.num_scheduled_tokens], np.int64)
    return c, u


@dataclass
class RunResult:
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # request -> output tokens
    scheduled: dict[str, int] = field(default_factory=dict)  # request -> tokens computed
    preempted: set[str] = field(default_factory=set)
    step_ms: list[float] = field(default_factory=list)
    plans: list[tuple[dict[str, int], dict[str, int]]] = field(default_factory=list)


class Driver:
    """EngineCore's loop, minus the model."""

    def __init__(self, sched: Any, clock: FakeClock | None = None, *, async_scheduling: bool, seed: int = 0,
                 wall_ms: float = 0.0) -> None:
        self.sched = sched
        self.clock = clock or FakeClock()
        self.async_ = async_scheduling
        self.truth = load_ground_truth("a100-tp2-llama2-7b")
        self.rng = np.random.default_rng(seed)
        self.res = RunResult()
        self.pending: tuple[Any, Any] | None = None
        #: also sleep this long per step (real time for the gRPC tests' fault injection)
        self.wall_ms = wall_ms

    def _execute(self, so: Any, out: Any) -> None:
        if so.total_num_scheduled_tokens:
            c, u = batch_cu(so)
            ms = self.truth.iteration_ms(c, u, self.rng)
            self.clock.advance(ms)
            self.res.step_ms.append(ms)
            if self.wall_ms:
                time.sleep(self.wall_ms / 1e3)
        eco = self.sched.update_from_output(so, out)
        for v in eco.values():
            for o in v.outputs:
                if o.finish_reason is not None:
                    self.res.finished[o.request_id] = self.sched_outputs.get(o.request_id, 0) + len(o.new_token_ids)
                else:
                    self.sched_outputs[o.request_id] = self.sched_outputs.get(o.request_id, 0) + len(o.new_token_ids)

    def step(self) -> Any:
        so = self.sched.schedule()
        self.res.steps += 1
        for r, n in so.num_scheduled_tokens.items():
            self.res.scheduled[r] = self.res.scheduled.get(r, 0) + n
        self.res.preempted |= set(so.preempted_req_ids)
        out = fake_output(self.sched, so)
        if self.async_:
            prev, self.pending = self.pending, (so, out)
            if prev is not None:
                self._execute(*prev)
        else:
            self._execute(so, out)
        return so

    sched_outputs: dict[str, int]

    def run(self, max_steps: int = 20_000, on_step: Callable[[int, Any], None] | None = None) -> RunResult:
        self.sched_outputs = {}
        idle = 0
        for k in range(max_steps):
            if not self.sched.has_requests() and self.pending is None:
                return self.res
            so = self.step()
            if on_step is not None:
                on_step(k, so)
            if so.total_num_scheduled_tokens == 0:
                if self.async_ and self.pending is not None:
                    prev, self.pending = self.pending, None
                    self._execute(*prev)
                idle += 1
                if idle > 50:
                    raise AssertionError("no progress for 50 steps")
            else:
                idle = 0
        raise AssertionError(f"not finished after {max_steps} steps")
