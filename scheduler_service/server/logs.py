"""Structured JSON logs (one object per line on stderr) via structlog.

JSON because the service runs in containers whose log pipelines parse lines; every event
has a name (``decision_failed``, ``predictor_refit``…) plus key/value context, never an
interpolated sentence.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["bind_process", "configure_logging"]

#: Context every log line of this process carries (a worker's index: workers.py).
_PROCESS: dict[str, Any] = {}


def bind_process(**context: Any) -> None:
    """Add ``context`` to every later log line of this process, on every thread (structlog's
    context variables are per thread, and gRPC handlers run on pool threads)."""
    _PROCESS.update(context)


def _merge_process(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for k, v in _PROCESS.items():
        event.setdefault(k, v)
    return event


def configure_logging(level: str = "info") -> None:
    """Configure structlog process-wide (idempotent; the last call's level wins)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _merge_process,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # One write() per line: workers share the supervisor's stderr, and print() (PrintLogger)
        # writes the text and its newline separately, which unbuffered stderr (PYTHONUNBUFFERED)
        # passes on as two writes that another process's line can land between.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
