"""gRPC error statuses with structured details.

Bad input is INVALID_ARGUMENT carrying a ``google.rpc.BadRequest`` with one field
violation per problem, so that clients in any language can show *which* field is wrong
without parsing messages.  Internal errors carry only a reference id that is also in the
server log: a traceback never leaves the server.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from scheduler_service.core import ValidationError

__all__ = ["invalid_argument", "status_with_code"]


def invalid_argument(err: ValidationError) -> grpc.Status:
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in err.violations
        ]
    )
    detail = any_pb2.Any()
    detail.Pack(bad)
    msg = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(err), details=[detail])
    return rpc_status.to_status(msg)


def status_with_code(code: grpc.StatusCode, message: str) -> grpc.Status:
    msg = status_pb2.Status(code=code.value[0], message=message)
    return rpc_status.to_status(msg)
