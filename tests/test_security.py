"""Security over real gRPC on loopback, with certificates generated here (PyPI package
``cryptography``): TLS, mutual TLS, certificate rotation, bearer tokens and scopes,
per-identity rate and stream limits, tenant isolation of predictors, message-size and
snapshot-length limits, the open health port, and the engine adapter with TLS + token."""

from __future__ import annotations

import datetime as dt
import io
import ipaddress
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter.core import AdapterCore, AdapterSettings, IterationSample
from engine_adapter.remote import GrpcBackend
from engine_adapter.vllm.settings import SettingsError, VllmAdapterSettings
from scheduler_service.client import (
    AsyncSchedulerClient,
    ClientSecurity,
    EngineProfile,
    IterationReport,
    SchedulerClient,
    SchedulerError,
)
from scheduler_service.core import ValidationError, batch_features, default_predictor
from scheduler_service.server import SchedulerServer
from scheduler_service.server.security import RateLimiter, TokenStore, hash_token, scoped_key
from tests.grpc_support import make_server, mixed_snapshot

PROFILE = EngineProfile("llama-3-8b", "a100", 1)
CODES = grpc.StatusCode


# ----------------------------------------------------------------- certificates
@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                     serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return Issued(path / "cert.pem", path / "key.pem")


class CA:
    """A throwaway certificate authority."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root / name
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = _write(self.root, self.cert, self.key).cert

    def issue(self, cn: str, *, server: bool) -> Issued:
        key = _key()
        now = dt.datetime.now(dt.UTC)
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage(
                [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
        )
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return _write(self.root / cn, b.sign(self.key, hashes.SHA256()), key)


@dataclass(frozen=True)
class PKI:
    ca: CA
    other: CA
    server: Issued
    engine_a: Issued
    stranger: Issued  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA(root, "main"), CA(root, "other")
    return PKI(ca, other, ca.issue("server", server=True), ca.issue("engine-a", server=False),
               other.issue("engine-x", server=False))


# ----------------------------------------------------------------------- tokens
TOKENS = {"engine-a": "tok-a-" + "x" * 40, "engine-a2": "tok-a2-" + "z" * 40,
          "engine-b": "tok-b-" + "y" * 40, "dashboard": "tok-d-" + "w" * 40}


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = {"tokens": {
        "engine-a": {"sha256": hash_token(TOKENS["engine-a"]), "tenant": "tenant-a"},
        "engine-a2": {"sha256": hash_token(TOKENS["engine-a2"]), "tenant": "tenant-a"},
        "engine-b": {"sha256": hash_token(TOKENS["engine-b"]), "tenant": "tenant-b"},
        "dashboard": {"sha256": hash_token(TOKENS["dashboard"]), "tenant": "tenant-a", "scopes": ["read"]},
    }}
    p = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    p.write_text(json.dumps(doc))  # JSON is YAML
    return p


def client(srv: SchedulerServer, *, token: str = "", tls: PKI | None = None, cert: Issued | None = None,
           ca: Path | None = None, timeout_s: float = 5.0) -> SchedulerClient:
    ca_file = ca or (tls.ca.pem if tls else None)
    sec = ClientSecurity(ca_file=str(ca_file or ""), cert_file=str(cert.cert) if cert else "",
                         key_file=str(cert.key) if cert else "", token=token)
    return SchedulerClient(srv.target, timeout_s=timeout_s, profile=PROFILE, security=sec)


def code_of(fn: Any) -> grpc.StatusCode:
    with pytest.raises(SchedulerError) as exc:
        fn()
    return exc.value.code


def health(target: str, creds: grpc.ChannelCredentials | None = None) -> int:
    ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status)


SERVING = health_pb2.HealthCheckResponse.SERVING


def skewed_reports(n: int, scale: float) -> list[IterationReport]:
    """Reports whose latency is ``scale`` × the bootstrap prediction (a slower engine)."""
    rng = np.random.default_rng(7)
    boot = default_predictor()
    out = []
    for _ in range(n):
        nd, npf = int(rng.integers(1, 48)), int(rng.integers(1, 4))
        c = np.concatenate([np.ones(nd, np.int64), rng.integers(16, 512, npf)])
        u = np.concatenate([rng.integers(10, 3000, nd), rng.integers(0, 1000, npf)])
        x, s = batch_features(c, u)
        lat = float(boot.predict_ms(x[None, :], np.array([s]))[0]) * scale + 2.0
        out.append(IterationReport(latency_ms=lat, c=c, u=u, profile=PROFILE))
    return out


# -------------------------------------------------------------------------- TLS
def test_tls_and_what_it_refuses(pki: PKI) -> None:
    with make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)) as srv:
        with client(srv, tls=pki) as cl:
            assert cl.schedule(mixed_snapshot(1)).allocations
            assert "slidingserve" in cl.list_policies().names()
        with SchedulerClient(srv.target, timeout_s=2.0) as plain:  # plaintext to a TLS port
            assert code_of(lambda: plain.schedule(mixed_snapshot(1))) == CODES.UNAVAILABLE
        with client(srv, ca=pki.other.pem, timeout_s=2.0) as wrong_ca:  # server cert not trusted
            assert code_of(lambda: wrong_ca.list_policies()) == CODES.UNAVAILABLE


def test_mutual_tls_identity_and_rejections(pki: PKI) -> None:
    with make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                     tls_client_ca_file=str(pki.ca.pem)) as srv:
        with client(srv, tls=pki, cert=pki.engine_a) as cl:
            assert cl.schedule(mixed_snapshot(2)).allocations
            assert cl.report(skewed_reports(5, 1.0)).accepted == 5
        # the certificate's CN is the tenant: its reports landed under "engine-a|<profile>"
        assert srv.predictors is not None
        st = srv.predictors.state(scoped_key("engine-a", PROFILE.key))
        assert st is not None and st.accepted == 5
        assert srv.predictors.state(PROFILE.key) is None
        with client(srv, tls=pki, timeout_s=2.0) as no_cert:
            assert code_of(lambda: no_cert.list_policies()) == CODES.UNAVAILABLE
        with client(srv, tls=pki, cert=pki.stranger, timeout_s=2.0) as stranger:
            assert code_of(lambda: stranger.list_policies()) == CODES.UNAVAILABLE


def test_certificate_rotation_without_restart(pki: PKI, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(pki.server.cert.read_bytes())
    key.write_bytes(pki.server.key.read_bytes())
    with make_server(tls_cert_file=str(cert), tls_key_file=str(key)) as srv:
        with client(srv, ca=pki.ca.pem) as cl:
            cl.list_policies()
        # rotate to a certificate of another CA; a half-written pair is ignored first
        rotated = pki.other.issue("server", server=True)
        cert.write_bytes(rotated.cert.read_bytes())  # key not yet replaced: mismatch
        with client(srv, ca=pki.ca.pem) as cl:
            cl.list_policies()  # the old pair is still served
        key.write_bytes(rotated.key.read_bytes())
        with client(srv, ca=pki.other.pem) as cl:
            cl.list_policies()
        with client(srv, ca=pki.ca.pem, timeout_s=2.0) as old:
            assert code_of(lambda: old.list_policies()) == CODES.UNAVAILABLE
        assert srv.certificates is not None and srv.certificates.reloads == 1


def test_health_stays_open(pki: PKI, tokens_file: Path) -> None:
    with make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                     tls_client_ca_file=str(pki.ca.pem), auth_tokens_file=str(tokens_file),
                     health_port=_free_port()) as srv:
        assert health(f"127.0.0.1:{srv.health_port}") == SERVING  # plaintext probe port
        # on the main port: TLS + a client certificate, but no token needed
        creds = grpc.ssl_channel_credentials(pki.ca.pem.read_bytes(), pki.engine_a.key.read_bytes(),
                                             pki.engine_a.cert.read_bytes())
        assert health(srv.target, creds) == SERVING
    with make_server(auth_tokens_file=str(tokens_file)) as srv:
        assert health(srv.target) == SERVING


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------- tokens
@pytest.fixture(scope="module")
def token_server(pki: PKI, tokens_file: Path) -> Iterator[SchedulerServer]:
    with make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                     auth_tokens_file=str(tokens_file), require_auth=True,
                     refit_every=40, refit_window=80, refit_min_samples=10, max_profiles_per_tenant=2) as srv:
        yield srv


def test_missing_or_bad_token_is_unauthenticated(token_server: SchedulerServer, pki: PKI) -> None:
    for token in ("", "not-a-token", TOKENS["engine-a"] + "x"):
        with client(token_server, tls=pki, token=token) as cl:
            assert code_of(lambda c=cl: c.schedule(mixed_snapshot(3))) == CODES.UNAUTHENTICATED
            with cl.stream() as s:
                assert code_of(lambda s=s: s.schedule(mixed_snapshot(3))) == CODES.UNAUTHENTICATED
            assert code_of(lambda c=cl: c.report(skewed_reports(2, 1.0))) == CODES.UNAUTHENTICATED
            assert code_of(lambda c=cl: c.list_policies()) == CODES.UNAUTHENTICATED
            assert code_of(lambda c=cl: c.get_predictor()) == CODES.UNAUTHENTICATED
    assert token_server.metrics.auth_failures.labels("missing_token")._value.get() >= 5
    assert token_server.metrics.auth_failures.labels("bad_token")._value.get() >= 10


def test_good_token_works_on_unary_stream_and_report(token_server: SchedulerServer, pki: PKI) -> None:
    with client(token_server, tls=pki, token=TOKENS["engine-b"]) as cl:
        assert cl.schedule(mixed_snapshot(4)).allocations
        with cl.stream() as s:
            for i in range(3):
                assert s.schedule(mixed_snapshot(5 + i)).allocations
        assert cl.report(skewed_reports(3, 1.0)).accepted == 3
        assert cl.get_predictor().reports_accepted >= 3


async def _async_calls(target: str, sec: ClientSecurity) -> tuple[int, int]:
    async with AsyncSchedulerClient(target, timeout_s=5.0, profile=PROFILE, security=sec) as cl:
        plan = await cl.schedule(mixed_snapshot(6))
        async with cl.stream() as s:
            plan2 = await s.schedule(mixed_snapshot(7))
        return len(plan.allocations), len(plan2.allocations)


def test_async_client_with_tls_and_token(token_server: SchedulerServer, pki: PKI, tmp_path: Path) -> None:
    import asyncio

    tok = tmp_path / "token"
    tok.write_text(TOKENS["engine-b"] + "\n")
    a, b = asyncio.run(_async_calls(token_server.target, ClientSecurity(ca_file=str(pki.ca.pem),
                                                                        token_file=str(tok))))
    assert a > 0 and b > 0


def test_token_file_is_reread_when_rotated(token_server: SchedulerServer, pki: PKI, tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text(TOKENS["engine-a"])
    sec = ClientSecurity(ca_file=str(pki.ca.pem), token_file=str(tok))
    with SchedulerClient(token_server.target, timeout_s=5.0, security=sec) as cl:
        cl.list_policies()
        tok.write_text("revoked-token-with-a-different-length")
        assert code_of(cl.list_policies) == CODES.UNAUTHENTICATED
        tok.write_text(TOKENS["engine-a2"])
        cl.list_policies()


def test_scopes_permission_denied(token_server: SchedulerServer, pki: PKI) -> None:
    with client(token_server, tls=pki, token=TOKENS["dashboard"]) as cl:
        cl.get_predictor()  # "read" is granted
        assert code_of(lambda: cl.schedule(mixed_snapshot(8))) == CODES.PERMISSION_DENIED
        assert code_of(lambda: cl.report(skewed_reports(1, 1.0))) == CODES.PERMISSION_DENIED


def test_tenant_isolation_of_predictors(token_server: SchedulerServer, pki: PKI) -> None:
    srv = token_server
    assert srv.predictors is not None
    boot = srv.predictors.bootstrap.version
    with client(srv, tls=pki, token=TOKENS["engine-a"]) as a, \
            client(srv, tls=pki, token=TOKENS["engine-a2"]) as a2, \
            client(srv, tls=pki, token=TOKENS["engine-b"]) as b:
        b_before = b.get_predictor()
        summary = a.report(skewed_reports(120, 3.0))  # tenant A's engine is 3x slower
        assert summary.accepted == 120
        assert srv.predictors.wait_idle(10.0)
        a_info = a.get_predictor()
        assert a_info.version != boot and a_info.published >= 1
        assert a2.get_predictor().version == a_info.version  # same tenant shares the predictor
        b_after = b.get_predictor()
        assert b_after.version == b_before.version  # B's predictor did not move
        assert b_after.profile_key == PROFILE.key and b_after.version != a_info.version
        assert b_after.refits == b_before.refits and b_after.reports_accepted == b_before.reports_accepted
        # decisions use the caller's tenant's predictor
        assert a.schedule(mixed_snapshot(9)).predictor_version == a_info.version
        assert b.schedule(mixed_snapshot(9)).predictor_version == b_after.version
        # a tenant's profile slots (max_profiles_per_tenant=2) do not consume another's
        r = a.report([IterationReport(latency_ms=5.0, c=[1], u=[10], profile=EngineProfile("m2", "h", 1))])
        assert r.accepted == 1
        r = a.report([IterationReport(latency_ms=5.0, c=[1], u=[10], profile=EngineProfile("m3", "h", 1))])
        assert r.rejected == 1 and "max_profiles_per_tenant" in r.rejection_reasons[0]
        r = b.report([IterationReport(latency_ms=5.0, c=[1], u=[10], profile=EngineProfile("m3", "h", 1))])
        assert r.accepted == 1


# ----------------------------------------------------------------------- limits
def test_rate_limit_per_identity(tokens_file: Path) -> None:
    with make_server(auth_tokens_file=str(tokens_file), rate_limit_rps=0.5, rate_limit_burst=3) as srv:
        with client(srv, token=TOKENS["engine-a"]) as a, client(srv, token=TOKENS["engine-b"]) as b:
            for _ in range(3):
                a.list_policies()
            with pytest.raises(SchedulerError) as exc:
                a.schedule(mixed_snapshot(10))
            assert exc.value.code == CODES.RESOURCE_EXHAUSTED and "rate limit" in exc.value.message
            assert b.schedule(mixed_snapshot(10)).allocations  # another engine is unaffected
            # streams count every message: B has 2 tokens left, the third message ends the stream
            with b.stream() as s:
                s.schedule(mixed_snapshot(11))
                s.schedule(mixed_snapshot(12))
                assert code_of(lambda: s.schedule(mixed_snapshot(13))) == CODES.RESOURCE_EXHAUSTED
        assert srv.metrics.rate_limited.labels("engine-a", "rate")._value.get() == 1
        assert srv.metrics.rate_limited.labels("engine-b", "rate")._value.get() == 1


def test_rate_limit_without_auth_keys_on_the_client_and_covers_reports() -> None:
    with make_server(rate_limit_rps=0.5, rate_limit_burst=4) as srv, \
            SchedulerClient(srv.target, timeout_s=5.0, profile=PROFILE) as cl:
        with pytest.raises(SchedulerError) as exc:
            cl.report(skewed_reports(6, 1.0))  # one token per report message
        assert exc.value.code == CODES.RESOURCE_EXHAUSTED and "peer:ipv4:127.0.0.1" in exc.value.message
        assert srv.predictors is not None
        st = srv.predictors.state(PROFILE.key)
        assert st is not None and st.accepted == 4  # the ones within the burst were taken
        assert code_of(cl.list_policies) == CODES.RESOURCE_EXHAUSTED
        assert srv.metrics.rate_limited.labels("anonymous", "rate")._value.get() == 2
        assert health(srv.target) == SERVING  # health is never limited


def test_stream_limit_per_identity(tokens_file: Path) -> None:
    with make_server(auth_tokens_file=str(tokens_file), max_streams_per_identity=1) as srv:
        with client(srv, token=TOKENS["engine-a"]) as a, client(srv, token=TOKENS["engine-b"]) as b:
            s1 = a.stream()
            s1.schedule(mixed_snapshot(14))
            with a.stream() as s2:
                assert code_of(lambda: s2.schedule(mixed_snapshot(14))) == CODES.RESOURCE_EXHAUSTED
            with b.stream() as s3:
                assert s3.schedule(mixed_snapshot(14)).allocations
            s1.close()  # its slot comes back when the call terminates
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    with a.stream() as s4:
                        s4.schedule(mixed_snapshot(14))
                    break
                except SchedulerError as e:
                    assert e.code == CODES.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.05)


def test_rate_limiter_refills() -> None:
    now = [0.0]
    lim = RateLimiter(rate=2.0, burst=2, clock=lambda: now[0])
    assert lim.take("k") == 0.0 and lim.take("k") == 0.0
    assert lim.take("k") == pytest.approx(0.5)
    now[0] += 0.5
    assert lim.take("k") == 0.0
    assert lim.take("other") == 0.0


def test_message_size_and_snapshot_length_limits() -> None:
    with make_server(max_message_bytes=64 * 1024, max_requests_per_snapshot=50) as srv, \
            SchedulerClient(srv.target, timeout_s=5.0) as cl:
        big = mixed_snapshot(15, n_decode=2000, n_prefill=2000)  # ~100 KB on the wire
        assert code_of(lambda: cl.schedule(big)) == CODES.RESOURCE_EXHAUSTED
        with pytest.raises(SchedulerError) as exc:
            cl.schedule(mixed_snapshot(15, n_decode=30, n_prefill=30))
        assert exc.value.code == CODES.INVALID_ARGUMENT and "snapshot.columns" in exc.value.fields
        assert cl.schedule(mixed_snapshot(15, n_decode=20, n_prefill=20)).allocations  # server still fine


# ------------------------------------------------------------------ the adapter
def test_adapter_with_tls_and_token_decides_remotely(pki: PKI, tokens_file: Path, tmp_path: Path) -> None:
    tok = tmp_path / "engine.token"
    tok.write_text(TOKENS["engine-a"])
    with make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
                     tls_client_ca_file=str(pki.ca.pem), auth_tokens_file=str(tokens_file)) as srv:
        settings = AdapterSettings(deadline_ms=2000, profile=PROFILE.key, engine_id="engine-a", report_batch=4)
        sec = ClientSecurity(ca_file=str(pki.ca.pem), cert_file=str(pki.engine_a.cert),
                             key_file=str(pki.engine_a.key), token_file=str(tok))
        core = AdapterCore(GrpcBackend(srv.target, settings, security=sec), settings)
        try:
            for i in range(5):
                snap = mixed_snapshot(20 + i)
                d = core.decide(snap)
                assert d.source == "remote", core.last_error
                core.report(IterationSample(np.array([1, 1]), np.array([100, 200]), 7.0))
            assert core.flush(10.0)
        finally:
            core.close()
        assert core.fallback_total == 0 and core.report_errors == 0 and core.reports_sent == 5
        assert srv.predictors is not None
        st = srv.predictors.state(scoped_key("tenant-a", PROFILE.key))
        assert st is not None and st.accepted == 5


# ------------------------------------------------------------- configuration
def test_vllm_settings_token(tmp_path: Path) -> None:
    tok = tmp_path / "t"
    tok.write_text(TOKENS["engine-a"])
    s = VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TOKEN": TOKENS["engine-a"]})
    assert TOKENS["engine-a"] not in repr(s) and s.describe()["token"] == "<redacted>"
    sec = s.client_security()
    assert sec is not None and sec.metadata() == (("authorization", f"Bearer {TOKENS['engine-a']}"),)
    s = VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TOKEN_FILE": str(tok)})
    assert s.client_security().metadata() == (("authorization", f"Bearer {TOKENS['engine-a']}"),)
    assert VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1"}).client_security() is None
    for env, msg in [
        ({"SLIDINGSERVE_TOKEN": "x"}, "need a remote"),
        ({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TOKEN": "x", "SLIDINGSERVE_TOKEN_FILE": str(tok)}, "not both"),
        ({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TOKEN_FILE": str(tmp_path / "nope")}, "no such file"),
        ({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_TOKEN": "a b"}, "printable"),
    ]:
        with pytest.raises(SettingsError, match=msg):
            VllmAdapterSettings.from_env(env)


@pytest.mark.parametrize("overrides,field", [
    ({"require_auth": True}, "require_auth"),
    ({"tls_cert_file": "c.pem"}, "tls_key_file"),
    ({"tls_client_ca_file": "ca.pem"}, "tls_client_ca_file"),
    ({"rate_limit_rps": -1.0}, "rate_limit_rps"),
    ({"rate_limit_burst": 0}, "rate_limit_burst"),
    ({"require_auth": "yes"}, "require_auth"),
])
def test_config_validation(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        make_server(**overrides)
    assert field in [v.field for v in exc.value.violations]


def test_bad_security_files_fail_the_start(pki: PKI, tmp_path: Path) -> None:
    bad = tmp_path / "tokens.yaml"
    bad.write_text("tokens:\n  engine-a: {sha256: abc, tenant: t}\n  'bad|name': {sha256: abc, tenant: t}\n")
    with pytest.raises(ValidationError) as exc:
        make_server(auth_tokens_file=str(bad)).start()
    fields = [v.field for v in exc.value.violations]
    assert "auth_tokens_file.tokens.engine-a.sha256" in fields and "auth_tokens_file.tokens.bad|name" in fields
    with pytest.raises(ValidationError) as exc:  # a key that does not match the certificate
        make_server(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.engine_a.key)).start()
    assert exc.value.violations[0].field == "tls_cert_file"


def test_token_store_reload_and_revocation(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"

    def write(**entries: str) -> None:
        path.write_text(json.dumps({"tokens": {k: {"sha256": hash_token(v), "tenant": "t"}
                                               for k, v in entries.items()}}))

    write(one="token-one")
    store = TokenStore(str(path), reload_period_s=0.0)
    assert store.lookup("token-one") is not None and store.lookup("token-two") is None
    write(two="token-two")  # one revoked, two added
    assert store.lookup("token-one") is None
    p = store.lookup("token-two")
    assert p is not None and (p.identity, p.tenant) == ("two", "t")
    path.write_text("tokens: [not, a, mapping]")  # broken edit: the last good set stays
    assert store.lookup("token-two") is not None and store.reloads == 1


def test_token_command_output_is_a_valid_tokens_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from clients.cli import main as cli

    assert cli(["token", "new", "--identity", "engine-z", "--tenant", "team-z"]) == 0
    text = capsys.readouterr().out
    token = text.splitlines()[0].removeprefix("token: ")
    path = tmp_path / "tokens.json"
    path.write_text(text.split("# tokens-file entry:\n", 1)[1])
    p = TokenStore(str(path)).lookup(token)
    assert p is not None and (p.identity, p.tenant) == ("engine-z", "team-z")
    out = tmp_path / "engine.token"
    assert cli(["token", "new", "--identity", "e2", "--tenant", "t", "--token-out", str(out)]) == 0
    assert "token:" not in capsys.readouterr().out and out.stat().st_mode & 0o777 == 0o600
    monkeypatch.setattr("sys.stdin", io.StringIO(out.read_text()))
    assert cli(["token", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_token(out.read_text().strip())
    assert cli(["token", "new", "--identity", "a|b", "--tenant", "t"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--identity" in err


def test_cli_reaches_a_secured_server(token_server: SchedulerServer, pki: PKI, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from clients.cli import main as cli

    tok = tmp_path / "token"
    tok.write_text(TOKENS["engine-a"])
    monkeypatch.setenv("SLIDINGSERVE_TLS_CA", str(pki.ca.pem))
    assert cli(["policies", "--server", token_server.target]) == 2  # TLS but no token
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UNAUTHENTICATED" in err
    monkeypatch.setenv("SLIDINGSERVE_TOKEN_FILE", str(tok))
    assert cli(["policies", "--server", token_server.target, "--json"]) == 0
    assert "slidingserve" in capsys.readouterr().out
    monkeypatch.setenv("SLIDINGSERVE_TOKEN_FILE", str(tmp_path / "missing"))
    assert cli(["policies", "--server", token_server.target]) == 2
    assert "SLIDINGSERVE_TOKEN_FILE: no such file" in capsys.readouterr().err
