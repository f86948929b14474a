"""The error every remote source raises: it names the source and the cause."""

from __future__ import annotations

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
