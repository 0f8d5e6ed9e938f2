"""Run independent benchmark jobs in parallel: a process pool, Ray, or inline.

A job is a :class:`~clients.bench.runner.RunSpec` (one run) or a
:class:`~clients.bench.goodput.GoodputSpec` (one goodput search); both are
plain picklable dataclasses and :func:`execute` is the one function every
backend calls, so the process pool and Ray compute exactly the same thing.

Processes are *spawned*, not forked: the parent may hold threads (the
adapter's report thread, gRPC), and forking a threaded process can deadlock.
The parent fits each profile's predictor once and hands it to the workers,
which would otherwise each repeat the profiling sweep.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

import clients
import engine_adapter
import scheduler_service

from .goodput import GoodputSpec, goodput_job
from .runner import RunSpec, install_predictors, profile_predictor, quiet_logs, run

__all__ = ["EXECUTORS", "ExecutorUnavailable", "Job", "describe", "execute", "run_jobs"]

Job = RunSpec | GoodputSpec
EXECUTORS = ("process", "ray")


class ExecutorUnavailable(RuntimeError):
    """The requested executor cannot be used here (e.g. Ray is not installed)."""


def execute(job: Job) -> dict[str, Any]:
    """Run one job in this process."""
    quiet_logs()
    if isinstance(job, GoodputSpec):
        return goodput_job(job)
    return run(job)


def _execute_with(predictors: dict[str, str], job: Job) -> dict[str, Any]:
    """:func:`execute` after seeding the predictor cache (Ray tasks have no initializer)."""
    install_predictors(predictors)
    return execute(job)


def describe(job: Job) -> str:
    r = job.run if isinstance(job, GoodputSpec) else job
    what = "goodput" if isinstance(job, GoodputSpec) else f"{r.rate:.2f} rps"
    return f"{r.name} seed {r.seed} {what}"


def _profiles(jobs: Sequence[Job]) -> dict[str, str]:
    keys = {(j.run if isinstance(j, GoodputSpec) else j).profile for j in jobs}
    return {k: profile_predictor(k).to_json() for k in sorted(keys)}


def run_jobs(jobs: Sequence[Job], *, workers: int | None = None, executor: str = "process",
             on_done: Callable[[Job, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run ``jobs``; results in the order of ``jobs``.  ``on_done`` is called in this
    process as each job finishes (progress).  ``workers=1`` runs inline."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
    if not jobs:
        return []
    if executor == "ray":
        return _run_ray(jobs, workers, on_done)
    n = min(workers or os.cpu_count() or 1, len(jobs))
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    if n <= 1:
        for i, job in enumerate(jobs):
            results[i] = execute(job)
            if on_done:
                on_done(job, results[i])  # type: ignore[arg-type]
        return results  # type: ignore[return-value]
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=install_predictors,
                                initargs=(_profiles(jobs),)) as pool:
        futures = {pool.submit(execute, job): i for i, job in enumerate(jobs)}
        try:
            for fut in cf.as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                if on_done:
                    on_done(jobs[i], results[i])  # type: ignore[arg-type]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results  # type: ignore[return-value]


def _run_ray(jobs: Sequence[Job], workers: int | None,
             on_done: Callable[[Job, dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    """The same :func:`execute` as Ray tasks: local Ray, or the cluster at RAY_ADDRESS."""
    try:
        import ray  # lazy: Ray is an optional extra (pip install 'slidingserve[ray]')
    except ImportError:
        raise ExecutorUnavailable("--executor ray needs the 'ray' package (pip install 'ray[default]')") from None
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
        if os.environ.get("RAY_ADDRESS"):
            # A cluster's nodes need this project's code: ship its packages.
            mods = [os.path.dirname(m.__file__ or "") for m in (clients, engine_adapter, scheduler_service)]
            env = {k: v for k, v in os.environ.items() if k == "SLIDINGSERVE_DATA"}
            kwargs["runtime_env"] = {"py_modules": mods, "env_vars": env}
        elif workers:
            kwargs["num_cpus"] = workers
        ray.init(**kwargs)
    remote = ray.remote(num_cpus=1)(_execute_with)
    predictors = ray.put(_profiles(jobs))
    refs = {remote.remote(predictors, job): i for i, job in enumerate(jobs)}
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = refs[ref]
                results[i] = ray.get(ref)
                if on_done:
                    on_done(jobs[i], results[i])  # type: ignore[arg-type]
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    return results  # type: ignore[return-value]
