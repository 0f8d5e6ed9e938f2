"""What :func:`~scheduler_service.core.kernels.warm_up` runs: every policy on tiny snapshots.

numba compiles one version of a kernel per argument-type signature, so the surest way
to have each one compiled for the types a real decision passes is to make real
decisions: snapshots built the way the service builds them (read-only columns), every
registered policy, paths from idle to BatchConstructor.  :func:`missing` names the
kernels that did not run (a test keeps it empty).

The policies come from the caller (:func:`exercise` is handed the registry's ``create``
and ``names``; :mod:`..registry` hands the kernels a workload that calls it): the kernels
stand below the policies and import none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..snapshot import Request, Snapshot
from ..sorter import class_late_set, late_set, mlps_keys, prefill_indices

if TYPE_CHECKING:
    from ..policy import Policy
    from ..predictor import BatchLatencyPredictor

__all__ = ["exercise", "missing", "snapshots"]


def snapshots(n_snapshots: int = 24, n: int = 24) -> list[Snapshot]:
    """Small snapshots, deterministic: decodes, waiting and part-prefilled requests,
    slacks around zero (risky anchors, expired requests), tight KV on some."""
    out = []
    for seed in range(n_snapshots):
        rng = np.random.default_rng(seed)
        prompt = rng.integers(1, 120, n)
        kind = rng.random(n)
        decoding = kind < 0.35
        started = (kind >= 0.35) & (kind < 0.55) & (prompt > 1)
        computed = np.where(decoding, prompt, np.where(started, (prompt * rng.random(n)).astype(np.int64), 0))
        computed = np.where(started, np.clip(computed, 1, prompt - 1), computed)
        out.append(Snapshot.from_columns(
            now=10.0, max_batch_tokens=int(rng.choice([32, 64, 256])), max_num_seqs=int(rng.choice([4, 64])),
            free_kv_tokens=None if seed % 3 else int(rng.integers(50, 2000)),
            prefill_throughput=None if seed % 2 else 2000.0,
            ids=[f"w{i}" for i in range(n)], arrival=10.0 - rng.uniform(0.0, 1.0, n),
            prompt_tokens=prompt, computed_tokens=computed,
            output_tokens=np.where(decoding, rng.integers(1, 20, n), 0),
            ttft_slo=rng.uniform(0.05, 1.5, n), tbt_slo=rng.uniform(0.01, 0.2, n),
            protected=rng.random(n) < 0.15,
        ))
    return out


def _risky() -> Snapshot:
    """A short prompt at risk behind a long protected one, nothing starving: SlidingServe
    takes the BatchConstructor path (its knapsack kernels), which the random snapshots above
    seldom reach (a request that waited 3 TTFTs keeps it out)."""
    reqs = [Request("d", 9.0, 10, computed_tokens=10, output_tokens=1, ttft_slo=1.0, tbt_slo=0.1), Request("L", 9.0, 2000, ttft_slo=2.0, protected=True, tbt_slo=0.1),
            Request("S", 9.9, 20, ttft_slo=0.15, tbt_slo=0.1)]
    return Snapshot.from_requests(reqs, now=10.0, max_batch_tokens=2048, prefill_throughput=10000.0)


def exercise(create: Callable[..., Policy], names: Iterable[str], pred: BatchLatencyPredictor) -> None:
    """Plan every snapshot with every policy of ``names`` (built by ``create(name)``, the
    registry's), SlidingServe with windows 1 to 4, predicting with ``pred``, and explain
    each plan (the reasons' kernel)."""
    from ..batch import CandidateQueue  # deferred: these import the kernels
    from ..reasons import plan_explained

    policies = [create(name) for name in names]
    policies += [create("slidingserve", {"window": k}) for k in (1, 3, 4)]
    for snap in [*snapshots(), _risky()]:
        for pol in policies:
            pol.plan(snap, pred)
            len(plan_explained(pol, snap, pred).reasons)  # classified: the reasons kernel
        pre = prefill_indices(snap)  # what the policies fuse into other kernels, and the tools' own
        late_set(snap, pre, 1000.0)
        class_late_set(snap, pre, 1000.0)
        mlps_keys(snap, pre, 1000.0, 1.0, 1e-3)
        cq = CandidateQueue.build(snap, pred, np.flatnonzero(snap.is_decoding), pre, n_all_decodes=0)
        cq.segment_time_ms(np.zeros(1, dtype=np.int64), np.full(1, cq.supply), 1)


def missing() -> list[str]:
    """Public kernels with no compiled signature yet."""
    from . import _compiled  # deferred: the registry imports this module with the core, numba is not

    return [name for name in _compiled.__all__ if not getattr(_compiled, name).signatures]
