"""Who is calling: the principal of a call, its tenant and the tenant-scoped predictor keys.

Without authentication every caller is tenant :data:`DEFAULT_TENANT` and predictor keys are
exactly the profile keys.  No gRPC here: the servicer, the token store and the CLI's token
commands all stand on this module (docs/security.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ANONYMOUS", "DEFAULT_TENANT", "ENGINE_SCOPES", "NAME", "SCOPES", "Principal", "scoped_key",
           "tenant_of"]

#: The one tenant of a server without authentication.
DEFAULT_TENANT = "default"
#: What a token may be allowed to do.  "admin" exists only for fail-closed new methods.
SCOPES = ("schedule", "report", "read", "admin")
#: Scopes a token has when its entry names none: everything an engine needs.
ENGINE_SCOPES = ("schedule", "report", "read")
#: Identities and tenants: short, printable, no "|" (the predictor-key separator).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")


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


def tenant_of(context: Any) -> str:
    """The caller's tenant (:data:`DEFAULT_TENANT` when the server has no authentication)."""
    p = getattr(context, "principal", None)
    return p.tenant if isinstance(p, Principal) else DEFAULT_TENANT
