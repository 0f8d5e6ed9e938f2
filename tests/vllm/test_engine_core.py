"""vLLM's real EngineCore loop (batch queue, async scheduling) with our scheduler class and a
simulated executor: ``execute_model`` returns sampled tokens after the ground-truth step time
(scaled down), so the whole engine path runs without a GPU."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from engine_adapter.sim.groundtruth import load_ground_truth

from .support import BLOCK, batch_cu

TIME_SCALE = 0.05  # sleep 5% of the simulated step time: fast, still ordered like a GPU


def _done(x: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(x)
    return f


class SimExecutor(Executor):
    """What EngineCore calls on an executor, answered from the simulated GPU."""

    def _init_executor(self) -> None:
        self._known: dict[str, int] = {}
        self._pending: Any = None
        self._truth = load_ground_truth("a100-tp2-llama2-7b")
        self._rng = np.random.default_rng(0)

    def collective_rpc(self, method: Any, timeout: Any = None, args: Any = (), kwargs: Any = None,
                       non_block: bool = False) -> Any:
        res = [("generate",)] if method == "get_supported_tasks" else [None]
        return _done(res) if non_block else res

    def get_kv_cache_specs(self) -> Any:
        return [{f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float16) for i in range(2)}]

    def get_supported_kv_cache_layouts(self) -> Any:
        return [["NHD"]]

    def set_kv_cache_layout(self, *a: Any, **k: Any) -> None:
        pass

    def determine_available_memory(self) -> Any:
        return [16 * 1024 * 1024]

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        pass

    def compile_or_warm_up_model(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def take_draft_token_ids(self) -> Any:
        return None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def execute_model(self, so: Any, non_block: bool = False) -> Any:
        for rid in so.finished_req_ids:
            self._known.pop(rid, None)
        if so.total_num_scheduled_tokens == 0:
            self._pending = None
            return _done(EMPTY_MODEL_RUNNER_OUTPUT) if non_block else EMPTY_MODEL_RUNNER_OUTPUT
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        for nr in so.scheduled_new_reqs:
            self._known.setdefault(nr.req_id, len(nr.prompt_token_ids or []))
        c = so.scheduled_cached_reqs
        computed.update(zip(c.req_ids, c.num_computed_tokens, strict=False))
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            if computed[rid] + n >= self._known[rid]:
                self._known[rid] += 1
                sampled.append([7])
            else:
                sampled.append([])
        cc, uu = batch_cu(so)
        time.sleep(self._truth.iteration_ms(cc, uu, self._rng) / 1e3 * TIME_SCALE)
        self._pending = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled)
        return _done(None) if non_block else None

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        out = self._pending
        return _done(out) if non_block else out


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_engine_core_serves_everything_with_remote_plans(async_: bool, mdir: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIDINGSERVE_ADDRESS", "inproc")
    monkeypatch.setenv("SLIDINGSERVE_DEPLOYMENT", "slidingserve")
    cls = "engine_adapter.vllm.RemoteScheduler" if async_ else "engine_adapter.vllm.RemoteSyncScheduler"
    mc = ModelConfig(model=mdir, skip_tokenizer_init=True, dtype="float16", max_model_len=1024, seed=0)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK),
                    scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                                                     is_encoder_decoder=False, async_scheduling=async_,
                                                     long_prefill_token_threshold=0, scheduler_cls=cls),
                    parallel_config=ParallelConfig(distributed_executor_backend=SimExecutor))
    vc.scheduler_config.async_scheduling = async_  # the CPU platform turns it off
    core = EngineCore(vc, executor_class=SimExecutor, log_stats=False)
    sched: Any = core.scheduler
    assert type(sched).__name__ == ("RemoteScheduler" if async_ else "RemoteSyncScheduler")
    want: dict[str, int] = {}
    rng = np.random.default_rng(1)
    for i in range(24):
        n_out = int(rng.integers(1, 12))
        req = EngineCoreRequest(
            request_id=f"e{i}", prompt_token_ids=[3 + (i * 37 + k) % 900 for k in range(int(rng.integers(8, 300)))],
            mm_features=None, sampling_params=SamplingParams(max_tokens=n_out, ignore_eos=True,
                                                             extra_args={"slo_ttft_ms": 500, "slo_tbt_ms": 80}),
            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
            data_parallel_rank=None)
        want[req.request_id] = n_out
        core.add_request(*core.preprocess_add_request(req))
    got: dict[str, int] = {}
    for _ in range(2000):
        outs, _executed = core.step_fn()
        for eco in (outs or {}).values():
            for o in eco.outputs:
                got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
        if not sched.has_requests() and not core.batch_queue:
            break
    st = sched.slidingserve_stats()
    core.shutdown()
    assert got == want
    assert st["planned"] > 0 and st["deviating_iterations"] == 0
    assert st["reports"] > 0
