"""Registering the service with request decoding that never raises.

grpc-python decodes each request with the handler's ``request_deserializer`` before the
servicer sees it.  With the generated ``FromString`` a request whose bytes are not a valid
message makes grpc answer INTERNAL "Exception deserializing request!" by itself — the
wrong code for bad input, no details — and, measured with grpcio 1.85, retains about 19 KB
of per-call state each time and can leave a stream whose first message fails to decode
unreleased, so that shutdown waits for it (``tests/test_fuzz_service.py``).

Here the deserializer returns an :class:`Undecodable` marker instead of raising, and the
servicer answers it like any other invalid request: INVALID_ARGUMENT with a field
violation on unary calls, an error response on ``ScheduleStream`` (which stays open), a
rejected report on ``ReportIterations``.  Names and serializers are those of the
generated ``add_SchedulerServiceServicer_to_server``, so the wire contract is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from scheduler_service.core import ValidationError
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb

__all__ = ["SERVICE_NAME", "Undecodable", "add_servicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name


class Undecodable:
    """A request whose bytes are not a valid ``message`` (stands in for it)."""

    request_id = ""

    def __init__(self, message: str, error: str) -> None:
        self.error = ValidationError.single("request", f"not a valid {message}: {error}"[:300])


def _tolerant(cls: type[Message]) -> Callable[[bytes], Any]:
    name = cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:  # RuntimeError: recursion limits
            return Undecodable(name, str(e) or type(e).__name__)

    return decode


#: grpc's handler factory per (client streaming, server streaming)
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(servicer: Any, server: grpc.Server) -> None:
    """``add_SchedulerServiceServicer_to_server`` with never-raising request decoding.  The
    method table is derived from the service descriptor, so an RPC added to the proto is
    served (by the servicer's method of that name) without touching this module."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["SchedulerService"].methods:
        request_cls = getattr(pb, m.input_type.name)
        response_cls = getattr(pb, m.output_type.name)
        handlers[m.name] = _FACTORIES[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name), request_deserializer=_tolerant(request_cls),
            response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
