"""The vLLM engine adapter: ``vllm serve <model> --scheduler-cls engine_adapter.vllm.RemoteScheduler``.

Public names (stable): :class:`RemoteScheduler` (vLLM's ``AsyncScheduler``, for
async scheduling, vLLM's default) and :class:`RemoteSyncScheduler` (``Scheduler``).
They are loaded on first access (PEP 562), so importing this package, or its
:mod:`.settings`, does not import vLLM; only the scheduler classes need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .settings import SettingsError, VllmAdapterSettings

if TYPE_CHECKING:
    from .scheduler import RemoteScheduler, RemoteSyncScheduler

__all__ = ["RemoteScheduler", "RemoteSyncScheduler", "SettingsError", "VllmAdapterSettings"]


def __getattr__(name: str) -> Any:
    if name in ("RemoteScheduler", "RemoteSyncScheduler"):
        from . import scheduler  # lazy: it imports vLLM, an optional extra; the settings do not

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
