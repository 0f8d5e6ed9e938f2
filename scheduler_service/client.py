"""Python clients of the scheduling service: :class:`SchedulerClient` (sync) and
:class:`AsyncSchedulerClient` (asyncio), with the same methods.

They speak core types (``Snapshot`` in, ``Plan`` out), so an engine adapter can switch
between an in-process policy and the remote service without touching its own code.  Every
call takes a deadline (``timeout_s``; the client default applies when omitted) because an
engine must fall back to a local decision rather than stall a GPU iteration.  Every failure
is a :class:`SchedulerError` with the gRPC status code and, for bad input, the violated
fields decoded from ``google.rpc.BadRequest``.

Security (:class:`ClientSecurity`): TLS with a private CA, a client certificate for mutual
TLS, and a bearer token sent as ``authorization`` call metadata on every call, streams
included (once, when a stream opens: the hot path of a stream pays nothing for it).
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
import math
import os
import queue
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np

from scheduler_service.core import BatchLatencyPredictor, FieldViolation, Plan, Snapshot
from scheduler_service.core.params import param_text
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.settings import FileWatch
from scheduler_service.wire.convert import (
    plan_from_pb,
    predictor_sample_counts,
    profile_to_pb,
    snapshot_to_pb,
    violations_from_pb,
)
from scheduler_service.wire.profile import EngineProfile
from scheduler_service.wire.status import violations_from_status

__all__ = ["AsyncSchedulerClient", "ClientSecurity", "DeploymentInfo", "EngineProfile", "IterationReport",
           "PolicyInfo", "PolicyList", "PolicyParamInfo", "PredictorInfo", "ReportSummary", "SchedulerClient",
           "SchedulerError"]

SnapshotLike = Snapshot | pb.Snapshot | Mapping[str, Any]
ProfileLike = EngineProfile | str | None
_CODES = {c.value[0]: c for c in grpc.StatusCode}
T = TypeVar("T")


# ------------------------------------------------------------------ errors
class SchedulerError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``message``, and ``violations`` (the
    BadRequest field violations; empty unless ``code`` is INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, message: str, violations: Sequence[FieldViolation] = ()):
        self.code = code
        self.message = message
        self.violations = tuple(violations)
        super().__init__(f"{code.name}: {message}")

    @property
    def fields(self) -> list[str]:
        return [v.field for v in self.violations]

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> SchedulerError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = (err.details() if hasattr(err, "details") else None) or str(err)
        md = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        return cls(code, details, violations_from_status(md))

    @classmethod
    def from_pb(cls, err: pb.ScheduleError) -> SchedulerError:
        code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
        return cls(code, err.message, violations_from_pb(err.field_violations))


# ------------------------------------------------------------ result types
@dataclass(frozen=True, slots=True)
class IterationReport:
    """One measured iteration: ``latency_ms`` plus either the batch composition (``c``:
    tokens per request this iteration, ``u``: tokens already in KV) or the 7 ``features``
    (with an optional ``scenario``: "decode", "prefill", "mixed")."""

    latency_ms: float
    c: Sequence[int] | np.ndarray | None = None
    u: Sequence[int] | np.ndarray | None = None
    features: Sequence[float] | np.ndarray | None = None
    scenario: str | None = None
    profile: EngineProfile | None = None
    engine_id: str = ""
    request_id: str = ""

    def to_pb(self, default_profile: EngineProfile | None = None) -> pb.IterationReport:
        msg = pb.IterationReport(latency_ms=float(self.latency_ms), engine_id=self.engine_id,
                                 request_id=self.request_id)
        prof = self.profile or default_profile
        if prof is not None:
            msg.engine_profile.CopyFrom(profile_to_pb(prof))
        if self.features is not None:
            msg.features.x.extend(np.asarray(self.features, dtype=np.float64).tolist())
            if self.scenario:
                msg.features.scenario = pb.Scenario.Value(f"SCENARIO_{self.scenario.upper()}")
        else:
            if self.c is None or self.u is None:
                raise ValueError("an IterationReport needs c and u, or features")
            msg.composition.c.extend(np.asarray(self.c, dtype=np.int64).tolist())
            msg.composition.u.extend(np.asarray(self.u, dtype=np.int64).tolist())
        return msg


@dataclass(frozen=True, slots=True)
class ReportSummary:
    accepted: int
    rejected: int
    predictor_version: str
    rejection_reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyParamInfo:
    name: str
    type: str
    default: str
    min: float | None
    max: float | None
    choices: tuple[str, ...]
    doc: str


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    name: str
    version: str
    doc: str
    params: tuple[PolicyParamInfo, ...]


#: A parameter default from its wire text back to the type the registry reports (text otherwise).
_PARSE: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": lambda t: t.lower() == "true"}


def _typed(type_name: str, text: str) -> Any:
    try:
        return _PARSE.get(type_name, str)(text)
    except ValueError:
        return text


@dataclass(frozen=True, slots=True)
class DeploymentInfo:
    """A deployment: a named entry of the server's policy config (what engines pin).
    ``policy_version`` is the version of its policy with these parameters, not the entry."""

    name: str
    policy: str
    params: Mapping[str, str]
    policy_version: str


#: Deprecated alias of :class:`DeploymentInfo` (its name before the rename).
PolicyVersionInfo = DeploymentInfo


@dataclass(frozen=True, slots=True)
class PolicyList:
    default_policy: str
    policies: tuple[PolicyInfo, ...]
    #: The server's policy config: deployments side by side, the shadow, the config digest
    #: (all empty for a server without one, or older than these fields).
    deployments: tuple[DeploymentInfo, ...] = ()
    shadow: str = ""
    config_digest: str = ""

    @property
    def versions(self) -> tuple[DeploymentInfo, ...]:
        """Deprecated alias of :attr:`deployments` (and the wire field's name)."""
        return self.deployments

    def names(self) -> list[str]:
        return [p.name for p in self.policies]

    def to_dict(self) -> dict[str, Any]:
        """Same shape as the offline ``{"default": ..., "policies": [registry.describe(n)...]}``,
        plus ``deployments``/``shadow``/``config_digest`` when the server has a policy config
        (and ``versions``, the same list under its pre-rename key, for existing scripts)."""
        out: dict[str, Any] = {"default": self.default_policy, "policies": [
            {"name": p.name, "version": p.version, "doc": p.doc,
             "params": [{"name": q.name, "type": q.type, "default": _typed(q.type, q.default), "min": q.min,
                         "max": q.max, "choices": list(q.choices) or None, "doc": q.doc} for q in p.params]}
            for p in self.policies]}
        if self.deployments:
            deployments = [{"name": d.name, "policy": d.policy, "params": dict(d.params),
                            "policy_version": d.policy_version} for d in self.deployments]
            out.update(deployments=deployments, versions=deployments, shadow=self.shadow,
                       config_digest=self.config_digest)
        return out


@dataclass(frozen=True, slots=True)
class PredictorInfo:
    predictor: BatchLatencyPredictor
    version: str
    profile_key: str
    sample_counts: Mapping[str, int] = field(default_factory=dict)
    reports_accepted: int = 0
    buffered_samples: int = 0
    refits: int = 0
    published: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile_key": self.profile_key, "version": self.version,
            "sample_counts": dict(self.sample_counts),
            "reports_accepted": self.reports_accepted, "buffered_samples": self.buffered_samples,
            "refits": self.refits, "published": self.published, "predictor": self.predictor.to_dict(),
        }


# --------------------------------------------------------------- security
Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ClientSecurity:
    """How a client proves who the server is and who it is.

    * ``tls``: TLS with the system's trusted roots; implied by ``ca_file`` or ``cert_file``.
    * ``ca_file``: PEM CA bundle that signed the server's certificate (a private CA).
    * ``cert_file`` + ``key_file``: this client's certificate for mutual TLS.
    * ``token`` or ``token_file``: bearer token for servers with ``auth_tokens_file``.  The
      file (a Kubernetes secret, say) is re-read when it changes, so a rotated token is
      used from the next call on without a restart.
    * ``server_name``: the name to check in the server certificate when the target's host
      is not it (an IP address, a port-forward).

    Files are read when a channel is built (engines build channels lazily, after a fork),
    and missing files fail at construction with the setting named.
    """

    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token: str = field(default="", repr=False)
    token_file: str = ""
    server_name: str = ""
    _token_reader: _TokenFile | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file must be given together (mutual TLS)")
        if self.token and self.token_file:
            raise ValueError("give token or token_file, not both")
        if self.token:
            _check_token(self.token, "token")
        for name in ("ca_file", "cert_file", "key_file", "token_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if self.token_file:
            object.__setattr__(self, "_token_reader", _TokenFile(self.token_file))

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.ca_file or self.cert_file)

    @property
    def has_token(self) -> bool:
        return bool(self.token or self.token_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None,
                 prefix: str = "SLIDINGSERVE_") -> ClientSecurity | None:
        """From ``SLIDINGSERVE_TLS_CA``, ``_TLS_CERT``, ``_TLS_KEY``, ``_TOKEN``,
        ``_TOKEN_FILE``, ``_TLS_SERVER_NAME`` (the vLLM adapter's names); None if none is set."""
        env = os.environ if env is None else env
        names = {"ca_file": "TLS_CA", "cert_file": "TLS_CERT", "key_file": "TLS_KEY", "token": "TOKEN",
                 "token_file": "TOKEN_FILE", "server_name": "TLS_SERVER_NAME"}
        values: dict[str, Any] = {k: env.get(prefix + v, "").strip() for k, v in names.items()}
        for k in ("ca_file", "cert_file", "key_file", "token_file"):
            if values[k] and not os.path.isfile(values[k]):
                raise ValueError(f"{prefix}{names[k]}: no such file {values[k]!r}")
        return cls(**values) if any(values.values()) else None

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def credentials(self) -> grpc.ChannelCredentials:
        paths = (self.ca_file, self.key_file, self.cert_file)
        ca, key, cert = (Path(p).read_bytes() if p else None for p in paths)
        return grpc.ssl_channel_credentials(ca, key, cert)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        opts = [*options, *self.options()]
        if not self.uses_tls:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, self.credentials(), options=opts)

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        opts = [*options, *self.options()]
        if not self.uses_tls:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, self.credentials(), options=opts)

    def metadata(self) -> Metadata | None:
        """Call metadata carrying the token, or None when there is no token."""
        token = self.token if self._token_reader is None else self._token_reader.read()
        return (("authorization", f"Bearer {token}"),) if token else None


class _TokenFile:
    """A token file, re-read only when its stat stamp changes (one ``stat`` per call,
    through the settings kit's :class:`~scheduler_service.settings.FileWatch`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._watch = FileWatch(path)
        self._watch.forget()  # the first call reads the file
        self._token = ""
        self._lock = threading.Lock()

    def read(self) -> str:
        """The token; a missing, unreadable or bad file is a SchedulerError UNAUTHENTICATED."""
        with self._lock:
            if self._watch.changed():
                try:
                    with open(self.path) as fh:
                        token = fh.read().strip()
                    _check_token(token, f"token_file {self.path!r}")
                except (OSError, ValueError) as e:
                    self._watch.forget()  # a missing or bad file is read again next call
                    why = (f"cannot read token_file {self.path!r}: {e.strerror or e}"
                           if isinstance(e, OSError) else str(e))
                    raise SchedulerError(grpc.StatusCode.UNAUTHENTICATED, why) from None
                self._token = token
            return self._token


def _check_token(token: str, what: str) -> None:
    """Tokens travel as an ASCII metadata value: printable, no whitespace."""
    if not token or any(not (33 <= ord(ch) <= 126) for ch in token):
        raise ValueError(f"{what}: a token must be non-empty printable ASCII without spaces")


# -------------------------------------------------- requests and replies
def _profile(p: ProfileLike) -> EngineProfile | None:
    if p is None or isinstance(p, EngineProfile):
        return p
    return EngineProfile.parse(p) if p else None


def _params_text(params: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): param_text(v) for k, v in (params or {}).items()}


class _Reports:
    """Reports encoded as a ReportIterations call reads them.  One that cannot be encoded
    ends the stream there (grpc would turn the error into UNKNOWN, or cancel an async call):
    :meth:`check` then raises it as the ValueError it is, saying how many were sent."""

    def __init__(self, encode: Callable[[Any], pb.IterationReport]) -> None:
        self.encode = encode
        self.sent = 0
        self.error: ValueError | None = None

    def _one(self, r: Any) -> pb.IterationReport | None:
        try:
            msg = self.encode(r)
        except ValueError as e:
            self.error = e
            return None
        self.sent += 1
        return msg

    def of(self, reports: Iterable[Any]) -> Iterator[pb.IterationReport]:
        for r in reports:
            msg = self._one(r)
            if msg is None:
                return
            yield msg

    async def of_async(self, reports: AsyncIterable[Any]) -> Any:
        async for r in reports:
            msg = self._one(r)
            if msg is None:
                return
            yield msg

    def check(self) -> None:
        if self.error is not None:
            raise ValueError(f"reports[{self.sent}]: {self.error} (the {self.sent} before it were sent)")


@dataclass(slots=True)
class _Encoder:
    """Builds every call's request and metadata; shared by the sync and async clients."""

    profile: EngineProfile | None
    engine_id: str
    encoding: str
    security: ClientSecurity
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def md(self) -> Metadata | None:
        return self.security.metadata()

    def request(self, snapshot: SnapshotLike, policy: str | None, params: Mapping[str, Any] | None,
                request_id: str | None, explain: bool = False) -> pb.ScheduleRequest:
        if isinstance(snapshot, pb.Snapshot):
            snap_pb = snapshot
        else:
            snap = snapshot if isinstance(snapshot, Snapshot) else Snapshot.from_json(snapshot)
            prof = EngineProfile.parse(snap.profile) if snap.profile else self.profile
            snap_pb = snapshot_to_pb(snap, profile=prof, engine_id=self.engine_id, encoding=self.encoding)
        return pb.ScheduleRequest(
            request_id=request_id if request_id is not None else f"{self.engine_id or 'c'}-{next(self._ids)}",
            snapshot=snap_pb, policy=policy or "", params=_params_text(params), explain=explain,
        )

    def report(self, r: IterationReport | pb.IterationReport) -> pb.IterationReport:
        msg = r if isinstance(r, pb.IterationReport) else r.to_pb(self.profile)
        if not msg.engine_id and self.engine_id:  # the client's engine, as for its snapshots
            msg.engine_id = self.engine_id
        return msg

    def predictor_request(self, profile: ProfileLike) -> pb.GetPredictorRequest:
        prof = _profile(profile) or self.profile or EngineProfile()
        return pb.GetPredictorRequest(engine_profile=profile_to_pb(prof))

    @staticmethod
    def whatif_request(deployments: Sequence[str], loads: Sequence[float],
                       engine_id: str) -> pb.WhatIfRequest:
        return pb.WhatIfRequest(deployments=list(deployments), loads=list(loads), engine_id=engine_id)


def _ids(snapshot: Any) -> Sequence[str] | None:
    """The request ids, in the order sent, of a :class:`Snapshot` (the compact reasons of the
    reply refer to rows); None for other snapshot forms (the reasons of field 15 are read)."""
    return snapshot.ids if isinstance(snapshot, Snapshot) else None


def _plan(resp: pb.ScheduleResponse, ids: Sequence[str] | None = None) -> Plan:
    if resp.HasField("error"):
        raise SchedulerError.from_pb(resp.error)
    return plan_from_pb(resp.plan, ids)


def _summary(msg: pb.ReportSummary) -> ReportSummary:
    return ReportSummary(int(msg.accepted), int(msg.rejected), msg.predictor_version,
                         tuple(msg.rejection_reasons))


def _policy_list(msg: pb.ListPoliciesResponse) -> PolicyList:
    def param(q: Any) -> PolicyParamInfo:
        return PolicyParamInfo(q.name, q.type, q.default_value, q.min if q.HasField("min") else None,
                               q.max if q.HasField("max") else None, tuple(q.choices), q.doc)

    policies = tuple(PolicyInfo(p.name, p.version, p.doc, tuple(map(param, p.params))) for p in msg.policies)
    # the wire field keeps its pre-rename name ``versions`` (the proto is frozen)
    deployments = tuple(DeploymentInfo(d.name, d.policy, dict(d.params), d.policy_version)
                        for d in msg.versions)
    return PolicyList(msg.default_policy, policies, deployments, msg.shadow, msg.config_digest)


def _predictor_info(msg: pb.GetPredictorResponse) -> PredictorInfo:
    p = BatchLatencyPredictor.from_json(msg.predictor_json)
    counts = dict(msg.sample_counts) or predictor_sample_counts(p)
    return PredictorInfo(p, msg.version, msg.profile_key, counts, msg.reports_accepted, msg.buffered_samples,
                         msg.refits, msg.published)


def _whatif_answer(resp: pb.WhatIfResponse) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(resp.result_json)
    return out


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # An engine must find a restarted (or the other) replica within about a second,
        # not after gRPC's default reconnect back-off of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # A target naming several replicas (``dns:///`` of a headless Service, ``ipv4:a,b``):
        # each new call goes to the next ready replica, so engines' long-lived streams
        # spread over the replicas while each stream stays on one for its life.
        ("grpc.lb_policy_name", "round_robin"),
    ]


# ------------------------------------------------------------ shared bases
class _BaseClient:
    """What :class:`SchedulerClient` and :class:`AsyncSchedulerClient` share: configuration,
    security, the requests (:class:`_Encoder`) and the decoding of the replies (``_plan``,
    ``_summary``...).  The two differ only in I/O: their channel, and whether a call is awaited."""

    def __init__(self, target: str, timeout_s: float, profile: ProfileLike, engine_id: str, encoding: str,
                 security: ClientSecurity | None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        #: without security, a plain one: an insecure channel and no metadata
        self._security = security or ClientSecurity()
        self._enc = _Encoder(_profile(profile), engine_id, encoding, self._security)

    def _kwargs(self, timeout_s: float | None) -> dict[str, Any]:
        """A unary call's deadline and metadata."""
        return {"timeout": self.timeout_s if timeout_s is None else timeout_s, "metadata": self._enc.md()}


class _BaseStream(abc.ABC):
    """What :class:`ScheduleStream` and :class:`AsyncScheduleStream` share: the encoder, the
    default deadline, the check of each reply and the errors; they differ only in I/O."""

    def __init__(self, stub: pb_grpc.SchedulerServiceStub, enc: _Encoder, timeout_s: float) -> None:
        self._stub = stub
        self._enc = enc
        self.timeout_s = timeout_s
        self._call: Any = None

    @abc.abstractmethod
    def _drop(self) -> None:
        """Cancel the call in progress; the next decision opens a new one."""

    def _answer(self, resp: pb.ScheduleResponse, req: pb.ScheduleRequest, snapshot: SnapshotLike) -> Plan:
        """The plan of ``resp``; a reply that answers another request than the one sent means
        the stream is out of step: it is dropped (the next call opens a new one)."""
        if resp.request_id != req.request_id:  # cannot happen on an in-order stream
            self._drop()
            raise SchedulerError(grpc.StatusCode.INTERNAL,
                                 f"stream out of step: the reply is for request {resp.request_id!r}, "
                                 f"expected {req.request_id!r}")
        return _plan(resp, _ids(snapshot))

    def _fail(self, err: grpc.RpcError | None = None, late: float | None = None) -> SchedulerError:
        """Drop the stream after a failed call; the error to raise: the deadline of ``late``
        seconds missed, else ``err`` converted, else the server closed the stream."""
        self._drop()
        if late is not None:
            return self._late(late)
        return self._server_closed() if err is None else SchedulerError.from_rpc_error(err)

    @staticmethod
    def _late(timeout: float) -> SchedulerError:
        return SchedulerError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout:g} s")

    @staticmethod
    def _server_closed() -> SchedulerError:
        return SchedulerError(grpc.StatusCode.UNAVAILABLE, "the server closed the stream")


# ------------------------------------------------------------ sync client
class SchedulerClient(_BaseClient):
    """Blocking client.  ``profile`` and ``engine_id`` are defaults for snapshots and
    reports that carry none; ``encoding`` is "columns" (faster) or "rows"; ``security``
    adds TLS and a token (with ``channel`` given, only its token is used).  ``timeout_s``
    of a call defaults to the client's; a failed call raises :class:`SchedulerError`."""

    def __init__(self, target: str, timeout_s: float = 1.0, *, profile: ProfileLike = None,
                 engine_id: str = "", encoding: str = "columns", max_message_bytes: int = 64 << 20,
                 channel: grpc.Channel | None = None, security: ClientSecurity | None = None) -> None:
        super().__init__(target, timeout_s, profile, engine_id, encoding, security)
        self._channel = channel or self._security.channel(target, _channel_options(max_message_bytes))
        self._stub = pb_grpc.SchedulerServiceStub(self._channel)

    def _unary(self, method: Any, req: Any, timeout_s: float | None, decode: Callable[[Any], T]) -> T:
        try:
            return decode(method(req, **self._kwargs(timeout_s)))
        except grpc.RpcError as e:
            raise SchedulerError.from_rpc_error(e) from None

    def schedule(self, snapshot: SnapshotLike, policy: str | None = None,
                 params: Mapping[str, Any] | None = None, timeout_s: float | None = None, *,
                 request_id: str | None = None, explain: bool = False) -> Plan:
        """One decision: the :class:`Plan` for ``snapshot`` under ``policy`` (default: the
        server's) with ``params``.  ``explain``: ask for its reasons (``Plan.reasons``,
        docs/reasons.md); the decision is the same, and a service older than the field ignores
        it.  Raises :class:`SchedulerError`, for an error reply too."""
        req = self._enc.request(snapshot, policy, params, request_id, explain)
        return self._unary(self._stub.Schedule, req, timeout_s, partial(_plan, ids=_ids(snapshot)))

    def stream(self) -> ScheduleStream:
        """One long-lived ScheduleStream (use as a context manager, or ``close()`` it)."""
        return ScheduleStream(self._stub, self._enc, self.timeout_s)

    def report(self, reports: Iterable[IterationReport | pb.IterationReport],
               timeout_s: float | None = None) -> ReportSummary:
        """Send measured iterations (the service fits its latency predictor to them); the
        :class:`ReportSummary` of what it took.  Raises :class:`SchedulerError`, and ValueError
        for a report that cannot be encoded (the ones before it are sent)."""
        enc = _Reports(self._enc.report)
        summary = self._unary(self._stub.ReportIterations, enc.of(reports), timeout_s, _summary)
        enc.check()
        return summary

    def list_policies(self, timeout_s: float | None = None) -> PolicyList:
        """The server's policies and policy config, a :class:`PolicyList`; raises :class:`SchedulerError`."""
        return self._unary(self._stub.ListPolicies, pb.ListPoliciesRequest(), timeout_s, _policy_list)

    def get_predictor(self, profile: ProfileLike = None, timeout_s: float | None = None) -> PredictorInfo:
        """The service's latency predictor for ``profile`` (default: the client's), a
        :class:`PredictorInfo`; raises :class:`SchedulerError`."""
        req = self._enc.predictor_request(profile)
        return self._unary(self._stub.GetPredictor, req, timeout_s, _predictor_info)

    def whatif(self, deployments: Sequence[str] = (), loads: Sequence[float] = (), engine_id: str = "",
               timeout_s: float | None = None) -> dict[str, Any]:
        """A what-if on the service's recording (docs/operations.md, "Before you switch"): the
        answer as ``slidingserve whatif --json`` gives it, its table under ``"table"``.  Raises
        :class:`SchedulerError`."""
        req = self._enc.whatif_request(deployments, loads, engine_id)
        return self._unary(self._stub.WhatIf, req, timeout_s, _whatif_answer)

    def close(self) -> None:
        """Close the channel (``with`` does on leaving)."""
        self._channel.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_END = object()
#: The watchdog's deadline while no call is pending: (call number, due time, call).
_NO_DEADLINE: tuple[int, float, Any] = (-1, math.inf, None)


class ScheduleStream(_BaseStream):
    """Sequential decisions over one bidirectional stream.

    The caller's thread reads the reply straight from the call (no reader thread: a thread
    hand-off per decision measurably costs latency on a loaded engine host).  Per-call
    deadlines are enforced by one watchdog thread that cancels the stream when a reply is
    late; it sleeps until the pending deadline and is woken only for an earlier one, so
    steady traffic costs it no wake-ups.  A broken or cancelled stream is reopened on the
    next call, so an engine keeps one object for its whole life.
    """

    def __init__(self, stub: pb_grpc.SchedulerServiceStub, enc: _Encoder, timeout_s: float) -> None:
        super().__init__(stub, enc, timeout_s)
        self._lock = threading.Lock()  # one decision in flight at a time
        self._cv = threading.Condition()
        self._send: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seq = 0
        self._deadline = _NO_DEADLINE
        #: when the watchdog wakes next (inf: idle, waiting for a deadline)
        self._watch_until = math.inf
        self._expired = -1
        self._closed = False
        threading.Thread(target=self._watch, name="schedule-stream-watchdog", daemon=True).start()

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                seq, due, call = self._deadline
                left = due - time.monotonic()
                if left > 0:
                    self._watch_until = due
                    self._cv.wait(None if call is None else left)
                    continue
                self._deadline = _NO_DEADLINE
                self._expired = seq
                call.cancel()

    def _arm(self, seq: int, due: float, call: Any) -> None:
        """Hand the watchdog this call's deadline."""
        with self._cv:
            self._deadline = (seq, due, call)
            if due < self._watch_until:  # idle, or asleep until after this deadline
                self._cv.notify()

    def _disarm(self, seq: int) -> None:
        with self._cv:
            if self._deadline[0] == seq:
                self._deadline = _NO_DEADLINE  # no notify: the watchdog finds out when it wakes

    def _drop(self) -> None:
        if self._call is not None:
            self._send.put(_END)
            self._call.cancel()
            self._call = None

    def schedule(self, snapshot: SnapshotLike, policy: str | None = None,
                 params: Mapping[str, Any] | None = None, timeout_s: float | None = None, *,
                 request_id: str | None = None) -> Plan:
        """The next decision, as :meth:`SchedulerClient.schedule` gives it.  Raises
        :class:`SchedulerError`: DEADLINE_EXCEEDED when no reply came within ``timeout_s``
        (the next call reopens the stream), CANCELLED once the stream is closed."""
        req = self._enc.request(snapshot, policy, params, request_id)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise SchedulerError(grpc.StatusCode.CANCELLED, "the stream is closed")
            if self._call is None:
                self._send = queue.SimpleQueue()
                self._call = self._stub.ScheduleStream(iter(self._send.get, _END), metadata=self._enc.md())
            self._seq += 1
            seq, call = self._seq, self._call
            self._arm(seq, time.monotonic() + timeout, call)
            try:
                self._send.put(req)
                resp = next(call)
            except StopIteration:
                raise self._fail() from None
            except grpc.RpcError as e:
                raise self._fail(e, timeout if self._expired == seq else None) from None
            finally:
                self._disarm(seq)
            if self._expired == seq:
                # The reply came just as the deadline passed and the watchdog cancelled the
                # stream anyway: the reply is good, the stream is not; reopen it next call
                # (else that call would fail with CANCELLED and count as an error).
                self._drop()
            return self._answer(resp, req, snapshot)

    def close(self) -> None:
        """End the stream and its watchdog (``with`` does on leaving)."""
        with self._lock:
            self._closed = True
            if self._call is not None:
                self._send.put(_END)
                self._call = None
        with self._cv:
            self._cv.notify()

    def __enter__(self) -> ScheduleStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ----------------------------------------------------------- async client
class AsyncSchedulerClient(_BaseClient):
    """asyncio twin of :class:`SchedulerClient` (grpc.aio), whose methods it awaits with the
    same results and errors; create it inside a running loop."""

    def __init__(self, target: str, timeout_s: float = 1.0, *, profile: ProfileLike = None,
                 engine_id: str = "", encoding: str = "columns", max_message_bytes: int = 64 << 20,
                 security: ClientSecurity | None = None) -> None:
        super().__init__(target, timeout_s, profile, engine_id, encoding, security)
        self._channel = self._security.aio_channel(target, _channel_options(max_message_bytes))
        self._stub = pb_grpc.SchedulerServiceStub(self._channel)

    async def _unary(self, method: Any, req: Any, timeout_s: float | None, decode: Callable[[Any], T]) -> T:
        try:
            return decode(await method(req, **self._kwargs(timeout_s)))
        except grpc.RpcError as e:
            raise SchedulerError.from_rpc_error(e) from None

    async def schedule(self, snapshot: SnapshotLike, policy: str | None = None,
                       params: Mapping[str, Any] | None = None, timeout_s: float | None = None, *,
                       request_id: str | None = None, explain: bool = False) -> Plan:
        """:meth:`SchedulerClient.schedule`: the :class:`Plan`; raises :class:`SchedulerError`."""
        req = self._enc.request(snapshot, policy, params, request_id, explain)
        return await self._unary(self._stub.Schedule, req, timeout_s, partial(_plan, ids=_ids(snapshot)))

    def stream(self) -> AsyncScheduleStream:
        """One long-lived AsyncScheduleStream (use with ``async with``, or ``await close()`` it)."""
        return AsyncScheduleStream(self._stub, self._enc, self.timeout_s)

    async def report(self, reports: Iterable[IterationReport | pb.IterationReport]
                     | AsyncIterable[IterationReport | pb.IterationReport],
                     timeout_s: float | None = None) -> ReportSummary:
        """:meth:`SchedulerClient.report`, ``reports`` also an async iterable: the
        :class:`ReportSummary`; raises :class:`SchedulerError`, and ValueError for a report that
        cannot be encoded."""
        enc = _Reports(self._enc.report)
        reqs = enc.of_async(reports) if isinstance(reports, AsyncIterable) else enc.of(reports)
        summary = await self._unary(self._stub.ReportIterations, reqs, timeout_s, _summary)
        enc.check()
        return summary

    async def whatif(self, deployments: Sequence[str] = (), loads: Sequence[float] = (), engine_id: str = "",
                     timeout_s: float | None = None) -> dict[str, Any]:
        """:meth:`SchedulerClient.whatif`: the answer; raises :class:`SchedulerError`."""
        req = self._enc.whatif_request(deployments, loads, engine_id)
        return await self._unary(self._stub.WhatIf, req, timeout_s, _whatif_answer)

    async def list_policies(self, timeout_s: float | None = None) -> PolicyList:
        """:meth:`SchedulerClient.list_policies`: the :class:`PolicyList`; raises :class:`SchedulerError`."""
        return await self._unary(self._stub.ListPolicies, pb.ListPoliciesRequest(), timeout_s, _policy_list)

    async def get_predictor(self, profile: ProfileLike = None,
                            timeout_s: float | None = None) -> PredictorInfo:
        """:meth:`SchedulerClient.get_predictor`: the PredictorInfo; raises :class:`SchedulerError`."""
        req = self._enc.predictor_request(profile)
        return await self._unary(self._stub.GetPredictor, req, timeout_s, _predictor_info)

    async def close(self) -> None:
        """Close the channel (``async with`` does on leaving)."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncSchedulerClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class AsyncScheduleStream(_BaseStream):
    """asyncio version of :class:`ScheduleStream` (one call in flight at a time)."""

    def __init__(self, stub: pb_grpc.SchedulerServiceStub, enc: _Encoder, timeout_s: float) -> None:
        super().__init__(stub, enc, timeout_s)
        self._lock = asyncio.Lock()

    async def schedule(self, snapshot: SnapshotLike, policy: str | None = None,
                       params: Mapping[str, Any] | None = None, timeout_s: float | None = None, *,
                       request_id: str | None = None) -> Plan:
        """:meth:`ScheduleStream.schedule`: the :class:`Plan`; raises :class:`SchedulerError`
        (DEADLINE_EXCEEDED when late; the next call reopens the stream)."""
        req = self._enc.request(snapshot, policy, params, request_id)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            if self._call is None:
                self._call = self._stub.ScheduleStream(metadata=self._enc.md())
            call = self._call
            try:
                async with asyncio.timeout(timeout):
                    await call.write(req)
                    resp = await call.read()
            except TimeoutError:
                raise self._fail(late=timeout) from None
            except grpc.RpcError as e:
                raise self._fail(e) from None
            except asyncio.CancelledError:  # the reply may still come: it must not answer the next call
                self._drop()
                raise
            if resp is grpc.aio.EOF:
                raise self._fail()
            return self._answer(resp, req, snapshot)

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        """Half-close the stream (``async with`` does on leaving); the next call opens a new one."""
        async with self._lock:
            if self._call is not None:
                await self._call.done_writing()
                self._call = None

    async def __aenter__(self) -> AsyncScheduleStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
