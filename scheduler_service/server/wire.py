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
rejected report on ``ReportIterations``.  The method table mirrors the generated
``add_SchedulerServiceServicer_to_server`` (same names and serializers), so the wire
contract is unchanged.
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


def add_servicer(servicer: Any, server: grpc.Server) -> None:
    """``add_SchedulerServiceServicer_to_server`` with never-raising request decoding."""
    handlers = {
        "Schedule": grpc.unary_unary_rpc_method_handler(
            servicer.Schedule, request_deserializer=_tolerant(pb.ScheduleRequest),
            response_serializer=pb.ScheduleResponse.SerializeToString),
        "ScheduleStream": grpc.stream_stream_rpc_method_handler(
            servicer.ScheduleStream, request_deserializer=_tolerant(pb.ScheduleRequest),
            response_serializer=pb.ScheduleResponse.SerializeToString),
        "ReportIterations": grpc.stream_unary_rpc_method_handler(
            servicer.ReportIterations, request_deserializer=_tolerant(pb.IterationReport),
            response_serializer=pb.ReportSummary.SerializeToString),
        "ListPolicies": grpc.unary_unary_rpc_method_handler(
            servicer.ListPolicies, request_deserializer=_tolerant(pb.ListPoliciesRequest),
            response_serializer=pb.ListPoliciesResponse.SerializeToString),
        "GetPredictor": grpc.unary_unary_rpc_method_handler(
            servicer.GetPredictor, request_deserializer=_tolerant(pb.GetPredictorRequest),
            response_serializer=pb.GetPredictorResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
