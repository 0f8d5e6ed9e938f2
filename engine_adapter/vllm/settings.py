"""Settings of the vLLM adapter: environment variables plus an optional, hot-reloaded file.

vLLM builds the scheduler class itself (``--scheduler-cls``), with no way to
pass it arguments, so every setting comes from the environment of the
``vllm serve`` process.  A settings file (``SLIDINGSERVE_CONFIG``; YAML, TOML or
JSON by extension) may add to them and *overrides* the environment for the
keys it names: it is the live configuration that operators edit to switch a
policy, its parameters or the deadline without restarting the engine.  The
file is re-read when it changes; a file that does not parse or
validate is logged and the last good settings are kept.  Typing, loading and
watching are those of the settings kit (:mod:`scheduler_service.settings`).

Security (docs/security.md): ``SLIDINGSERVE_TLS_CA`` / ``_TLS_CERT`` / ``_TLS_KEY``
for TLS and mutual TLS; ``SLIDINGSERVE_TOKEN_FILE`` (preferred: a mounted
Kubernetes secret, re-read when it changes, never in the environment that
crash reports and ``/proc`` expose) or ``SLIDINGSERVE_TOKEN`` for a service
with token authentication.  The token is never logged (``describe()`` and
``repr`` redact it).

An engine pins a deployment of the service's policy config with ``SLIDINGSERVE_DEPLOYMENT``
(file key ``deployment``).  Its name before the rename, ``SLIDINGSERVE_POLICY`` (file key
``policy``), stays an alias for one release: alone it works and logs a deprecation warning;
given together with the new name it must hold the same value, else the settings are refused
with a :class:`SettingsError` naming both (no silent winner).  The field keeps its name,
:attr:`VllmAdapterSettings.policy`.

This module does not import vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from scheduler_service.core import registry
from scheduler_service.core.params import param_text
from scheduler_service.core.snapshot import MAX_SECONDS
from scheduler_service.settings import (
    DocumentError,
    FileWatch,
    convert,
    env_values,
    field_types,
    load_document,
    unknown_keys,
)

from .snapshot import ClassSlo, SloDefaults

__all__ = [
    "ENV_PREFIX", "FOLLOW_DEFAULT", "RENAMED", "SettingsError", "SettingsWatcher", "VllmAdapterSettings", "parse_params",
    "parse_slo_classes", "slo_defaults",
]

log = logging.getLogger(__name__)

ENV_PREFIX = "SLIDINGSERVE_"
#: Settings read under a newer name than their field's: new name (file key; the variable is
#: ``SLIDINGSERVE_`` + it in upper case) → field, whose own name stays an alias for one release.
RENAMED: Mapping[str, str] = {"deployment": "policy"}
#: ``SLIDINGSERVE_DEPLOYMENT`` value that follows the service's default deployment (what an
#: empty ``ScheduleRequest.policy`` selects) instead of naming a policy or deployment.
FOLLOW_DEFAULT = "default"


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; the message names it."""


def parse_params(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` → ``{"k": "v", "k2": "v2"}`` (values are typed by the policy)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise SettingsError(f"SLIDINGSERVE_PARAMS: {part!r} is not key=value")
        out[k.strip()] = v.strip()
    return out


_CLASS_KEYS = {"ttft_ms", "tbt_ms", "e2e_ms", "tpot_ms", "sheddable"}
#: Largest ``e2e_ms`` (the snapshot's bound on seconds, in ms).
_MAX_E2E_MS = MAX_SECONDS * 1e3


def parse_slo_classes(text: str) -> dict[int, ClassSlo]:
    """``SLIDINGSERVE_SLO_CLASSES`` → priority → :class:`ClassSlo`; raises :class:`SettingsError`
    naming the bad entry."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SettingsError(f"SLIDINGSERVE_SLO_CLASSES is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise SettingsError("SLIDINGSERVE_SLO_CLASSES must be a JSON object: priority -> objectives")
    out: dict[int, ClassSlo] = {}
    for key, entry in data.items():
        where = f"SLIDINGSERVE_SLO_CLASSES[{key!r}]"
        try:
            prio = int(str(key))
        except ValueError:
            raise SettingsError(f"{where}: the key must be an integer priority") from None
        if not isinstance(entry, dict) or not set(entry) <= _CLASS_KEYS:
            raise SettingsError(f"{where} must be an object with keys from {sorted(_CLASS_KEYS)}")
        ms = {}
        for k in ("ttft_ms", "tbt_ms", "e2e_ms", "tpot_ms"):
            v = entry.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
                raise SettingsError(f"{where}.{k} must be a number of milliseconds >= 0, got {v!r}")
            if k in ("e2e_ms", "tpot_ms") and v > _MAX_E2E_MS:
                raise SettingsError(f"{where}.{k} must be at most {_MAX_E2E_MS:g} (0 = none), got {v!r}")
            ms[k] = float(v) / 1e3
        shed = entry.get("sheddable", False)
        if not isinstance(shed, bool):
            raise SettingsError(f"{where}.sheddable must be true or false, got {shed!r}")
        out[prio] = ClassSlo(ttft_s=ms["ttft_ms"], tbt_s=ms["tbt_ms"], sheddable=shed, e2e_s=ms["e2e_ms"],
                             tpot_s=ms["tpot_ms"])
    return out


@dataclass(frozen=True, slots=True)
class VllmAdapterSettings:
    """Everything the vLLM scheduler class needs; build with :meth:`from_env`.

    Field ``x`` is read from ``SLIDINGSERVE_X`` and from key ``x`` of the file.
    """

    #: ``host:port`` of the scheduling service, or ``inproc`` (policy in the engine process).
    address: str = "inproc"
    #: ``SLIDINGSERVE_DEPLOYMENT`` (file key ``deployment``; the old name ``SLIDINGSERVE_POLICY`` /
    #: ``policy`` is an alias for one release): a deployment of the service's policy config
    #: (pins it), a registry policy, or ``default`` (follow the service's default deployment;
    #: in-process: ``slidingserve``).
    policy: str = "slidingserve"
    params: Mapping[str, str] = field(default_factory=dict)
    #: Time the engine waits for a remote plan before scheduling natively.
    deadline_ms: float = 20.0
    #: TLS: CA bundle to verify the service; client cert + key for mutual TLS.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    #: Bearer token for a service with ``auth_tokens_file``; or ``token_file``, a file
    #: holding it (preferred; re-read when it changes, so rotation needs no restart).
    token: str = field(default="", repr=False)
    token_file: str = ""
    #: Engine profile; empty = from vLLM's model config, detected hardware, TP size.
    profile_model: str = ""
    profile_hardware: str = ""
    profile_tp: int = 0
    #: SLOs for requests that carry none in ``SamplingParams.extra_args``.
    #: 0 = the project's workload default (0.3 s + 0.15 ms per prompt token; 50 ms).
    default_ttft_ms: float = 0.0
    default_tbt_ms: float = 50.0
    #: Class table: vLLM request priority → objectives, as JSON (a mapping in the file):
    #: ``{"0": {"ttft_ms": 500, "tbt_ms": 50}, "2": {"ttft_ms": 4000, "sheddable": true}}``;
    #: ``e2e_ms`` sets an end-to-end objective (the last token within it; 0 = none), ``tpot_ms``
    #: a TPOT objective (mean time per output token; 0 = none). A request's own ``extra_args`` SLOs win; other priorities get the defaults above.
    slo_classes: str = ""
    #: Settings file (YAML/TOML/JSON) re-read on change; "" = none.
    config: str = ""
    #: Log a fallback reason at most once per this many fallbacks.
    log_every: int = 100
    #: Stable name of this engine in the service's logs and metrics.
    engine_id: str = ""
    #: Longest gRPC reconnect back-off, so a restarted service is found quickly.
    reconnect_max_ms: int = 1000
    #: Circuit breaker: after failures, skip the service for up to this many decisions.
    max_backoff_decisions: int = 64
    #: Reports per batch sent to ReportIterations.
    report_batch: int = 64
    #: In process, explain one plan in this many (its reasons feed the adapter's
    #: ``vllm:slidingserve_requests_waiting_by_reason`` and debug log); 0 = never.  Remote,
    #: the service decides (server.yaml ``explain_every``).
    explain_every: int = 16
    #: Wait bound (docs/operations.md, "Bounded waits"): a request still without its first
    #: token this many times its TTFT SLO after it arrived may be rejected (finish reason
    #: ``abort``, stop reason ``slidingserve:wait_bound``) by a policy that sheds; 0 = off.
    shed_after: float = 0.0
    #: Decide the next iteration in the background while the current one runs on
    #: the GPU (from the queues as they will be after it), so that the decision's
    #: time is hidden; "false" decides synchronously inside ``schedule()``.
    pipeline: bool = True
    #: Look up waiting requests' prefix-cache hits for the snapshot, as vLLM's
    #: ``schedule()`` does when it admits them (docs/vllm.md, Prefix caching), so that the
    #: policy plans only the tokens beyond the cached prefix; "false": waiting requests
    #: show nothing computed until vLLM admits them.
    prefix_lookup: bool = True
    #: Prometheus endpoint of the adapter's statistics, served from the engine-core
    #: process (port + the engine's data-parallel rank); 0 = off.  Read at start.
    metrics_port: int = 0
    #: Directory of a traffic recording kept by this engine (:mod:`scheduler_service.recording`,
    #: for ``slidingserve whatif``; docs/operations.md, "Before you switch"); "" = none.  A
    #: remote engine's service can keep it instead (server.yaml ``record``).
    record: str = ""
    #: vLLM schedules every iteration itself and the adapter only watches: it snapshots the
    #: queues for the recording and reports the iterations (the traffic under vLLM's own
    #: scheduler, for ``whatif`` before a switch).  Needs ``record``.
    observe: bool = False
    metrics_host: str = "0.0.0.0"

    # ------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if self.address != "inproc":
            host, sep, port = self.address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SettingsError(f"SLIDINGSERVE_ADDRESS must be host:port or 'inproc', got {self.address!r}")
        if not (0 < self.deadline_ms <= 60_000):
            raise SettingsError(f"SLIDINGSERVE_DEADLINE_MS must be in (0, 60000], got {self.deadline_ms}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("SLIDINGSERVE_TLS_CERT and SLIDINGSERVE_TLS_KEY must be given together")
        if (self.tls_cert or self.tls_key) and not self.tls_ca and self.address == "inproc":
            raise SettingsError("TLS settings need a remote SLIDINGSERVE_ADDRESS")
        if self.token and self.token_file:
            raise SettingsError("give SLIDINGSERVE_TOKEN or SLIDINGSERVE_TOKEN_FILE, not both")
        if (self.token or self.token_file) and self.address == "inproc":
            raise SettingsError("SLIDINGSERVE_TOKEN/_TOKEN_FILE need a remote SLIDINGSERVE_ADDRESS")
        if self.token and any(not (33 <= ord(ch) <= 126) for ch in self.token):
            raise SettingsError("SLIDINGSERVE_TOKEN must be printable ASCII without spaces")
        for name in ("tls_ca", "tls_cert", "tls_key", "token_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise SettingsError(f"SLIDINGSERVE_{name.upper()}: no such file {path!r}")
        if self.profile_tp < 0:
            raise SettingsError(f"SLIDINGSERVE_PROFILE_TP must be >= 0, got {self.profile_tp}")
        for name in ("profile_model", "profile_hardware"):
            if "|" in getattr(self, name):
                raise SettingsError(f"SLIDINGSERVE_{name.upper()} must not contain '|'")
        if self.default_ttft_ms < 0 or self.default_tbt_ms <= 0:
            raise SettingsError("SLIDINGSERVE_DEFAULT_TTFT_MS must be >= 0 and SLIDINGSERVE_DEFAULT_TBT_MS > 0")
        parse_slo_classes(self.slo_classes)
        if not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"SLIDINGSERVE_METRICS_PORT must be in [0, 65535], got {self.metrics_port}")
        for name in ("log_every", "reconnect_max_ms", "max_backoff_decisions", "report_batch"):
            if getattr(self, name) < 1:
                raise SettingsError(f"SLIDINGSERVE_{name.upper()} must be >= 1")
        if not 0 <= self.explain_every <= 1_000_000:
            raise SettingsError(f"SLIDINGSERVE_EXPLAIN_EVERY must be in [0, 1000000], got {self.explain_every}")
        if not 0 <= self.shed_after <= 1000:  # also rejects NaN
            raise SettingsError(f"SLIDINGSERVE_SHED_AFTER must be in [0, 1000] (times the TTFT SLO), "
                                f"got {self.shed_after}")
        if self.observe and not self.record:
            raise SettingsError("SLIDINGSERVE_OBSERVE needs SLIDINGSERVE_RECORD (the directory of the recording)")
        if self.policy and self.policy != FOLLOW_DEFAULT:
            if self.address == "inproc":
                try:
                    registry.create(self.policy, self.params)
                except Exception as e:
                    raise SettingsError(f"SLIDINGSERVE_DEPLOYMENT (alias SLIDINGSERVE_POLICY)/PARAMS: {e}") from None

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def client_security(self) -> Any:
        """The :class:`scheduler_service.client.ClientSecurity` of these settings (TLS files and
        token), or None when neither is set."""
        if not (self.tls or self.token or self.token_file):
            return None
        # Deferred: the client loads grpc, which an engine scheduling in process never needs.
        from scheduler_service.client import ClientSecurity

        return ClientSecurity(ca_file=self.tls_ca, cert_file=self.tls_cert, key_file=self.tls_key,
                              token=self.token, token_file=self.token_file)

    # --------------------------------------------------------------- loading
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, apply_file: bool = True) -> VllmAdapterSettings:
        """Settings from ``env`` (default ``os.environ``), then (``apply_file``) the
        settings file on top; raises :class:`SettingsError` naming the bad setting."""
        env = os.environ if env is None else env
        renamed = {new: env.get(ENV_PREFIX + new.upper()) for new in RENAMED}
        values = _unalias(env_values(cls, env, ENV_PREFIX, _coerce),
                          {new: _coerce(RENAMED[new], v) for new, v in renamed.items() if v},
                          lambda name: ENV_PREFIX + name.upper(), "")
        base = cls(**values)
        if base.config and apply_file:
            return base.with_file(base.config)
        return base

    def with_file(self, path: str) -> VllmAdapterSettings:
        """These settings with the file's keys on top; raises :class:`SettingsError`."""
        data = _read_file(path)
        unknown, known = unknown_keys(type(self), [k for k in data if k not in RENAMED], exclude=("config",))
        unknown = sorted(unknown)
        if unknown:
            raise SettingsError(f"{path}: unknown keys {unknown} (known: {sorted(known | set(RENAMED))})")
        values = {k: _coerce(k, v) for k, v in data.items() if k not in RENAMED}
        renamed = {new: _coerce(RENAMED[new], data[new]) for new in RENAMED if new in data}
        return replace(self, **_unalias(values, renamed, str, f"{path}: "))

    def describe(self) -> dict[str, Any]:
        """All settings, for logs: the token itself is redacted."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["token"]:
            out["token"] = "<redacted>"
        return out


def _unalias(values: dict[str, Any], renamed: Mapping[str, Any], spell: Callable[[str], str],
             where: str) -> dict[str, Any]:
    """``values`` (field → value) with each setting given under its new name (``renamed``: new
    name → value) moved onto its field.  The old name alone is accepted with a deprecation
    warning; both names are accepted only when they agree, else a :class:`SettingsError`
    names both (``spell``: name → as the operator writes it; ``where``: the message's prefix)."""
    out = dict(values)
    for new, old in RENAMED.items():
        if new not in renamed:
            if old in out:
                log.warning("slidingserve: %s%s is deprecated (removed in the next release); use %s",
                            where, spell(old), spell(new))
            continue
        if old in out and out[old] != renamed[new]:
            raise SettingsError(f"{where}{spell(new)}={renamed[new]!r} and {spell(old)}={out[old]!r} (its old "
                                f"name) differ; give {spell(new)} only")
        out[old] = renamed[new]
    return out


def _coerce(name: str, raw: Any) -> Any:
    """A value from the environment (a string) or a file (typed) → the field's type."""
    typ = field_types(VllmAdapterSettings)[name]
    try:
        if name == "slo_classes" and isinstance(raw, Mapping):
            return json.dumps(raw)
        if typ is Mapping:  # params
            if isinstance(raw, Mapping):
                return {str(k): param_text(v) for k, v in raw.items()}
            return parse_params(str(raw))
        return convert(typ, raw)
    except SettingsError:
        raise
    except (TypeError, ValueError):
        kind = "an integer" if typ is int else "true or false" if typ is bool else "a number"
        raise SettingsError(f"SLIDINGSERVE_{name.upper()} must be {kind}, got {raw!r}") from None


def _read_file(path: str) -> dict[str, Any]:
    try:
        data = load_document(path, yaml_default=True)  # .yaml, .yml, anything else: YAML
    except DocumentError as e:
        if e.stage == "read":
            raise SettingsError(f"SLIDINGSERVE_CONFIG: cannot read {path!r}: {e.detail}") from None
        raise SettingsError(f"{path}: does not parse: {e.detail}") from None
    if data is None and os.path.splitext(path)[1].lower() not in (".toml", ".json"):
        data = {}  # an empty YAML file
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: must hold a mapping of settings")
    # accept either bare keys or a [slidingserve] table / slidingserve: section
    if set(data) == {"slidingserve"} and isinstance(data["slidingserve"], dict):
        data = data["slidingserve"]
    return {str(k).lower(): v for k, v in data.items()}


def slo_defaults(s: VllmAdapterSettings) -> SloDefaults:
    """The objectives of requests that name none (and of their priority's class)."""
    return SloDefaults(ttft_s=s.default_ttft_ms / 1e3, tbt_s=s.default_tbt_ms / 1e3,
                       classes=parse_slo_classes(s.slo_classes))


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SettingsWatcher:
    """Re-reads the settings file when it changes (a :class:`~scheduler_service.settings.FileWatch`
    looked at most every ``period_s``).

    :meth:`poll` is called from the engine loop; it costs one ``time.monotonic`` per
    call and one ``os.stat`` per period.  Bad files are logged once per change and
    the last good settings stay in force.
    """

    def __init__(self, base: VllmAdapterSettings, period_s: float = 1.0) -> None:
        """``base``: the environment's settings (file not applied).  A bad file at
        start raises :class:`SettingsError`: failing fast beats serving with a
        configuration the operator did not ask for."""
        self.base = base
        self.path = base.config
        self._watch = FileWatch(self.path, period_s=period_s)
        self.current = base.with_file(self.path) if self.path else base
        self.reloads = 0
        self.errors = 0

    @property
    def period_s(self) -> float:
        return self._watch.period_s

    @period_s.setter
    def period_s(self, value: float) -> None:
        self._watch.period_s = value

    def poll(self, now: float | None = None) -> VllmAdapterSettings | None:
        """The new settings when the file changed and validates, else None."""
        if not self.path or not self._watch.changed(now):
            return None
        try:
            new = self.base.with_file(self.path)
        except SettingsError as e:
            self.errors += 1
            log.error("slidingserve: settings file rejected, keeping the last good settings: %s", e)
            return None
        if new == self.current:
            return None
        self.current = new
        self.reloads += 1
        log.info("slidingserve: settings reloaded from %s: deployment=%s deadline_ms=%g params=%s",
                 self.path, new.policy, new.deadline_ms, dict(new.params))
        return new
