"""How a process of a multi-host group ends: at once, with its reason in the log and the pod's
termination message, and never through JAX's shutdown barrier (``jax.distributed.shutdown`` at exit
waits minutes for processes that are already gone)."""

from __future__ import annotations

import logging
import os
import sys

from ..contracts.request import EngineUnavailableError


class GroupFailedError(EngineUnavailableError):
    """A process of the multi-host group died, stopped answering or failed. The pod's termination message
    starts with this name; the operator reports it in the InferenceModel's status (which pod, and why)."""


def exit_process(code: int, reason: str | None = None) -> None:
    """Flush the logs and end the process with ``code``; ``reason`` (a failure) goes to the termination
    log first."""
    if reason and code:
        from ..models.sources.errors import write_termination_log

        write_termination_log(GroupFailedError(reason))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
