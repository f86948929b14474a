"""The error every remote source raises: it names the source and the cause."""

from __future__ import annotations

import os

from ..errors import CheckpointError


class ModelSourceError(CheckpointError):
    """A model source that cannot be fetched or is not a usable checkpoint.

    ``str(e)`` is ``"<source>: <cause>"``; ``e.source`` and ``e.cause`` hold the two parts and ``e.kind`` a
    short machine-readable word (``not_found``, ``access_denied``, ``no_credentials``, ``invalid``,
    ``transfer``, ``disk_full``, ``corrupt``, ``config``).
    """

    def __init__(self, source: str, cause: str, kind: str = "error"):
        self.source = source
        self.cause = cause
        self.kind = kind
        super().__init__(f"{source}: {cause}")


TERMINATION_LOG_ENV = "VSURGE_TERMINATION_LOG"
_K8S_TERMINATION_LOG = "/dev/termination-log"
_LIMIT = 4096  # the kubelet keeps at most 4096 bytes of a termination message


def termination_message(exc: BaseException) -> str:
    """What the pod tells the cluster: ``ModelSourceError: <source>: <cause>`` for a model that cannot be
    fetched or read (the operator turns it into the InferenceModel's Degraded/ModelSourceError), else
    ``<Type>: <message>``."""
    kind = "ModelSourceError" if isinstance(exc, CheckpointError) else type(exc).__name__
    return f"{kind}: {exc}"[:_LIMIT]


def write_termination_log(exc: BaseException) -> str | None:
    """Write the message to ``$VSURGE_TERMINATION_LOG``, else to /dev/termination-log when it exists (in a
    Kubernetes container); returns the path written, or None. Never raises."""
    path = os.environ.get(TERMINATION_LOG_ENV) or (
        _K8S_TERMINATION_LOG if os.path.exists(_K8S_TERMINATION_LOG) else None
    )
    if not path:
        return None
    try:
        with open(path, "w") as f:
            f.write(termination_message(exc))
    except OSError:
        return None
    return path
