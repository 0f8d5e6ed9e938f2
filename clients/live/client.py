"""The client side of a live run: every request streamed with the ``openai`` client at its
arrival time, every output token timestamped as its chunk arrives.

Prompts go as token ids (``/v1/completions`` accepts a list of ints) with ``ignore_eos`` so
that each request produces exactly its trace's output length; ``return_token_ids`` gives
the tokens of each chunk.  A later turn of a multi-turn chat is sent once the turn before it
finished and its think time passed, with that turn's prompt and output before its own.
One connection per request: a kept-alive connection that the server closes while the pool
reuses it would fail a request for a reason that has nothing to do with scheduling.

The client shares a core with vLLM's API server (and, remote, the scheduling service), so
its event loop is sometimes late: a token read late is timestamped late, and a request due
while the loop is busy is sent late.  :class:`LoopLag` measures that lag all through the
run, so that the report can tell the client's delays from the engine's, and the simulated
replay can add them back (:mod:`.sim`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from .measure import RequestResult
from .workload import LiveRequest

__all__ = ["LoopLag", "run_requests"]

#: How often the lag monitor wakes (s), and the least lag it records (s).
_TICK_S = 0.005
_MIN_LAG_S = 0.002


class LoopLag:
    """How late the client's event loop ran, sampled every few milliseconds: ``samples``
    holds ``(seconds since the run's start, lag in seconds)`` for every wake-up at least
    2 ms late (the rest are on time)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.ticks = 0

    async def watch(self, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            due = time.monotonic() + _TICK_S
            await asyncio.sleep(_TICK_S)
            lag = time.monotonic() - due
            self.ticks += 1
            if lag >= _MIN_LAG_S:
                self.samples.append((due - t0, lag))

    def summary(self) -> dict[str, float]:
        """p99 and maximum lag (ms) over every wake-up, and the seconds spent over 50 ms late."""
        import numpy as np

        lags = np.array([x for _, x in self.samples])
        every = np.concatenate([np.zeros(max(self.ticks - len(lags), 0)), lags])  # on time = 0
        return {"loop_lag_p99_ms": 1e3 * float(np.percentile(every, 99)) if len(every) else 0.0,
                "loop_lag_max_ms": 1e3 * float(lags.max()) if len(lags) else 0.0,
                "loop_stalled_s": float(lags[lags > 0.05].sum())}


async def _history(req: LiveRequest, prev: asyncio.Task[RequestResult] | None) -> list[int] | str:
    """The prompt to send: ``req.prompt``, after the conversation's history for a later turn
    (awaited, then a think time); a string when the previous turn failed."""
    if prev is None:
        return list(req.prompt)
    before = await prev
    if not before.complete or len(before.output_ids) != len(before.token_times):
        return f"the conversation's previous turn (request {before.index}) failed or returned no token ids"
    await asyncio.sleep(req.think_s)
    return before.prompt_ids + before.output_ids + list(req.prompt)


async def _one(client: Any, model: str, req: LiveRequest, t0: float, timeout_s: float,
               xargs: dict[str, Any] | None, prev: asyncio.Task[RequestResult] | None = None) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
    prompt = await _history(req, prev)
    now = time.monotonic()
    res = RequestResult(req.index, now, req.output_len, due=t0 + req.at_s if prev is None else now)
    if isinstance(prompt, str):
        res.error = prompt
        return res
    res.prompt_ids = prompt
    body: dict[str, Any] = {"ignore_eos": True, "min_tokens": req.output_len, "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=req.output_len, stream=True,
            temperature=0.0, timeout=timeout_s,
            extra_body=body,
        )
        async for chunk in stream:
            now = time.monotonic()
            for choice in chunk.choices:
                ids = getattr(choice, "token_ids", None)
                if ids is None and getattr(choice, "model_extra", None):
                    ids = choice.model_extra.get("token_ids")
                n = len(ids) if ids is not None else (1 if choice.text else 0)
                res.token_times.extend([now] * n)
                res.output_ids.extend(ids or ())
    except Exception as e:  # the run goes on; the request counts as a miss
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


async def _run(base_url: str, model: str, requests: Sequence[LiveRequest], timeout_s: float,
               on_done: Callable[[int], None] | None, xargs: dict[str, Any] | None,
               lag: LoopLag | None) -> list[RequestResult]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_keepalive_connections=0, max_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as http:
        client = AsyncOpenAI(base_url=base_url, api_key="live-bench", max_retries=0, http_client=http)
        t0 = time.monotonic() + 0.05
        stop = asyncio.Event()
        watch = asyncio.create_task(lag.watch(t0, stop)) if lag is not None else None
        tasks: dict[int, asyncio.Task[RequestResult]] = {}
        for r in requests:  # a later turn waits for its conversation's previous request
            tasks[r.index] = asyncio.create_task(_one(client, model, r, t0, timeout_s, xargs, tasks.get(r.prev)))
        out = []
        for fut in asyncio.as_completed(tasks.values()):
            out.append(await fut)
            if on_done is not None:
                on_done(len(out))
        stop.set()
        if watch is not None:
            await watch
    return sorted(out, key=lambda r: r.index)


def run_requests(base_url: str, model: str, requests: Sequence[LiveRequest], *, timeout_s: float = 300.0,
                 on_done: Callable[[int], None] | None = None,
                 xargs: dict[str, Any] | None = None, lag: LoopLag | None = None) -> list[RequestResult]:
    """Send ``requests`` at their arrival times to ``base_url`` (``http://host:port/v1``),
    each with ``xargs`` as its ``vllm_xargs`` (the adapter's per-request SLOs); the results
    of every request, in request order.  ``lag`` records the event loop's lag meanwhile."""
    return asyncio.run(_run(base_url, model, requests, timeout_s, on_done, xargs, lag))
