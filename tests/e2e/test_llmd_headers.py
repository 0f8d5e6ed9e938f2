"""llm-d's SLO headers through a real ``vllm serve`` with ``--middleware
engine_adapter.vllm.headers.LlmdSloHeaders``: the SLOs reach the scheduling service.

``make e2e`` runs it (``.venv-e2e``: the CPU build of vLLM).  vLLM's OpenAI server runs the
tiny Llama with the adapter (``RemoteSyncScheduler``) as its scheduler and the middleware in
front of its routes; the scheduling service is a ``SchedulerServer`` in this process whose
policy records every snapshot it is asked to plan (then plans with the real ``slidingserve``
policy), so the check reads what the adapter sent: each request's ``ttft_slo`` (and
``tpot_slo``), matched by the ``X-Request-Id`` the
test gives it.  vLLM's request log (``--enable-log-requests``) shows the
``SamplingParams.extra_args`` the middleware produced, ``slo_tpot_ms`` included.  A
malformed header gets HTTP 400 and never reaches the engine; the server serves on.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler_service.core import registry

from ..grpc_support import inject, make_server
from .command import ServeCommand
from .conftest import VllmServer, wait_for

pytestmark = pytest.mark.timeout(1200)

MIDDLEWARE = "engine_adapter.vllm.headers.LlmdSloHeaders"
POLICY = "llmd-recorder"
TTFT, TPOT = "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms"


class RecordingPolicy:
    """Records each request's SLO columns by request id, then plans with ``slidingserve``."""

    name = POLICY
    version = "test"
    params = None

    def __init__(self) -> None:
        self.inner = registry.create("slidingserve")
        self.lock = threading.Lock()
        self.seen: dict[str, dict[str, float]] = {}

    def plan(self, snapshot: Any, predictor: Any) -> Any:
        cols = {n: getattr(snapshot, n) for n in ("ttft_slo", "tbt_slo", "tpot_slo")}
        with self.lock:
            for i, rid in enumerate(snapshot.ids):
                self.seen[rid] = {n: float(c[i]) for n, c in cols.items()}
        return self.inner.plan(snapshot, predictor)

    def slo_of(self, tag: str) -> dict[str, float] | None:
        """The columns of the request whose vLLM id contains ``tag`` (the X-Request-Id)."""
        with self.lock:
            hits = [v for rid, v in self.seen.items() if tag in rid]
        return hits[-1] if hits else None


@dataclass(frozen=True)
class LlmdCommand(ServeCommand):
    """The tested ``vllm serve`` command plus the middleware, the request log, and the
    recording policy (pinned; a long deadline so that no iteration goes native)."""

    def env(self) -> dict[str, str]:
        return {**super().env(), "SLIDINGSERVE_DEPLOYMENT": POLICY, "SLIDINGSERVE_DEADLINE_MS": "5000"}

    def args(self) -> list[str]:
        return [*super().args(), "--middleware", MIDDLEWARE, "--enable-log-requests"]


@pytest.fixture(scope="module")
def recorder() -> Iterator[tuple[str, RecordingPolicy]]:
    server = make_server().start()
    policy = RecordingPolicy()
    inject(server, policy)  # type: ignore[arg-type]  # a policy, duck-typed as the injected ones are
    try:
        yield server.target, policy
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def vllm_llmd(root: Path, model: str, recorder: tuple[str, RecordingPolicy]) -> Iterator[VllmServer]:
    address, _ = recorder
    v = VllmServer(root, model, SimpleNamespace(address=address), tp=1, engine_id="e2e-llmd")  # type: ignore[arg-type]
    v.cmd = LlmdCommand(model=model, port=v.cmd.port, address=address, metrics_port=v.cmd.metrics_port)
    v.log = root / "vllm-llmd.log"
    try:
        v.start()
        yield v
    finally:
        v.stop()


def post(v: VllmServer, rid: str, headers: dict[str, str], *, stream: bool = False,
         xargs: dict[str, Any] | None = None, max_tokens: int = 6) -> tuple[int, Any]:
    """POST /v1/completions; (status, JSON body, or for a stream the list of its events)."""
    import httpx

    body: dict[str, Any] = {"model": v.cmd.model, "prompt": list(range(3, 40)), "max_tokens": max_tokens,
                            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    hdrs = {"X-Request-Id": rid, "Connection": "close", **headers}
    with httpx.Client(timeout=600) as c:
        if not stream:
            r = c.post(f"{v.base_url}/completions", json=body, headers=hdrs)
            return r.status_code, r.json()
        with c.stream("POST", f"{v.base_url}/completions", json=body, headers=hdrs) as r:
            events = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
            return r.status_code, events


def completion_tokens(status: int, out: Any) -> int:
    assert status == 200, out
    if isinstance(out, dict):
        return int(out["usage"]["completion_tokens"])
    assert out[-1] == "[DONE]", out[-3:]
    return int(next(json.loads(e)["usage"]["completion_tokens"] for e in reversed(out[:-1])
                    if json.loads(e).get("usage")))


def received(v: VllmServer, rid: str) -> list[str]:
    """vLLM's request-log lines of ``rid`` (``Received request cmpl-<rid>-…: params: …``)."""
    return [ln for ln in v.output().splitlines() if "Received request" in ln and rid in ln]


def test_headers_reach_the_scheduling_service(vllm_llmd: VllmServer,
                                              recorder: tuple[str, RecordingPolicy]) -> None:
    _, rec = recorder
    v = vllm_llmd
    assert completion_tokens(*post(v, "llmd-hdr", {TTFT: "4321", TPOT: "87"})) == 6
    assert completion_tokens(*post(v, "llmd-body", {TTFT: "4321", TPOT: "87"}, xargs={"slo_ttft_ms": 2345})) == 6
    assert completion_tokens(*post(v, "llmd-stream", {TTFT: "3456"}, stream=True)) == 6
    assert completion_tokens(*post(v, "llmd-none", {})) == 6

    # The service planned each request with the objective the header (or the body) set.
    got = {rid: rec.slo_of(rid) or {} for rid in ("llmd-hdr", "llmd-body", "llmd-stream", "llmd-none")}
    assert all(got.values()), f"not in any snapshot: {[r for r, s in got.items() if not s]}; seen {list(rec.seen)[:8]}"
    assert got["llmd-hdr"]["ttft_slo"] == pytest.approx(4.321)
    assert got["llmd-body"]["ttft_slo"] == pytest.approx(2.345)  # the body's explicit value wins
    assert got["llmd-stream"]["ttft_slo"] == pytest.approx(3.456)
    assert all(got["llmd-none"]["ttft_slo"] != pytest.approx(x) for x in (4.321, 2.345, 3.456))
    assert got["llmd-hdr"]["tpot_slo"] == pytest.approx(0.087)
    assert got["llmd-none"]["tpot_slo"] == 0.0

    # vLLM's SamplingParams.extra_args, as its request log prints them.
    (line,) = received(v, "llmd-hdr")
    assert re.search(r"extra_args=\{'slo_ttft_ms': 4321, 'slo_tpot_ms': 87\}", line), line
    (line,) = received(v, "llmd-body")
    assert re.search(r"extra_args=\{'slo_ttft_ms': 2345, 'slo_tpot_ms': 87\}", line), line
    (line,) = received(v, "llmd-none")
    assert "extra_args=None" in line, line


def test_a_bad_header_is_a_400_and_the_server_serves_on(vllm_llmd: VllmServer,
                                                        recorder: tuple[str, RecordingPolicy]) -> None:
    _, rec = recorder
    v = vllm_llmd
    for rid, headers in (("llmd-bad-word", {TTFT: "soon"}), ("llmd-bad-neg", {TPOT: "-5"})):
        status, out = post(v, rid, headers)
        (name,) = headers
        assert status == 400, out
        assert out["error"]["code"] == 400 and out["error"]["param"] == name and name in out["error"]["message"]
        assert received(v, rid) == [] and rec.slo_of(rid) is None, "a rejected request reached the engine"
    status, out = post(v, "llmd-bad-stream", {TTFT: "0"}, stream=True)
    assert status == 400
    # the next request is served, with its SLO
    assert completion_tokens(*post(v, "llmd-after", {TTFT: "1234"})) == 6
    wait_for("the request after the 400s in a snapshot", lambda: rec.slo_of("llmd-after") is not None, 10)
    assert (rec.slo_of("llmd-after") or {}).get("ttft_slo") == pytest.approx(1.234)
