"""A real vLLM scheduler on CPU with no model: for the adapter's benchmarks and tests.

The configuration follows vLLM's own CPU scheduler tests: ``VLLM_TARGET_DEVICE=cpu``, a
local model folder holding only ``config.json`` (:func:`model_dir`: no hub, no tokenizer,
no weights), a hand-built ``KVCacheConfig`` (:func:`build_scheduler`).  The caller plays
EngineCore's role: ``schedule()``, then :func:`fake_output` (a sampled token for every
request whose chunk reaches its last known token), then ``update_from_output()``.

It imports vLLM and torch (the ``vllm`` extra); the adapter itself never imports it.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = ["BLOCK", "TINY_LLAMA", "build_scheduler", "fake_output", "make_request", "model_dir",
           "scheduler_class"]

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
                 arrival: float | None = None, rid: str | None = None, priority: int = 0) -> Request:
    """Unique prompt tokens (no accidental prefix-cache hits)."""
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    i = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    return Request(request_id=rid or f"q{i}", prompt_token_ids=[3 + (i * 131 + k * 7919) % 990 for k in range(prompt_len)],
                   sampling_params=sp, pooling_params=None,
                   arrival_time=time.time() if arrival is None else arrival, block_hasher=_hasher,
                   priority=priority)


def fake_output(sched: Any, so: Any) -> ModelRunnerOutput:
    """One sampled token per request whose chunk reaches its last known token."""
    ids = list(so.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [100 + sched.requests[r].num_output_tokens]
               for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                             sampled_token_ids=sampled)
