"""Structured JSON logs (one object per line on stderr) via structlog.

JSON because the service runs in containers whose log pipelines parse lines; every event
has a name (``decision_failed``, ``predictor_refit``…) plus key/value context, never an
interpolated sentence.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging"]


def configure_logging(level: str = "info") -> None:
    """Configure structlog process-wide (idempotent; the last call's level wins)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
