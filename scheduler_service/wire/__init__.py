"""The wire layer: protobuf ↔ core conversion, engine profiles and gRPC error details.

Server (:mod:`scheduler_service.server`) and client (:mod:`scheduler_service.client`) both stand on
it; it imports only the core (:mod:`scheduler_service.core`) and the generated code
(:mod:`scheduler_service.gen`), so importing the client never loads the server.

* :mod:`.convert`  messages ↔ core types (snapshots, plans, reports, policy info)
* :mod:`.profile`  :class:`EngineProfile`, the key under which engines share a predictor
* :mod:`.status`   INVALID_ARGUMENT with ``google.rpc.BadRequest`` details, both ways
"""

from __future__ import annotations

from .profile import EngineProfile

__all__ = ["EngineProfile"]
