"""gRPC error statuses with structured details, both ways.

Bad input is INVALID_ARGUMENT carrying a ``google.rpc.BadRequest`` with one field
violation per problem, so that clients in any language can show *which* field is wrong
without parsing messages (:func:`invalid_argument` builds it on the server,
:func:`violations_from_status` reads it back on the client).  Internal errors carry only a
reference id that is also in the server log: a traceback never leaves the server.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from scheduler_service.core import FieldViolation, ValidationError

__all__ = ["STATUS_DETAILS_KEY", "clip", "invalid_argument", "violations_from_status"]

#: The trailing-metadata key of the serialized ``google.rpc.Status`` (gRPC's convention).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


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


def violations_from_status(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[FieldViolation, ...]:
    """The BadRequest field violations in a call's trailing metadata (empty when none)."""
    out: tuple[FieldViolation, ...] = ()
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY:
            continue
        st = status_pb2.Status.FromString(value.encode() if isinstance(value, str) else value)
        for d in st.details:
            if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                d.Unpack(bad)
                out += tuple(FieldViolation(v.field, v.description) for v in bad.field_violations)
    return out
