"""The gRPC server around the policy core (gRPC lives here; the core stays gRPC-free).

``SchedulerServer`` embeds the service (tests, demo: ``ServerConfig(port=0)``), ``serve``
runs it until SIGTERM/SIGINT (the CLI's ``slidingserve serve``).
"""

from __future__ import annotations

from scheduler_service.wire.profile import EngineProfile

from .app import SERVICE_NAME, SchedulerServer, serve
from .config import ServerConfig

__all__ = ["SERVICE_NAME", "EngineProfile", "SchedulerServer", "ServerConfig", "serve"]
