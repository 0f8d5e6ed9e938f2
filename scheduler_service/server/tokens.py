"""Bearer tokens: the tokens file, its reloading store, and the CLI's ``token`` commands.

Tokens are stored only as SHA-256 digests (a leaked tokens file grants nothing) and compared
with :func:`hmac.compare_digest` against *every* entry, so the time taken does not reveal
which entry, if any, nearly matched.  No gRPC here: ``slidingserve token new|hash`` loads
this module and :mod:`.identity` only.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
import threading
from typing import Any

import structlog

from scheduler_service.core import FieldViolation, ValidationError
from scheduler_service.settings import FileWatch, read_document

from .identity import ENGINE_SCOPES, NAME, SCOPES, Principal

__all__ = ["TokenStore", "cmd_token_hash", "cmd_token_new", "hash_token", "new_token", "parse_tokens"]

log = structlog.get_logger("slidingserve.security")

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


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
        if not isinstance(ident, str) or not NAME.match(ident):
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
        if not isinstance(tenant, str) or not NAME.match(tenant):
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


# ------------------------------------------------------------------------- CLI
# ``slidingserve token new|hash`` (parsers in clients/cli.py, which imports this module only
# when the command runs).  Bad input raises ValidationError: one line, exit code 2.
def cmd_token_new(args: argparse.Namespace) -> int:
    """The server never sees the token itself: the engine gets the token, the tokens file
    only its digest."""
    for what in ("identity", "tenant"):
        if not NAME.match(getattr(args, what)):
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
