"""Transport security, authentication, authorisation and per-identity limits.

Threat model in one paragraph (details in ``docs/security.md``): the service is reached by
engines of several tenants over a network that is not trusted.  TLS keeps snapshots and
tokens private and proves the server's identity; mutual TLS or a bearer token proves the
engine's.  An authenticated engine is trusted to describe *its own* queues honestly, but not
to be well-behaved towards others, so (a) every predictor is scoped to the caller's tenant
(reports of tenant A never move tenant B's predictor, and B cannot read A's), and (b) rate,
stream and profile limits are per identity or tenant, so one engine cannot exhaust the
server for the rest.

The parts: :mod:`.identity` (the caller's :class:`Principal`, tenants, scoped predictor
keys), :mod:`.tokens` (the tokens file and the CLI's ``token`` commands), :mod:`.ratelimit`
(rate and stream limits), :mod:`.tls` (certificates that follow the files); this module
holds the interceptor that puts them together and re-exports their names.

How it plugs in, and why:

* :class:`SecurityInterceptor` wraps every ``slidingserve.*`` method; health checking and
  reflection are passed through untouched, because load balancers and probes must reach
  them without credentials.  The interceptor is only installed when authentication or a
  limit is configured, so the default (demo) server pays nothing.
* The caller's :class:`Principal` reaches the servicer through a thin context proxy
  (:func:`tenant_of` reads it); without authentication every caller is tenant
  :data:`DEFAULT_TENANT` and predictor keys are exactly the profile keys, as before.
* Tokens are stored only as SHA-256 digests (a leaked tokens file grants nothing) and
  compared with :func:`hmac.compare_digest` against *every* entry, so the time taken does
  not reveal which entry, if any, nearly matched.
* Fail closed: a ``slidingserve.*`` method missing from :data:`METHOD_SCOPES` needs scope
  ``admin``, which no token has unless the tokens file grants it explicitly, so a new RPC
  cannot be reachable by every engine by accident.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from .config import ServerConfig
from .identity import ANONYMOUS, DEFAULT_TENANT, ENGINE_SCOPES, NAME, SCOPES, Principal, scoped_key, tenant_of
from .metrics import Metrics
from .ratelimit import Gate, RateLimiter, StreamSlots
from .tls import CertificateReloader, server_credentials
from .tokens import TokenStore, cmd_token_hash, cmd_token_new, hash_token, new_token, parse_tokens

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TENANT",
    "ENGINE_SCOPES",
    "METHOD_SCOPES",
    "PROTECTED_PREFIX",
    "SCOPES",
    "CertificateReloader",
    "Principal",
    "RateLimiter",
    "SecurityInterceptor",
    "TokenStore",
    "build_interceptor",
    "cmd_token_hash",
    "cmd_token_new",
    "hash_token",
    "new_token",
    "parse_tokens",
    "scoped_key",
    "server_credentials",
    "tenant_of",
]

log = structlog.get_logger("slidingserve.security")

_SERVICE = "/slidingserve.v1.SchedulerService/"
METHOD_SCOPES: dict[str, str] = {
    _SERVICE + "Schedule": "schedule",
    _SERVICE + "ScheduleStream": "schedule",
    _SERVICE + "ReportIterations": "report",
    _SERVICE + "ListPolicies": "read",
    _SERVICE + "GetPredictor": "read",
    _SERVICE + "WhatIf": "admin",  # minutes of CPU on the tenant's recorded traffic: operators only
}
#: Methods under this prefix are protected; everything else (health, reflection) is open.
PROTECTED_PREFIX = "/slidingserve."
_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)
#: Old private names, kept for callers that reached in.
_NAME = NAME
_StreamSlots = StreamSlots
_Gate = Gate


class _PrincipalContext:
    """The servicer's view of a call: the real context plus the authenticated principal.

    A proxy rather than a context variable because a streaming handler's generator runs
    after the wrapper returns; the proxy travels with the call."""

    __slots__ = ("_context", "principal")

    def __init__(self, context: grpc.ServicerContext, principal: Principal) -> None:
        self._context = context
        self.principal = principal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


# ------------------------------------------------------------------ interceptor
class SecurityInterceptor(grpc.ServerInterceptor):
    """Authentication (token or client certificate), scopes, rate and stream limits."""

    def __init__(self, config: ServerConfig, metrics: Metrics, tokens: TokenStore | None = None) -> None:
        self._tokens = tokens
        self._mtls = bool(config.tls_client_ca_file)
        self._metrics = metrics
        self._limiter = (RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
                         if config.rate_limit_rps > 0 else None)
        self._streams = StreamSlots(config.max_streams_per_identity) if config.max_streams_per_identity else None
        self._last_log = 0.0
        self._suppressed = 0

    @property
    def authenticates(self) -> bool:
        return self._tokens is not None or self._mtls

    # ------------------------------------------------------------- decisions
    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, reason: str, message: str) -> None:
        self._metrics.auth_failures.labels(reason).inc()
        now = time.monotonic()
        if now - self._last_log >= 1.0:  # a flood of bad calls must not flood the log
            log.warning("call_refused", reason=reason, peer=context.peer(), suppressed=self._suppressed)
            self._last_log, self._suppressed = now, 0
        else:
            self._suppressed += 1
        context.abort(code, message)

    def _authenticate(self, context: grpc.ServicerContext) -> Principal:
        if self._tokens is not None:
            header = [v for k, v in context.invocation_metadata() if k == "authorization"]
            if not header:
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "missing_token",
                             "missing token: send call metadata 'authorization: Bearer <token>'")
            m = _BEARER.match(header[0] if isinstance(header[0], str) else "")
            principal = self._tokens.lookup(m.group(1)) if m else None
            if principal is None:
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "bad_token", "invalid token")
            assert principal is not None
            return principal
        if self._mtls:
            # the handshake already required a certificate signed by tls_client_ca_file
            auth = context.auth_context()
            names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name") or []
            name = names[0].decode(errors="replace") if names else ""
            if not NAME.match(name):
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "bad_certificate_name",
                             "the client certificate needs a common name (or DNS SAN) matching "
                             "[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
            return Principal(name, name, frozenset(ENGINE_SCOPES), True)
        return ANONYMOUS

    def _rate_key(self, principal: Principal, context: grpc.ServicerContext) -> str:
        if principal.authenticated:
            return principal.identity
        peer = context.peer()  # "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678", "unix:..."
        return "peer:" + peer.rsplit(":", 1)[0] if peer.startswith("ip") else "peer:" + peer

    def _rate_check(self, principal: Principal, key: str) -> float:
        assert self._limiter is not None
        wait = self._limiter.take(key)
        if wait:
            self._metrics.rate_limited.labels(principal.label, "rate").inc()
        return wait

    def _rate_message(self, key: str, wait: float) -> str:
        assert self._limiter is not None
        return (f"rate limit: {key} exceeded {self._limiter.rate:g} messages/s "
                f"(burst {self._limiter.burst:g}); retry in {max(wait, 0.001) * 1e3:.0f} ms")

    def _admit(self, context: grpc.ServicerContext, method: str, *, unary: bool) -> tuple[Principal, str]:
        principal = self._authenticate(context)
        scope = METHOD_SCOPES.get(method, "admin")
        if scope not in principal.scopes:
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "scope",
                         f"{principal.identity} may not call {method.rsplit('/', 1)[-1]} (needs scope {scope!r})")
        key = self._rate_key(principal, context)
        if unary and self._limiter is not None:
            wait = self._rate_check(principal, key)
            if wait:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._rate_message(key, wait))
        if not unary and self._streams is not None:
            if not self._streams.acquire(key):
                self._metrics.rate_limited.labels(principal.label, "streams").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"stream limit: {key} already has {self._streams.limit} open streams")
            slots = self._streams
            if not context.add_callback(lambda: slots.release(key)):
                slots.release(key)
        return principal, key

    def _gate(self, requests: Iterator[Any], principal: Principal, key: str) -> Gate | Iterator[Any]:
        if self._limiter is None:
            return requests
        return Gate(requests, lambda: self._rate_check(principal, key))

    def _end(self, context: grpc.ServicerContext, gate: Any, key: str) -> None:
        if isinstance(gate, Gate) and gate.retry_after:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._rate_message(key, gate.retry_after))

    # -------------------------------------------------------------- wrapping
    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        des, ser = handler.request_deserializer, handler.response_serializer

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                principal, _ = self._admit(context, method, unary=True)
                return inner_uu(request, _PrincipalContext(context, principal))

            return grpc.unary_unary_rpc_method_handler(unary_unary, des, ser)

        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                principal, _ = self._admit(context, method, unary=True)
                return inner_us(request, _PrincipalContext(context, principal))

            return grpc.unary_stream_rpc_method_handler(unary_stream, des, ser)

        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                principal, key = self._admit(context, method, unary=False)
                gate = self._gate(requests, principal, key)
                response = inner_su(gate, _PrincipalContext(context, principal))
                self._end(context, gate, key)
                return response

            return grpc.stream_unary_rpc_method_handler(stream_unary, des, ser)

        inner_ss = handler.stream_stream

        def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            principal, key = self._admit(context, method, unary=False)
            gate = self._gate(requests, principal, key)
            responses = inner_ss(gate, _PrincipalContext(context, principal))

            def run() -> Iterator[Any]:
                yield from responses
                self._end(context, gate, key)

            return run()

        return grpc.stream_stream_rpc_method_handler(stream_stream, des, ser)


def build_interceptor(config: ServerConfig, metrics: Metrics) -> SecurityInterceptor | None:
    """The interceptor the config asks for, or None (no authentication, no limits)."""
    tokens = TokenStore(config.auth_tokens_file) if config.auth_tokens_file else None
    if tokens is None and not config.tls_client_ca_file and not config.rate_limit_rps \
            and not config.max_streams_per_identity:
        return None
    return SecurityInterceptor(config, metrics, tokens)
