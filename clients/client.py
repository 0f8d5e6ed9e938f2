"""The Python client, under the name the first release gave it.

The client lives in :mod:`scheduler_service.client` (below the engine adapter, which needs
it for its remote planner); this module keeps ``from clients.client import SchedulerClient``
working for code written against the first release.  It loads nothing more than that
module does: no server, no prometheus.
"""

from scheduler_service.client import (
    AsyncSchedulerClient,
    ClientSecurity,
    DeploymentInfo,
    EngineProfile,
    IterationReport,
    PolicyInfo,
    PolicyList,
    PolicyParamInfo,
    PredictorInfo,
    ReportSummary,
    SchedulerClient,
    SchedulerError,
)

__all__ = [
    "AsyncSchedulerClient",
    "ClientSecurity",
    "DeploymentInfo",
    "EngineProfile",
    "IterationReport",
    "PolicyInfo",
    "PolicyList",
    "PolicyParamInfo",
    "PredictorInfo",
    "ReportSummary",
    "SchedulerClient",
    "SchedulerError",
]
