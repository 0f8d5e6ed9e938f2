"""The Python client, under the name the first release gave it.

The client lives in :mod:`scheduler_service.client` (below the engine adapter, which needs
it for its remote planner); this module keeps ``from clients.client import SchedulerClient``
working for code written against the first release.  It loads nothing more than that
module does: no server, no prometheus.  Its names are that module's ``__all__``, listed once.
"""

from scheduler_service.client import *  # noqa: F403
from scheduler_service.client import __all__ as __all__
