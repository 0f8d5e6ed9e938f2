"""llm-d's per-request SLO headers → ``vllm_xargs`` → ``SamplingParams.extra_args``.

llm-d's router (the endpoint picker of an ``InferencePool``) takes a request's latency
objectives from the HTTP headers ``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` and
forwards them to the model server.  vLLM's OpenAI server does not read them; it does pass a
request body's ``vllm_xargs`` object on as ``SamplingParams.extra_args``, which is where the
adapter reads a request's SLOs (:func:`engine_adapter.vllm.snapshot.request_slo`).

:class:`LlmdSloHeaders` joins the two without a fork of vLLM: a pure ASGI middleware that
vLLM loads itself::

    vllm serve MODEL --scheduler-cls engine_adapter.vllm.RemoteScheduler \\
        --middleware engine_adapter.vllm.headers.LlmdSloHeaders

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` that carry at least one of
the headers it merges ``{"slo_ttft_ms": X, "slo_tpot_ms": Y}`` into the JSON body's
``vllm_xargs``:

* a key the body already sets wins (the client's explicit value over the router's);
* a header value must be a positive, finite number of milliseconds (``250``, ``12.5``);
  anything else (or the header repeated with different values) is answered with HTTP 400
  naming the header, in the OpenAI error format vLLM uses, and never reaches the engine;
* a body that is not a JSON object, or whose ``vllm_xargs`` is not an object, is passed on
  untouched (vLLM answers it as it would without the middleware), as are other paths and
  methods, requests without the headers, and every response (streaming included).

``slo_tpot_ms`` is the time-per-output-token objective (mean milliseconds per output token
after the first), the key the adapter reads for TPOT; ``slo_ttft_ms`` is the TTFT objective
(docs/vllm.md, "llm-d's SLO headers").

Nothing here imports vLLM or Starlette: the class is plain ASGI, testable on its own.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

__all__ = ["HEADERS", "PATHS", "HeaderError", "LlmdSloHeaders", "merge_slo", "parse_slo_headers"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: llm-d header → the ``extra_args`` key the adapter reads.
HEADERS: dict[str, str] = {
    "x-llm-d-slo-ttft-ms": "slo_ttft_ms",
    "x-llm-d-slo-tpot-ms": "slo_tpot_ms",
}
#: The OpenAI endpoints whose body carries ``vllm_xargs`` into ``SamplingParams``.
PATHS: frozenset[str] = frozenset({"/v1/completions", "/v1/chat/completions"})

_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?")
_RAW = {name.encode("latin-1"): name for name in HEADERS}


class HeaderError(ValueError):
    """A malformed SLO header; ``header`` names it."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


def _milliseconds(header: str, values: list[str]) -> int | float:
    if len(set(values)) > 1:
        raise HeaderError(header, f"header {header} is given {len(values)} times with different values "
                                  f"({', '.join(map(repr, values))}); send it once")
    text = values[0].strip()
    v = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not (math.isfinite(v) and v > 0):
        raise HeaderError(header, f"header {header} must be a positive number of milliseconds, "
                                  f"got {values[0][:64]!r}")
    return int(v) if v.is_integer() and v < 2**63 else v


def parse_slo_headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, int | float]:
    """ASGI header pairs → ``{"slo_ttft_ms": …, "slo_tpot_ms": …}`` (only the keys whose
    header is present); raises :class:`HeaderError` for a malformed value."""
    seen: dict[str, list[str]] = {}
    for raw_name, raw_value in headers:
        name = _RAW.get(raw_name.lower())
        if name is not None:
            seen.setdefault(name, []).append(raw_value.decode("latin-1"))
    return {HEADERS[name]: _milliseconds(name, values) for name, values in seen.items()}


def merge_slo(body: bytes, slo: Mapping[str, float]) -> bytes | None:
    """``body`` with ``slo`` merged into its ``vllm_xargs`` (keys the body sets win), or
    None when the body is not a JSON object with an object (or no) ``vllm_xargs``, or
    already sets every key: then the request goes on unchanged."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    xargs = doc.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        return None
    missing = {k: v for k, v in slo.items() if k not in xargs}
    if not missing:
        return None
    doc["vllm_xargs"] = {**xargs, **missing}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


class LlmdSloHeaders:
    """ASGI middleware: llm-d's SLO headers into the body's ``vllm_xargs`` (module docstring).

    vLLM builds it as ``LlmdSloHeaders(app)`` (``--middleware``); ``paths`` is for tests and
    other servers."""

    def __init__(self, app: ASGIApp, paths: Iterable[str] = PATHS) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not self._applies(scope):
            await self.app(scope, receive, send)
            return
        try:
            slo = parse_slo_headers(scope.get("headers") or ())
        except HeaderError as e:
            log.debug("slidingserve: rejected %s: %s", scope.get("path"), e)
            await _bad_request(send, str(e), e.header)
            return
        if not slo:
            await self.app(scope, receive, send)
            return
        body, disconnected = await _read_body(receive)
        if disconnected:
            return  # the client is gone before it finished sending: nothing to answer
        merged = merge_slo(body, slo)
        if merged is not None:
            scope = {**scope, "headers": _with_length(scope.get("headers") or (), len(merged))}
            body = merged
        await self.app(scope, _replay(body, receive), send)

    def _applies(self, scope: Scope) -> bool:
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root):]
        return path in self.paths


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole request body; (body, True) when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the client's own messages (a disconnect, later)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(headers: Iterable[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    drop = (b"content-length", b"transfer-encoding")
    return [(k, v) for k, v in headers if k.lower() not in drop] + [(b"content-length", str(length).encode())]


async def _bad_request(send: Send, message: str, header: str) -> None:
    """HTTP 400 in the error format of vLLM's OpenAI server."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": header,
                                 "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
