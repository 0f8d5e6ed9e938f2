"""The gRPC server around the policy core (gRPC lives here; the core stays gRPC-free).

``SchedulerServer`` embeds the service (tests, demo: ``ServerConfig(port=0)``), ``serve``
runs it until SIGTERM/SIGINT (the CLI's ``slidingserve serve``; one process, or with
``workers`` > 1 a supervisor of several).

Importing the package loads nothing else: each name loads its own module on first access
(PEP 562), so that a user of one submodule (the simulated bench's runner imports
:mod:`.config`) does not load the gRPC server stack, health and reflection included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler_service.wire.profile import EngineProfile

    from .app import SchedulerServer
    from .config import ServerConfig
    from .handlers import SERVICE_NAME
    from .workers import serve

__all__ = ["SERVICE_NAME", "EngineProfile", "SchedulerServer", "ServerConfig", "serve"]


def __getattr__(name: str) -> Any:
    # deferred imports, each the module of one name (visible to tests/test_layers.py)
    value: Any
    if name == "SERVICE_NAME":
        from .handlers import SERVICE_NAME as value
    elif name == "EngineProfile":
        from scheduler_service.wire.profile import EngineProfile as value
    elif name == "SchedulerServer":
        from .app import SchedulerServer as value
    elif name == "ServerConfig":
        from .config import ServerConfig as value
    elif name == "serve":
        from .workers import serve as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later accesses do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
