"""The client side of a live run: every request streamed with the ``openai`` client at its
arrival time, every output token timestamped as its chunk arrives.

Prompts go as token ids (``/v1/completions`` accepts a list of ints) with ``ignore_eos`` so
that each request produces exactly its trace's output length; ``return_token_ids`` gives
the number of tokens in each chunk.  One connection per request: a kept-alive connection
that the server closes while the pool reuses it would fail a request for a reason that has
nothing to do with scheduling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from .measure import RequestResult
from .workload import LiveRequest

__all__ = ["run_requests"]


async def _one(client: Any, model: str, req: LiveRequest, t0: float, timeout_s: float,
               xargs: dict[str, Any] | None) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
    res = RequestResult(req.index, time.monotonic(), req.output_len, due=t0 + req.at_s)
    body: dict[str, Any] = {"ignore_eos": True, "min_tokens": req.output_len, "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    try:
        stream = await client.completions.create(
            model=model, prompt=list(req.prompt), max_tokens=req.output_len, stream=True,
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
    except Exception as e:  # the run goes on; the request counts as a miss
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


async def _run(base_url: str, model: str, requests: Sequence[LiveRequest], timeout_s: float,
               on_done: Callable[[int], None] | None, xargs: dict[str, Any] | None) -> list[RequestResult]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_keepalive_connections=0, max_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as http:
        client = AsyncOpenAI(base_url=base_url, api_key="live-bench", max_retries=0, http_client=http)
        t0 = time.monotonic() + 0.05
        tasks = [asyncio.create_task(_one(client, model, r, t0, timeout_s, xargs)) for r in requests]
        out = []
        for fut in asyncio.as_completed(tasks):
            out.append(await fut)
            if on_done is not None:
                on_done(len(out))
    return sorted(out, key=lambda r: r.index)


def run_requests(base_url: str, model: str, requests: Sequence[LiveRequest], *, timeout_s: float = 300.0,
                 on_done: Callable[[int], None] | None = None,
                 xargs: dict[str, Any] | None = None) -> list[RequestResult]:
    """Send ``requests`` at their arrival times to ``base_url`` (``http://host:port/v1``),
    each with ``xargs`` as its ``vllm_xargs`` (the adapter's per-request SLOs); the results
    of every request, in request order."""
    return asyncio.run(_run(base_url, model, requests, timeout_s, on_done, xargs))
