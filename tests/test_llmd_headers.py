"""llm-d's SLO headers (``x-llm-d-slo-ttft-ms``, ``x-llm-d-slo-tpot-ms``) into ``vllm_xargs``:
:mod:`engine_adapter.vllm.headers`, as plain ASGI, behind FastAPI the way vLLM's
``--middleware`` adds it, into vLLM's own request models, and the llm-d example manifests.

The end-to-end check through a real ``vllm serve`` is tests/e2e/test_llmd_headers.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_adapter.vllm.headers import (
    HEADERS,
    PATHS,
    HeaderError,
    LlmdSloHeaders,
    merge_slo,
    parse_slo_headers,
)
from engine_adapter.vllm.snapshot import SloDefaults, request_slo

ROOT = Path(__file__).resolve().parents[1]
LLMD = ROOT / "deploy" / "kubernetes" / "llm-d"
TTFT, TPOT = "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms"
MIDDLEWARE = "engine_adapter.vllm.headers.LlmdSloHeaders"


def h(**kw: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kw.items()]


# ------------------------------------------------------------------ header parsing
def test_headers_and_keys_are_llmds_and_the_adapters() -> None:
    assert HEADERS == {TTFT: "slo_ttft_ms", TPOT: "slo_tpot_ms"}
    assert PATHS == {"/v1/completions", "/v1/chat/completions"}


@pytest.mark.parametrize(("raw", "want"), [("250", 250), ("12.5", 12.5), (" 40 ", 40), ("1e3", 1000),
                                            (".5", 0.5), ("100.", 100), ("0.001", 0.001)])
def test_parses_positive_milliseconds(raw: str, want: float) -> None:
    got = parse_slo_headers(h(x_llm_d_slo_ttft_ms=raw))
    assert got == {"slo_ttft_ms": want} and type(got["slo_ttft_ms"]) is type(want)


def test_parses_both_case_insensitively_and_ignores_other_headers() -> None:
    got = parse_slo_headers([(b"X-LLM-D-SLO-TTFT-MS", b"500"), (b"x-llm-d-slo-tpot-ms", b"25"),
                             (b"x-llm-d-inference-objective", b"gold"), (b"content-type", b"application/json")])
    assert got == {"slo_ttft_ms": 500, "slo_tpot_ms": 25}
    assert parse_slo_headers(h(content_type="application/json")) == {}
    assert parse_slo_headers(h(x_llm_d_slo_tpot_ms="30")) == {"slo_tpot_ms": 30}


@pytest.mark.parametrize("raw", ["", " ", "abc", "-5", "0", "0.0", "nan", "NaN", "inf", "Infinity", "1e400",
                                 "1_000", "0x10", "10ms", "10,20", "+5", "5 5", "\u0665"])
def test_bad_values_raise_naming_the_header(raw: str) -> None:
    for name in (TTFT, TPOT):
        with pytest.raises(HeaderError) as e:
            parse_slo_headers([(name.encode(), raw.encode())])
        assert e.value.header == name and name in str(e.value)


def test_a_repeated_header_must_agree() -> None:
    assert parse_slo_headers(h(x_llm_d_slo_ttft_ms="100") * 2) == {"slo_ttft_ms": 100}
    with pytest.raises(HeaderError, match="x-llm-d-slo-ttft-ms is given 2 times"):
        parse_slo_headers(h(x_llm_d_slo_ttft_ms="100") + h(x_llm_d_slo_ttft_ms="200"))


# ------------------------------------------------------------------ body merge
def test_merge_adds_vllm_xargs() -> None:
    out = merge_slo(b'{"model": "m", "prompt": "hi"}', {"slo_ttft_ms": 300, "slo_tpot_ms": 20.5})
    assert out is not None
    assert json.loads(out) == {"model": "m", "prompt": "hi", "vllm_xargs": {"slo_ttft_ms": 300, "slo_tpot_ms": 20.5}}


def test_merge_keeps_other_xargs_and_the_bodys_explicit_values() -> None:
    body = json.dumps({"prompt": [1, 2], "vllm_xargs": {"slo_ttft_ms": 999, "session_id": "s1"}}).encode()
    out = merge_slo(body, {"slo_ttft_ms": 300, "slo_tpot_ms": 20})
    assert out is not None
    assert json.loads(out)["vllm_xargs"] == {"slo_ttft_ms": 999, "session_id": "s1", "slo_tpot_ms": 20}
    assert merge_slo(json.dumps({"vllm_xargs": None}).encode(), {"slo_tpot_ms": 20}) is not None


def test_merge_leaves_what_it_cannot_or_need_not_change() -> None:
    slo = {"slo_ttft_ms": 300}
    for body in (b"", b"not json", b"\xff\xfe", b"[1, 2]", b'"text"', b"null",
                 b'{"vllm_xargs": "x"}', b'{"vllm_xargs": [1]}', b'{"vllm_xargs": {"slo_ttft_ms": 1}}'):
        assert merge_slo(body, slo) is None, body


def test_merge_keeps_unicode_and_numbers() -> None:
    body = '{"prompt": "héllo ✓", "temperature": 0.1, "max_tokens": 12345678901234}'.encode()
    out = merge_slo(body, {"slo_ttft_ms": 1})
    assert out is not None
    assert json.loads(out) == {**json.loads(body), "vllm_xargs": {"slo_ttft_ms": 1}}


# ------------------------------------------------------------------ the ASGI middleware
class Recorder:
    """An inner ASGI app: records the scope and the body it reads, answers 200 (or streams)."""

    def __init__(self, chunks: tuple[bytes, ...] = (b"ok",)) -> None:
        self.scope: dict[str, Any] | None = None
        self.body: bytes | None = None
        self.chunks = chunks
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        self.scope = dict(scope)
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.body = body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-inner", b"1")]})
        for i, c in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": c, "more_body": i < len(self.chunks) - 1})


def call(app: Any, *, path: str = "/v1/completions", method: str = "POST", headers: list[tuple[bytes, bytes]],
         body: bytes | list[bytes] = b"", scope_type: str = "http", root_path: str = "",
         disconnect: bool = False) -> list[dict[str, Any]]:
    parts = body if isinstance(body, list) else [body]
    msgs: list[dict[str, Any]] = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                                  for i, p in enumerate(parts)]
    if disconnect:
        msgs = [*msgs[:-1], {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {"type": scope_type, "method": method, "path": root_path + path, "root_path": root_path,
             "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def json_headers(body: bytes, **slo: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *h(**slo)]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_middleware_merges_and_fixes_the_length(path: str) -> None:
    inner = Recorder()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    sent = call(LlmdSloHeaders(inner), path=path, headers=json_headers(body, x_llm_d_slo_ttft_ms="400",
                                                                      x_llm_d_slo_tpot_ms="25"), body=body)
    assert sent[0]["status"] == 200
    assert inner.body is not None and inner.scope is not None
    assert json.loads(inner.body)["vllm_xargs"] == {"slo_ttft_ms": 400, "slo_tpot_ms": 25}
    lengths = [v for k, v in inner.scope["headers"] if k == b"content-length"]
    assert lengths == [str(len(inner.body)).encode()]
    assert (b"x-llm-d-slo-ttft-ms", b"400") in inner.scope["headers"]  # the headers stay for others


def test_middleware_reassembles_a_chunked_body_under_a_root_path() -> None:
    inner = Recorder()
    body = json.dumps({"prompt": "x" * 5000, "vllm_xargs": {"slo_tpot_ms": 7}}).encode()
    parts = [body[:100], body[100:4000], body[4000:]]
    call(LlmdSloHeaders(inner), root_path="/api", headers=[(b"transfer-encoding", b"chunked"),
                                                           *h(x_llm_d_slo_ttft_ms="900", x_llm_d_slo_tpot_ms="50")],
         body=parts)
    assert inner.body is not None and inner.scope is not None
    assert json.loads(inner.body)["vllm_xargs"] == {"slo_tpot_ms": 7, "slo_ttft_ms": 900}  # the body's 7 wins
    assert not any(k == b"transfer-encoding" for k, _ in inner.scope["headers"])


@pytest.mark.parametrize("raw", ["fast", "-1", "0", "nan"])
def test_middleware_answers_400_for_a_bad_header_and_never_calls_the_app(raw: str) -> None:
    inner = Recorder()
    sent = call(LlmdSloHeaders(inner), headers=json_headers(b"{}", x_llm_d_slo_tpot_ms=raw), body=b"{}")
    assert inner.calls == 0
    start, body = sent
    assert start["status"] == 400 and (b"content-type", b"application/json") in start["headers"]
    err = json.loads(body["body"])["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == TPOT
    assert TPOT in err["message"]


def test_middleware_passes_other_requests_through_untouched() -> None:
    body = b'{"prompt": "hi"}'
    slo = h(x_llm_d_slo_ttft_ms="400")
    bad = h(x_llm_d_slo_ttft_ms="bad")
    cases: list[dict[str, Any]] = [
        dict(path="/v1/embeddings", headers=slo),     # another path (even with a bad value)
        dict(path="/v1/embeddings", headers=bad),
        dict(path="/v1/completions/x", headers=slo),
        dict(method="GET", headers=bad),              # another method
        dict(headers=h(content_type="application/json")),  # no SLO header
    ]
    for case in cases:
        inner = Recorder()
        sent = call(LlmdSloHeaders(inner), body=body, **case)
        assert sent[0]["status"] == 200 and inner.body == body, case
        assert inner.scope is not None and inner.scope["headers"] == case["headers"], case


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"vllm_xargs": 3}', b'{"vllm_xargs": {"slo_ttft_ms": 5}}',
                                  b"\x1f\x8b\x08\x00gzip"])
def test_middleware_forwards_bodies_it_does_not_rewrite_byte_for_byte(body: bytes) -> None:
    inner = Recorder()
    headers = [(b"content-length", str(len(body)).encode()), *h(x_llm_d_slo_ttft_ms="400")]
    call(LlmdSloHeaders(inner), headers=headers, body=[body[:2], body[2:]])
    assert inner.body == body and inner.scope is not None and inner.scope["headers"] == headers


def test_middleware_leaves_non_http_scopes_and_responses_alone() -> None:
    inner = Recorder()
    call(LlmdSloHeaders(inner), scope_type="websocket", headers=h(x_llm_d_slo_ttft_ms="bad"))
    assert inner.calls == 1 and inner.scope is not None and inner.scope["type"] == "websocket"
    chunks = (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")
    inner = Recorder(chunks)
    sent = call(LlmdSloHeaders(inner), headers=h(x_llm_d_slo_ttft_ms="400"), body=b"{}")
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": [(b"x-inner", b"1")]}
    assert [m["body"] for m in sent[1:]] == list(chunks)
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


def test_middleware_hands_the_clients_later_messages_on() -> None:
    """After the body, ``receive`` is the client's again: a disconnect reaches the app."""
    got: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.append(await receive())
        got.append(await receive())

    call(LlmdSloHeaders(app), headers=h(x_llm_d_slo_ttft_ms="1"), body=b"{}")
    assert json.loads(got[0]["body"]) == {"vllm_xargs": {"slo_ttft_ms": 1}}
    assert got[1] == {"type": "http.disconnect"}


def test_a_client_gone_mid_body_is_not_forwarded() -> None:
    inner = Recorder()
    sent = call(LlmdSloHeaders(inner), headers=h(x_llm_d_slo_ttft_ms="1"), body=[b'{"a"', b": 1}"], disconnect=True)
    assert inner.calls == 0 and sent == []


# ------------------------------------------------------------------ as vLLM loads it
def test_behind_fastapi_as_vllm_adds_it_with_a_streaming_response() -> None:
    """``app.add_middleware(cls)`` is what vLLM's ``--middleware`` does with a class."""
    fastapi = pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from starlette.responses import StreamingResponse

    app = fastapi.FastAPI()
    app.add_middleware(LlmdSloHeaders)

    @app.post("/v1/completions")
    async def completions(req: dict[str, Any]) -> Any:
        if req.get("stream"):
            async def chunks() -> Any:
                for x in ("a", "b", "c"):
                    yield f"data: {x}\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"vllm_xargs": req.get("vllm_xargs")}

    async def run() -> list[Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            ok = await c.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"slo_tpot_ms": 9}},
                              headers={TTFT: "750", TPOT: "30"})
            bad = await c.post("/v1/completions", json={"prompt": "x"}, headers={TTFT: "soon"})
            stream = await c.post("/v1/completions", json={"prompt": "x", "stream": True}, headers={TTFT: "1"})
            plain = await c.post("/v1/completions", json={"prompt": "x"})
            return [ok, bad, stream, plain]

    ok, bad, stream, plain = asyncio.run(run())
    assert ok.status_code == 200 and ok.json() == {"vllm_xargs": {"slo_tpot_ms": 9, "slo_ttft_ms": 750}}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == TTFT and TTFT in bad.json()["error"]["message"]
    assert stream.status_code == 200 and stream.text == "data: a\n\ndata: b\n\ndata: c\n\n"
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert plain.json() == {"vllm_xargs": None}


def test_vllms_request_models_carry_the_merge_into_extra_args() -> None:
    """The merged body, parsed by vLLM's own request models, gives ``SamplingParams.extra_args``
    holding both keys; the adapter reads the TTFT objective from it."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    slo = parse_slo_headers(h(x_llm_d_slo_ttft_ms="1500", x_llm_d_slo_tpot_ms="40"))
    chat = merge_slo(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(), slo)
    comp = merge_slo(json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode(), slo)
    assert chat is not None and comp is not None
    params = [ChatCompletionRequest.model_validate_json(chat).to_sampling_params(8, {}),
              CompletionRequest.model_validate_json(comp).to_sampling_params(8)]
    for p in params:
        assert p.extra_args == {"slo_ttft_ms": 1500, "slo_tpot_ms": 40}
        assert request_slo(p.extra_args, 3, SloDefaults()).ttft_s == pytest.approx(1.5)


def test_vllm_loads_the_class_from_its_dotted_name() -> None:
    """vLLM's ``--middleware`` splits the name at the last dot, imports, and adds a class."""
    import importlib
    import inspect

    module, _, name = MIDDLEWARE.rpartition(".")
    assert inspect.isclass(getattr(importlib.import_module(module), name))
    assert getattr(importlib.import_module(module), name) is LlmdSloHeaders


# ------------------------------------------------------------------ the llm-d example
def _manifests() -> dict[str, dict[str, Any]]:
    docs = [d for p in sorted(LLMD.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_llmd_example_pool_selects_the_engines_with_the_middleware() -> None:
    m = _manifests()
    pool, dep = m["InferencePool"], m["Deployment"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(spec)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["containerPort"] for p in c["ports"]}
    assert [p["number"] for p in spec["targetPorts"]] and {p["number"] for p in spec["targetPorts"]} <= ports
    argv = c["command"] + c.get("args", [])
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE
    assert argv[argv.index("--port") + 1] == str(spec["targetPorts"][0]["number"])
    cls = argv[argv.index("--scheduler-cls") + 1]
    assert cls in ("engine_adapter.vllm.RemoteScheduler", "engine_adapter.vllm.RemoteSyncScheduler")
    ref = spec["endpointPickerRef"]
    assert ref["name"] and 1 <= ref["port"]["number"] <= 65535
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    assert pool["metadata"]["namespace"] == dep["metadata"]["namespace"]


def test_llmd_example_deployment_is_valid_kubernetes() -> None:
    kv = pytest.importorskip("kubernetes_validate.utils")
    from engine_adapter.vllm.settings import VllmAdapterSettings

    dep = _manifests()["Deployment"]
    kv.validate(dep, "1.27.0", strict=True)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    VllmAdapterSettings.from_env(env, apply_file=False)  # every literal adapter setting is valid
    readme = (LLMD / "README.md").read_text()
    assert MIDDLEWARE in readme and TTFT in readme and TPOT in readme
