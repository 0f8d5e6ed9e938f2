"""How the command line reports failures: one line on stderr and an exit code.

The one mapping from an exception to ``(line, exit code)`` is :func:`describe`; the
subcommands raise :class:`CliError` for their own input errors, the core raises
:class:`~scheduler_service.core.ValidationError`, and a call to a server fails with
:class:`~scheduler_service.client.SchedulerError`, which carries the gRPC status the server answered
(decoded from the status, with the violated fields, by :meth:`SchedulerError.from_rpc_error`).
Nothing prints a traceback.
"""

from __future__ import annotations

from scheduler_service.client import SchedulerError
from scheduler_service.core import ValidationError

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_UNHEALTHY", "EXIT_USAGE", "CliError", "describe"]

EXIT_OK = 0
#: ``health``: the service is reachable but not SERVING, or not reachable.  1, not 2:
#: Docker's HEALTHCHECK reads 1 as "unhealthy" and reserves 2.
EXIT_UNHEALTHY = 1
#: Bad input, a failed remote call, or any other error.
EXIT_USAGE = 2
#: Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def describe(exc: Exception) -> tuple[str, int]:
    """The stderr line and exit code for a failure of a subcommand."""
    if isinstance(exc, CliError):
        return f"error: {exc}", EXIT_USAGE
    if isinstance(exc, ValidationError):
        return f"error: invalid input: {exc}", EXIT_USAGE
    if isinstance(exc, SchedulerError):  # "error: INVALID_ARGUMENT: <the server's message>"
        return f"error: {exc}", EXIT_USAGE
    return f"error: {type(exc).__name__}: {exc}", EXIT_USAGE
