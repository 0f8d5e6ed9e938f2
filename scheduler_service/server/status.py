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

__all__ = ["clip", "invalid_argument", "status_with_code"]


#: Bounds on what an INVALID_ARGUMENT echoes back.  The status travels in trailing metadata,
#: which clients refuse above 8 KiB (soft) / 16 KiB (hard) — they then see a bare
#: RESOURCE_EXHAUSTED without details — and messages echo client input (a 5 KB policy name).
#: Worst case with these bounds: ~6 KB of trailers.  Byte counts are of the UTF-8 text.
MAX_VIOLATIONS = 10
MAX_FIELD_BYTES = 100
MAX_DESCRIPTION_BYTES = 200
MAX_MESSAGE_BYTES = 400


def clip(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes (marked with "...") when longer."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    return raw[: max_bytes - 3].decode("utf-8", "ignore") + "..."


def invalid_argument(err: ValidationError) -> grpc.Status:
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=clip(v.field, MAX_FIELD_BYTES), description=clip(v.description, MAX_DESCRIPTION_BYTES)
            )
            for v in err.violations[:MAX_VIOLATIONS]
        ]
    )
    detail = any_pb2.Any()
    detail.Pack(bad)
    msg = status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT, message=clip(str(err), MAX_MESSAGE_BYTES), details=[detail]
    )
    return rpc_status.to_status(msg)


def status_with_code(code: grpc.StatusCode, message: str) -> grpc.Status:
    msg = status_pb2.Status(code=code.value[0], message=message)
    return rpc_status.to_status(msg)
