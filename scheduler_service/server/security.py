"""Transport security, authentication, authorisation and per-identity limits.

Threat model in one paragraph (details in ``docs/security.md``): the service is reached by
engines of several tenants over a network that is not trusted.  TLS keeps snapshots and
tokens private and proves the server's identity; mutual TLS or a bearer token proves the
engine's.  An authenticated engine is trusted to describe *its own* queues honestly, but not
to be well-behaved towards others, so (a) every predictor is scoped to the caller's tenant
(reports of tenant A never move tenant B's predictor, and B cannot read A's), and (b) rate,
stream and profile limits are per identity or tenant, so one engine cannot exhaust the
server for the rest.

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

import argparse
import hashlib
import hmac
import json
import os
import re
import secrets
import ssl
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from scheduler_service.core import FieldViolation, ValidationError
from scheduler_service.settings import FileWatch, read_document

from .config import ServerConfig
from .metrics import Metrics

__all__ = [
    "DEFAULT_TENANT",
    "METHOD_SCOPES",
    "SCOPES",
    "CertificateReloader",
    "Principal",
    "RateLimiter",
    "SecurityInterceptor",
    "TokenStore",
    "hash_token",
    "scoped_key",
    "server_credentials",
    "tenant_of",
]

log = structlog.get_logger("slidingserve.security")

#: The one tenant of a server without authentication.
DEFAULT_TENANT = "default"
#: What a token may be allowed to do.  "admin" exists only for fail-closed new methods.
SCOPES = ("schedule", "report", "read", "admin")
#: Scopes a token has when its entry names none: everything an engine needs.
ENGINE_SCOPES = ("schedule", "report", "read")
_SERVICE = "/slidingserve.v1.SchedulerService/"
METHOD_SCOPES: dict[str, str] = {
    _SERVICE + "Schedule": "schedule",
    _SERVICE + "ScheduleStream": "schedule",
    _SERVICE + "ReportIterations": "report",
    _SERVICE + "ListPolicies": "read",
    _SERVICE + "GetPredictor": "read",
}
#: Methods under this prefix are protected; everything else (health, reflection) is open.
PROTECTED_PREFIX = "/slidingserve."
#: Identities and tenants: short, printable, no "|" (the predictor-key separator).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)


# ------------------------------------------------------------------ principal
@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling.  ``identity`` names the engine (token entry or certificate name);
    ``tenant`` is the isolation domain its predictors live in."""

    identity: str
    tenant: str
    scopes: frozenset[str]
    authenticated: bool

    @property
    def label(self) -> str:
        """Metric label: the identity when authenticated, else one bounded value."""
        return self.identity if self.authenticated else "anonymous"


ANONYMOUS = Principal("anonymous", DEFAULT_TENANT, frozenset(SCOPES), False)


def scoped_key(tenant: str, profile_key: str) -> str:
    """The predictor-registry key of ``profile_key`` for ``tenant``.

    The default tenant keeps the bare profile key (unchanged behaviour without
    authentication); any other tenant prefixes ``tenant|``.  Profile names cannot contain
    ``|`` and a profile key has exactly two, so a scoped key can never equal another
    tenant's key or a bare one.
    """
    return profile_key if tenant == DEFAULT_TENANT else f"{tenant}|{profile_key}"


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


def tenant_of(context: Any) -> str:
    """The caller's tenant (:data:`DEFAULT_TENANT` when the server has no authentication)."""
    p = getattr(context, "principal", None)
    return p.tenant if isinstance(p, Principal) else DEFAULT_TENANT


# --------------------------------------------------------------------- tokens
def hash_token(token: str) -> str:
    """Hex SHA-256 of a token: what the tokens file stores.  A plain hash suffices (no
    salt, no slow KDF) because tokens are 256-bit random strings, not passwords."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh 256-bit token, URL-safe (valid as gRPC metadata)."""
    return secrets.token_urlsafe(32)


def parse_tokens(data: Any, source: str) -> list[tuple[bytes, Principal]]:
    """Validate a tokens document; every problem is reported with its path."""
    errs: list[FieldViolation] = []
    field = "auth_tokens_file"
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), dict) or set(data) != {"tokens"}:
        raise ValidationError.single(field, f"{source}: must be a mapping with one key 'tokens' "
                                            "(identity -> {sha256, tenant, scopes})")
    out: list[tuple[bytes, Principal]] = []
    seen: set[str] = set()
    for ident, entry in data["tokens"].items():
        where = f"{field}.tokens.{ident}"
        if not isinstance(ident, str) or not _NAME.match(ident):
            errs.append(FieldViolation(where, "identity must match [A-Za-z0-9][A-Za-z0-9._@-]{0,127}"))
            continue
        if not isinstance(entry, dict):
            errs.append(FieldViolation(where, "must be a mapping with sha256, tenant and optional scopes"))
            continue
        unknown = sorted(set(map(str, entry)) - {"sha256", "tenant", "scopes"})
        if unknown:
            errs.append(FieldViolation(where, f"unknown keys {unknown}; valid: sha256, tenant, scopes"))
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            errs.append(FieldViolation(f"{where}.sha256", "must be the 64-hex-digit SHA-256 of the token"))
            continue
        if digest.lower() in seen:
            errs.append(FieldViolation(f"{where}.sha256", "the same token is listed twice"))
        seen.add(digest.lower())
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not _NAME.match(tenant):
            errs.append(FieldViolation(f"{where}.tenant", "must match [A-Za-z0-9][A-Za-z0-9._@-]{0,127}"))
            continue
        scopes = entry.get("scopes", list(ENGINE_SCOPES))
        if (not isinstance(scopes, list) or not scopes
                or any(not isinstance(s, str) or s not in SCOPES for s in scopes)):
            errs.append(FieldViolation(f"{where}.scopes", f"must be a non-empty list of {list(SCOPES)}"))
            continue
        out.append((bytes.fromhex(digest), Principal(ident, tenant, frozenset(scopes), True)))
    if errs:
        raise ValidationError(errs)
    if not out:
        raise ValidationError.single(field, f"{source}: lists no tokens (every call would be refused)")
    return out


def _load_document(path: str) -> Any:
    return read_document(path, "auth_tokens_file", yaml_unless_json=True)


class TokenStore:
    """The accepted tokens, re-read when the file changes (checked at most every
    ``reload_period_s``), so tokens are added and revoked without a restart.  A file that
    no longer parses is logged and the last good set stays in force."""

    def __init__(self, path: str, reload_period_s: float = 1.0) -> None:
        self.path = path
        self._watch = FileWatch(path, period_s=reload_period_s)
        self._entries = parse_tokens(_load_document(path), path)  # fail fast at start
        self._lock = threading.Lock()
        self.reloads = 0

    @property
    def reload_period_s(self) -> float:
        return self._watch.period_s

    @reload_period_s.setter
    def reload_period_s(self, value: float) -> None:
        self._watch.period_s = value

    def _maybe_reload(self) -> None:
        if not self._watch.changed():
            return
        with self._lock:
            try:
                self._entries = parse_tokens(_load_document(self.path), self.path)
            except ValidationError as e:
                log.error("tokens_reload_failed", path=self.path, error=str(e), kept=len(self._entries))
                return
            self.reloads += 1
            log.info("tokens_reloaded", path=self.path, tokens=len(self._entries))

    def lookup(self, token: str) -> Principal | None:
        """The principal of ``token``, or None.  Compares against every entry (constant
        work per call whatever matches)."""
        self._maybe_reload()
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for d, principal in self._entries:
            if hmac.compare_digest(d, digest):
                found = principal
        return found

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------- limits
class RateLimiter:
    """Token buckets per key: ``rate`` per second, ``burst`` deep.

    Buckets live in a bounded LRU (``max_keys``) so that unauthenticated callers keyed by
    IP address cannot grow memory without bound; an evicted bucket restarts full.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Take one token: 0.0 when allowed, else the seconds until one is available."""
        now = self._clock()
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                tokens = self.burst
                if len(self._buckets) >= self._max_keys:
                    self._buckets.popitem(last=False)
            else:
                tokens = min(self.burst, b[0] + (now - b[1]) * self.rate)
                self._buckets.move_to_end(key)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


class _StreamSlots:
    """Open streams per identity; a slot is returned by the call's termination callback,
    which gRPC runs however the call ends (completion, cancellation, deadline)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            n = self._open.get(key, 0)
            if n >= self.limit:
                return False
            self._open[key] = n + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            n = self._open.get(key, 0) - 1
            if n > 0:
                self._open[key] = n
            else:
                self._open.pop(key, None)

    def count(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)


class _Gate:
    """A stream's request iterator with a rate check per message.  Over the limit it ends
    the iteration (so the servicer finishes normally with what it has) and remembers
    why; the wrapper then ends the call with RESOURCE_EXHAUSTED."""

    def __init__(self, requests: Iterator[Any], check: Callable[[], float]) -> None:
        self._requests = requests
        self._check = check
        self.retry_after = 0.0

    def __iter__(self) -> _Gate:
        return self

    def __next__(self) -> Any:
        if self.retry_after:
            raise StopIteration
        msg = next(self._requests)
        wait = self._check()
        if wait:
            self.retry_after = wait
            raise StopIteration
        return msg


# ------------------------------------------------------------------ interceptor
class SecurityInterceptor(grpc.ServerInterceptor):
    """Authentication (token or client certificate), scopes, rate and stream limits."""

    def __init__(self, config: ServerConfig, metrics: Metrics, tokens: TokenStore | None = None) -> None:
        self._tokens = tokens
        self._mtls = bool(config.tls_client_ca_file)
        self._metrics = metrics
        self._limiter = (RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
                         if config.rate_limit_rps > 0 else None)
        self._streams = _StreamSlots(config.max_streams_per_identity) if config.max_streams_per_identity else None
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
            if not _NAME.match(name):
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

    def _gate(self, requests: Iterator[Any], principal: Principal, key: str) -> _Gate | Iterator[Any]:
        if self._limiter is None:
            return requests
        return _Gate(requests, lambda: self._rate_check(principal, key))

    def _end(self, context: grpc.ServicerContext, gate: Any, key: str) -> None:
        if isinstance(gate, _Gate) and gate.retry_after:
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


# ------------------------------------------------------------------------- TLS
class CertificateReloader:
    """Server certificate configuration that follows the files.

    gRPC calls the instance before every new TLS handshake; it answers None (keep the
    current configuration) unless a file changed, then the new certificate, key and
    client CAs, after checking that they load and that the key matches the certificate —
    a half-rotated pair is logged and ignored, the old one stays in use.  Existing
    connections keep the certificate they were established with.
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.files = (cert_file, key_file, client_ca_file)
        self.reloads = 0
        self._watch = FileWatch(*self.files)  # looked at before every new handshake
        self.initial = self._load()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self.files
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ValidationError.single("tls_cert_file", f"cannot load {cert} with key {key}: {e}") from None
        if ca:
            try:
                ctx.load_verify_locations(cafile=ca)
            except (OSError, ssl.SSLError) as e:
                raise ValidationError.single("tls_client_ca_file", f"cannot load {ca}: {e}") from None
        blobs = [Path(f).read_bytes() for f in (cert, key)]
        return grpc.ssl_server_certificate_configuration(
            [(blobs[1], blobs[0])], root_certificates=Path(ca).read_bytes() if ca else None
        )

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        if not self._watch.changed():
            return None
        try:
            new = self._load()
        except (ValidationError, OSError) as e:
            log.error("tls_reload_failed", error=str(e))
            return None
        self.reloads += 1
        log.info("tls_reloaded", cert_file=self.files[0])
        return new


def server_credentials(config: ServerConfig) -> tuple[grpc.ServerCredentials, CertificateReloader] | None:
    """TLS (or mutual TLS) credentials for the gRPC port; None when TLS is off."""
    if not config.tls_cert_file:
        return None
    reloader = CertificateReloader(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    creds = grpc.dynamic_ssl_server_credentials(
        reloader.initial, reloader, require_client_authentication=bool(config.tls_client_ca_file)
    )
    return creds, reloader


# ------------------------------------------------------------------------- CLI
# ``slidingserve token new|hash`` (parsers in clients/cli.py, which imports this module only
# when the command runs).  Bad input raises ValidationError: one line, exit code 2.
def cmd_token_new(args: argparse.Namespace) -> int:
    """The server never sees the token itself: the engine gets the token, the tokens file
    only its digest."""
    for what in ("identity", "tenant"):
        if not _NAME.match(getattr(args, what)):
            raise ValidationError.single(f"--{what}", "must match [A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
    token = new_token()
    entry = {"tokens": {args.identity: {"sha256": hash_token(token), "tenant": args.tenant}}}
    if args.token_out:
        try:
            fd = os.open(args.token_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise ValidationError.single("--token-out", f"cannot write {args.token_out}: {e.strerror}") from None
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
    else:
        print(f"token: {token}")
    print("# tokens-file entry:")
    print(json.dumps(entry, indent=2))
    return 0


def cmd_token_hash(args: argparse.Namespace) -> int:
    token = sys.stdin.read().strip()
    if not token:
        raise ValidationError.single("stdin", "expected a token")
    print(hash_token(token))
    return 0
