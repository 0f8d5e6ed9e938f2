"""TLS for the gRPC port: credentials whose certificate follows the files (rotation
without a restart; docs/security.md)."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
import structlog

from scheduler_service.core import ValidationError
from scheduler_service.settings import FileWatch

from .config import ServerConfig

__all__ = ["CertificateReloader", "server_credentials"]

log = structlog.get_logger("slidingserve.security")


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
