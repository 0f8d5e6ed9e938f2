"""Ground-truth iteration latency of one GPU replica, built from real profiles.

The simulated engine needs a "real GPU" whose iteration time the scheduler's
predictor must *learn* (docs/simulator.md).  This module is that GPU.  It is
never handed to the predictor; the predictor only sees (features, measured
latency) samples (see :mod:`engine_adapter.sim.profiling`).

One iteration of a batch {(c_i, u_i)} (c_i tokens computed now, u_i tokens
already in the KV cache) on a replica with tensor-parallel degree TP costs::

    T = CPU + emb(N) + L · [ lin_TP(N) + 2 · allreduce_TP(N) + attn(c, u) ] + lm_head(R)

with N = Σ c_i tokens, R requests and L layers.

* ``lin_TP(N)``: per-layer linear ops from Vidur's CUDA-timed ``mlp.csv``
  (median columns) for this TP degree: ``input_layernorm, attn_pre_proj,
  attn_rope, attn_post_proj, post_attention_layernorm, mlp_up_proj, mlp_act,
  mlp_down_proj`` plus ``add`` counted **twice** (a Llama block has two
  residual adds; the profile times one).  ``emb`` is counted **once per
  iteration**, not per layer: the token-embedding lookup runs before layer 0
  only.  Interpolated piecewise-linearly in N; beyond the largest profiled N
  the table is extended with the slope between N_max/2 and N_max (the
  compute-bound regime is linear, and the last single segment is noisy).
* ``allreduce_TP(N)``: Vidur's NCCL all-reduce profile of N · n_embd · 2 bytes
  (fp16) with ``num_workers == TP``; two per layer (after attention and after
  the MLP, Megatron-style); zero for TP = 1.  Node: ``a100_pairwise_nvlink``
  for A100 (Vidur's default A100 node and the same topology as the H100 one:
  a TP2 pair joined by NVLink) and ``h100_pairwise_nvlink`` for H100.
* Medians jitter by a few µs between neighbouring token counts, so each table
  is made monotone non-decreasing by isotonic regression at load: more work
  never finishes sooner in the ground truth.
* ``attn``: the profiled ``attention.csv`` files are not available (see
  ``engine_adapter/data/vidur/PROVENANCE.md``), so attention is a roofline over FLOPs and KV bytes, per layer and
  per GPU (heads are split over TP)::

      prefill chunk (c > 1):  F = 4 · n_head·d · c · (u + c/2) / TP      (causal QKᵀ and PV)
                              B = 2 · n_kv_head·d · 2 B · (u + c) / TP   (K and V, fp16)
      decode (c = 1):         F = 4 · n_head·d · (u + 1/2) / TP,  B = 2 · n_kv_head·d · 2 B · (u + 1) / TP

  Every request is its own roofline, ``max(F / (η_c · peak), B / (η_b · HBM))``
  (within a sequence the kernel overlaps KV loads with math), and the
  requests' times add up: prefill tiles and decode tiles of a mixed batch are
  not assumed to hide each other.  Plus one launch floor per layer: vLLM V1
  runs prefills and decodes in one varlen attention kernel, and a near-empty
  kernel still costs launch + one wave + the split-KV reduce.  Summing
  per-request rooflines (rather than a roofline of the batch totals per
  kernel) keeps the time monotone: turning a decode into a 2-token chunk, or
  adding context, can never hide work under another request's bound.
* ``lm_head(R)``: the vocabulary projection (not in ``mlp.csv``) for the last
  token of each request: ``max(2 · V · E · R / TP / (η_gemm · peak),
  V · E · 2 B / TP / (η_b · HBM))`` — at decode sizes it is one read of the
  V×E weight matrix (1 GB for Llama-3-8B's 128k vocabulary: ≈0.7 ms on A100).
* ``CPU``: scheduling, input preparation, sampling and detokenisation of one
  engine step.  See :data:`CPU_OVERHEAD_MS`.
* Noise: multiplicative, lognormal with σ = :data:`NOISE_SIGMA`, mean 1, drawn
  from an explicit ``numpy.random.Generator``; noise-free without one.

Constants and their sources
---------------------------
* Peak dense FP16 tensor throughput and HBM bandwidth from NVIDIA datasheets:
  A100 SXM4 80 GB 312 TFLOPS / 2039 GB/s; H100 SXM5 80 GB 989 TFLOPS / 3350 GB/s.
* ``η_c = 0.5``: FlashAttention-2 reaches 50–73 % of A100 peak in the forward
  pass at head dim 128 for long sequences (Dao 2023, fig. 5); serving chunks
  of a few hundred tokens sit at the low end.
* ``η_b = 0.7``: paged decode attention and weight-streaming GEMV reach
  60–80 % of HBM bandwidth (vLLM/FlashInfer kernel benchmarks).  QoServe's
  fitted A100 Llama-3-8B model charges 1.1e-7 s per decode-context token
  (1.7e-7 above 512 tokens); the roofline with η_b = 0.7 gives 0.92e-7 — the
  same order, slightly optimistic.
* ``η_gemm = 0.75``: the profiled ``mlp_up_proj`` at 4096 tokens runs at 75 %
  of peak on both A100 (233 TFLOPS, Llama-3-8B) and H100 (748, Llama-2-7B).
* ``t_launch = 8 µs`` per layer for the attention kernel.
* KV capacity: vLLM's default ``gpu_memory_utilization = 0.9`` of 80 GiB, minus
  the fp16 weights (6.74 B params ≈ 13.5 GB for Llama-2-7B, 8.03 B ≈ 16.1 GB for
  Llama-3-8B) split over TP, divided by the per-GPU KV bytes of one token
  (2 · n_kv_head · d · 2 B · L / TP), rounded down to whole blocks of 16.

Fidelity (``benchmarks/groundtruth_fidelity.py``): against QoServe's model
fitted on real A100 Llama-3-8B TP1 runs the median relative gap over typical
batches is about 20 %, and the ground truth is the *faster* one almost
everywhere: Vidur's isolated-op profiles put a 2048-token prefill at ~145 ms
of linear ops where QoServe's end-to-end fit says ~200 ms in total.  The
constants above were chosen from the sources cited, not tuned to close that gap.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from sklearn.isotonic import isotonic_regression

from engine_adapter.data import data_dir, find, open_text

__all__ = [
    "CPU_OVERHEAD_MS",
    "GPUS",
    "NOISE_SIGMA",
    "PROFILES",
    "GPUProfile",
    "GPUSpec",
    "GroundTruth",
    "UnknownProfileError",
    "load_ground_truth",
]

#: Per-iteration CPU time (ms).  vLLM/Sarathi spend 2–5 ms per engine step on
#: scheduling, building input tensors, sampling and output processing.  3.5 ms
#: puts our A100 Llama-3-8B floor (10 ms of profiled linear ops for one
#: decode + 0.8 ms lm_head) next to the 14.9 ms intercept of QoServe's model
#: fitted on real runs of that setup.
CPU_OVERHEAD_MS = 3.5
#: σ of the multiplicative lognormal noise: run-to-run spread of one engine step
#: (the profiles' own std/median is 1–5 %).
NOISE_SIGMA = 0.03

ETA_COMPUTE = 0.5
ETA_BANDWIDTH = 0.7
ETA_GEMM = 0.75
ATTN_LAUNCH_MS = 0.008
GIB = 1024**3
FP16 = 2


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """Datasheet figures of one accelerator (dense FP16 tensor peak, HBM)."""

    name: str
    peak_tflops: float
    hbm_gbps: float
    memory_gib: float
    #: Folder under ``profiling/network/`` used for the TP all-reduce.
    network_node: str


GPUS: dict[str, GPUSpec] = {
    "a100": GPUSpec("a100", 312.0, 2039.0, 80.0, "a100_pairwise_nvlink"),
    "h100": GPUSpec("h100", 989.0, 3350.0, 80.0, "h100_pairwise_nvlink"),
}


@dataclass(frozen=True, slots=True)
class GPUProfile:
    """One replica: a GPU type, a model and a TP degree.

    The architecture fields are the published model configs; :func:`load_ground_truth`
    checks them against the ``n_head, n_kv_head, n_embd`` columns of ``mlp.csv``.
    """

    key: str
    gpu: str
    model: str  # folder under profiling/compute/<gpu>/meta-llama/
    tp: int
    layers: int
    n_head: int
    n_kv_head: int
    n_embd: int
    vocab_size: int
    weight_bytes: float
    max_model_len: int
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_capacity_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        spec = GPUS[self.gpu]
        free = spec.memory_gib * GIB * self.gpu_memory_utilization - self.weight_bytes / self.tp
        tokens = int(free // self.kv_bytes_per_token_per_gpu)
        object.__setattr__(self, "kv_capacity_tokens", tokens - tokens % self.block_size)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return 2 * self.n_kv_head * self.head_dim * FP16 * self.layers / self.tp

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    @property
    def spec(self) -> GPUSpec:
        return GPUS[self.gpu]


def _llama2_7b(key: str, gpu: str, tp: int) -> GPUProfile:
    return GPUProfile(key, gpu, "Llama-2-7b-hf", tp, 32, 32, 32, 4096, 32000, 6.74e9 * FP16, 4096)


def _llama3_8b(key: str, gpu: str, tp: int) -> GPUProfile:
    return GPUProfile(key, gpu, "Meta-Llama-3-8B", tp, 32, 32, 8, 4096, 128256, 8.03e9 * FP16, 8192)


PROFILES: dict[str, GPUProfile] = {
    p.key: p
    for p in (
        _llama2_7b("a100-tp2-llama2-7b", "a100", 2),
        _llama3_8b("a100-tp1-llama3-8b", "a100", 1),
        _llama3_8b("a100-tp2-llama3-8b", "a100", 2),
        _llama2_7b("h100-tp2-llama2-7b", "h100", 2),
    )
}
DEFAULT_PROFILE = "a100-tp2-llama2-7b"

_LINEAR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
    "add",  # two residual adds per block
)


# --------------------------------------------------------------------- tables
@dataclass(frozen=True, slots=True)
class _Curve:
    """Monotone piecewise-linear y(x) with a linear tail beyond x[-1]."""

    x: np.ndarray
    y: np.ndarray
    tail_slope: float

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray) -> _Curve:
        order = np.argsort(x)
        x, y = np.asarray(x, float)[order], np.asarray(y, float)[order]
        y = isotonic_regression(y, increasing=True)
        half = float(np.interp(x[-1] / 2, x, y))
        slope = max(0.0, (y[-1] - half) / (x[-1] / 2)) if x[-1] > x[0] else 0.0
        return cls(x, y, slope)

    def __call__(self, n: np.ndarray | float) -> np.ndarray:
        n = np.asarray(n, float)
        return np.interp(n, self.x, self.y) + self.tail_slope * np.maximum(n - self.x[-1], 0.0)

    def __add__(self, other: _Curve) -> _Curve:
        x = np.union1d(self.x, other.x)
        return _Curve(x, self(x) + other(x), self.tail_slope + other.tail_slope)

    def scale(self, k: float) -> _Curve:
        return _Curve(self.x, self.y * k, self.tail_slope * k)


def _read_csv(root: Path, rel: str, what: str) -> tuple[Path, list[dict[str, str]]]:
    """The rows of ``root/rel`` (plain or ``.gz``); see :mod:`engine_adapter.data`."""

    path = find(rel, what, root)
    with open_text(path) as fh:
        return path, list(csv.DictReader(fh))


def _linear_curves(profile: GPUProfile, root: Path) -> tuple[_Curve, _Curve]:
    """(per-layer linear ops, embedding) for the profile's TP degree, by tokens."""
    rel = f"profiling/compute/{profile.gpu}/meta-llama/{profile.model}/mlp.csv"
    path, table = _read_csv(root, rel, f"compute profile of {profile.key!r}")
    rows = [r for r in table if int(r["num_tensor_parallel_workers"]) == profile.tp]
    if not rows:
        raise ValueError(f"{path}: no rows for TP={profile.tp}")
    r0 = rows[0]
    for col, want in (("n_head", profile.n_head), ("n_kv_head", profile.n_kv_head), ("n_embd", profile.n_embd)):
        if int(r0[col]) != want:
            raise ValueError(f"{path}: {col}={r0[col]} but profile {profile.key!r} says {want}")
    tokens = np.array([float(r["num_tokens"]) for r in rows])
    lin = np.array([sum(float(r[f"time_stats.{op}.median"]) for op in _LINEAR_OPS) for r in rows])
    emb = np.array([float(r["time_stats.emb.median"]) for r in rows])
    return _Curve.fit(tokens, lin), _Curve.fit(tokens, emb)


def _allreduce_curve(profile: GPUProfile, root: Path) -> _Curve:
    """One all-reduce of the hidden states, by tokens (zero for TP = 1)."""
    if profile.tp == 1:
        return _Curve(np.array([0.0, 1.0]), np.zeros(2), 0.0)
    rel = f"profiling/network/{profile.spec.network_node}/all_reduce.csv"
    path, table = _read_csv(root, rel, f"all-reduce profile of {profile.key!r}")
    by_size: dict[float, list[float]] = defaultdict(list)
    for r in table:
        if int(r["num_workers"]) == profile.tp:
            by_size[float(r["size"])].append(float(r["time_stats.all_reduce.median"]))
    if not by_size:
        raise ValueError(f"{path}: no all_reduce rows with num_workers={profile.tp}")
    sizes = np.array(sorted(by_size))
    times = np.array([float(np.median(by_size[s])) for s in sizes])
    return _Curve.fit(sizes / (profile.n_embd * FP16), times)


# ---------------------------------------------------------------- ground truth
class GroundTruth:
    """Iteration latency (ms) of one replica.  Build with :func:`load_ground_truth`."""

    def __init__(self, profile: GPUProfile, root: Path, cpu_overhead_ms: float = CPU_OVERHEAD_MS,
                 noise_sigma: float = NOISE_SIGMA) -> None:
        self.profile = profile
        self.cpu_overhead_ms = float(cpu_overhead_ms)
        self.noise_sigma = float(noise_sigma)
        lin, emb = _linear_curves(profile, root)
        ar = _allreduce_curve(profile, root)
        L = profile.layers
        #: Everything that depends on the total token count only, summed over layers.
        self.token_curve = lin.scale(L) + ar.scale(2 * L) + emb
        self.linear_curve, self.emb_curve, self.allreduce_curve = lin, emb, ar
        self._tx = self.token_curve.x
        self._ty = self.token_curve.y
        self._tx_max = float(self._tx[-1])
        self._ty_max = float(self._ty[-1])
        self._tslope = self.token_curve.tail_slope

        spec, tp, d = profile.spec, profile.tp, profile.head_dim
        flops_per_ms = spec.peak_tflops * 1e12 * ETA_COMPUTE / 1e3
        bytes_per_ms = spec.hbm_gbps * 1e9 * ETA_BANDWIDTH / 1e3
        # Attention over all layers: ms per unit of Σ c(u + c/2) and of Σ (u + c).
        self._k_flop = L * 4 * profile.n_head * d / tp / flops_per_ms
        self._k_byte = L * 2 * profile.n_kv_head * d * FP16 / tp / bytes_per_ms
        self._launch = L * ATTN_LAUNCH_MS
        ve = profile.vocab_size * profile.n_embd / tp
        self._head_w_ms = ve * FP16 / bytes_per_ms
        self._head_flop_ms = 2 * ve / (spec.peak_tflops * 1e12 * ETA_GEMM / 1e3)

    def __repr__(self) -> str:
        return f"GroundTruth({self.profile.key!r})"

    # ------------------------------------------------------------ hot path
    def iteration_ms(self, c: np.ndarray, u: np.ndarray, rng: np.random.Generator | None = None) -> float:
        """Latency (ms) of one iteration; entries with c ≤ 0 are ignored.

        Noise-free without ``rng``; with one, multiplied by a mean-one lognormal.
        """
        c = np.asarray(c, dtype=np.float64)
        u = np.asarray(u, dtype=np.float64)
        live = c > 0
        if not live.all():
            c, u = c[live], u[live]
        n_req = len(c)
        if n_req == 0:
            return 0.0
        n = float(c.sum())
        if n <= self._tx_max:
            t = float(np.interp(n, self._tx, self._ty))
        else:
            t = self._ty_max + self._tslope * (n - self._tx_max)
        attn = np.maximum(self._k_flop * (c * (u + 0.5 * c)), self._k_byte * (u + c))
        t += float(attn.sum()) + self._launch
        t += max(self._head_w_ms, self._head_flop_ms * n_req) + self.cpu_overhead_ms
        if rng is not None:
            s = self.noise_sigma
            t *= math.exp(s * rng.standard_normal() - 0.5 * s * s)
        return t

    def batch_ms(self, batches: list[tuple[np.ndarray, np.ndarray]],
                 rng: np.random.Generator | None = None) -> np.ndarray:
        """Latencies (ms) of many batches at once, vectorised over the
        concatenated requests; equal to ``iteration_ms`` per batch when noise-free."""
        m = len(batches)
        if m == 0:
            return np.zeros(0)
        lens = np.array([len(b[0]) for b in batches])
        seg = np.repeat(np.arange(m), lens)
        c = np.concatenate([np.asarray(b[0], np.float64) for b in batches]) if lens.sum() else np.zeros(0)
        u = np.concatenate([np.asarray(b[1], np.float64) for b in batches]) if lens.sum() else np.zeros(0)
        live = c > 0
        attn = np.maximum(self._k_flop * (c * (u + 0.5 * c)), self._k_byte * (u + c))

        def seg_sum(x: np.ndarray) -> np.ndarray:
            return np.bincount(seg, weights=x, minlength=m)

        n = seg_sum(np.where(live, c, 0.0))
        n_req = seg_sum(live.astype(float))
        t = self.token_curve(n) + seg_sum(np.where(live, attn, 0.0)) + self._launch
        t += np.maximum(self._head_w_ms, self._head_flop_ms * n_req) + self.cpu_overhead_ms
        if rng is not None:
            s = self.noise_sigma
            t *= np.exp(s * rng.standard_normal(m) - 0.5 * s * s)
        return np.where(n > 0, t, 0.0)

    # ------------------------------------------------------------ insight
    def components_ms(self, c: np.ndarray, u: np.ndarray) -> dict[str, float]:
        """Noise-free breakdown of :meth:`iteration_ms` (for reports and tests)."""
        c = np.asarray(c, dtype=np.float64)
        u = np.asarray(u, dtype=np.float64)
        n = float(c[c > 0].sum())
        n_req = int(np.count_nonzero(c > 0))
        L = self.profile.layers
        live = c > 0
        c, u = c[live], u[live]
        attn = np.maximum(self._k_flop * (c * (u + 0.5 * c)), self._k_byte * (u + c))
        launch = self._launch if n_req else 0.0
        p = c > 1
        return {
            "linear": float(self.linear_curve(n)) * L,
            "allreduce": float(self.allreduce_curve(n)) * 2 * L if n > 0 else 0.0,
            "embedding": float(self.emb_curve(n)) if n > 0 else 0.0,
            "attention_prefill": float(attn[p].sum()),
            "attention_decode": float(attn[~p].sum()),
            "attention_launch": launch,
            "lm_head": max(self._head_w_ms, self._head_flop_ms * n_req) if n_req else 0.0,
            "cpu": self.cpu_overhead_ms if n > 0 else 0.0,
        }


class UnknownProfileError(KeyError):
    """A profile key that is not in :data:`PROFILES` (the message lists the valid ones)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@cache
def _load(key: str, root: str) -> GroundTruth:
    return GroundTruth(PROFILES[key], Path(root))


def load_ground_truth(key: str = DEFAULT_PROFILE, data_root: Path | str | None = None) -> GroundTruth:
    """The (cached) ground truth of a profile; ``data_root`` defaults to
    :func:`engine_adapter.data.data_dir` (``SLIDINGSERVE_DATA``, else the bundled data)."""
    if key not in PROFILES:
        raise UnknownProfileError(f"unknown GPU profile {key!r}; valid: {', '.join(sorted(PROFILES))}")
    if data_root is None:
        data_root = data_dir()
    return _load(key, str(Path(data_root).resolve()))
