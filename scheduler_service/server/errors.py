"""The one mapping from failures in the servicer to gRPC statuses.

* a :class:`~scheduler_service.core.ValidationError` (bad input, including request bytes
  that are no message: :class:`.handlers.Undecodable`) is INVALID_ARGUMENT with a
  ``google.rpc.BadRequest`` naming each violated field
  (:func:`scheduler_service.wire.status.invalid_argument`);
* anything else is INTERNAL with a reference id; the traceback goes to the server log
  under that id and never to the caller.

Unary and client-streaming RPCs get it from :func:`rpc_errors`, which aborts the call with
the status; ``ScheduleStream`` answers each failed request with the same code and message in
a ``ScheduleError`` (:meth:`RpcFailure.to_pb`) and keeps the stream open.

A call its caller ended (cancelled, past its deadline, connection lost) while the server
was reading the caller's stream (``ReportIterations``) is no failure of the server's
(:func:`_peer_gone`): logged as ``rpc_cancelled`` at info, with no traceback, and not
counted as an error.  (gRPC itself ends a cancelled ``ScheduleStream`` quietly.)
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from scheduler_service.core import ValidationError
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import violations_to_pb
from scheduler_service.wire.status import MAX_FIELD_BYTES, MAX_MESSAGE_BYTES, clip, invalid_argument

from .handlers import Undecodable
from .metrics import Metrics

__all__ = ["RpcFailure", "failure", "rpc_errors"]

log = structlog.get_logger("slidingserve.server")

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class RpcFailure:
    """What a failed request is answered with: a status code and message, and for bad
    input the :class:`ValidationError` whose violations travel as details."""

    code: grpc.StatusCode
    message: str
    invalid: ValidationError | None = None

    def abort(self, context: grpc.ServicerContext) -> NoReturn:
        """End the call with this status (raises, as ``context.abort`` does)."""
        if self.invalid is not None:
            context.abort_with_status(invalid_argument(self.invalid))
        context.abort(self.code, self.message)
        raise AssertionError("context.abort raises")

    def to_pb(self, request_id: str) -> pb.ScheduleResponse:
        """The in-stream answer: same code and message, violations as the unary details."""
        err = pb.ScheduleError(code=self.code.value[0], message=self.message)
        if self.invalid is not None:
            err.field_violations.extend(violations_to_pb(self.invalid))
        return pb.ScheduleResponse(request_id=request_id, error=err)


def _peer_gone(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """Whether ``exc`` is what reading a request stream raises once the caller has ended
    the call (gRPC's bare ``RpcError``; the call is no longer active)."""
    return isinstance(exc, grpc.RpcError) and not context.is_active()


def failure(exc: Exception, metrics: Metrics, rpc: str, request_id: str = "", *,
            log_rejected: bool = True) -> RpcFailure:
    """Classify ``exc`` (call it inside ``except``: INTERNAL logs the traceback), count it
    in ``slidingserve_decision_errors`` and log it.  ``log_rejected`` False leaves bad input
    uncounted and unlogged (the metadata RPCs: their callers are operators, not engines)."""
    if isinstance(exc, ValidationError):
        if log_rejected:
            metrics.decision_errors.labels("INVALID_ARGUMENT").inc()
            # clipped like the status: a caller must not be able to write megabytes to the log
            log.info("request_rejected", rpc=rpc, request_id=clip(request_id, MAX_FIELD_BYTES),
                     error=clip(str(exc), MAX_MESSAGE_BYTES))
        return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), MAX_MESSAGE_BYTES), exc)
    ref = uuid.uuid4().hex[:12]
    log.exception("rpc_failed", rpc=rpc, ref=ref, request_id=request_id)
    metrics.decision_errors.labels("INTERNAL").inc()
    return RpcFailure(grpc.StatusCode.INTERNAL, f"internal error (ref {ref}); see the server log")


def rpc_errors(*, ready: bool = True, log_rejected: bool = True) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate a servicer method ``(self, request, context)``; ``self`` has ``_metrics``
    and, with ``ready``, ``_check_ready(context)``, which runs first (UNAVAILABLE while the
    server loads).  Then an :class:`Undecodable` request is rejected before the method runs,
    and whatever the method raises ends the call through :func:`failure`."""

    def wrap(method: Callable[..., R]) -> Callable[..., R]:
        rpc = method.__name__

        @functools.wraps(method)
        def handler(self: Any, request: Any, context: grpc.ServicerContext) -> R:
            if ready:
                self._check_ready(context)
            try:
                if isinstance(request, Undecodable):  # bytes that are no request (handlers.py)
                    raise request.error
                return method(self, request, context)
            except Exception as e:
                if _peer_gone(e, context):
                    log.info("rpc_cancelled", rpc=rpc)
                    context.abort(grpc.StatusCode.CANCELLED, "the caller ended the call")
                request_id = getattr(request, "request_id", "")
                failure(e, self._metrics, rpc, request_id, log_rejected=log_rejected).abort(context)

        return handler

    return wrap
