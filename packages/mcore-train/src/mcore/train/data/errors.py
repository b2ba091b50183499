"""The error raised for unusable data files (missing, truncated, malformed)."""

from __future__ import annotations

from mcore.train.errors import UserError


class DataError(UserError, ValueError):
    """A data file that is missing, truncated or malformed, or data that cannot serve the request.

    It is a ``UserError`` (the ``mcore-train`` command prints it as one line and exits non-zero) and a
    ``ValueError`` (callers that only know the standard hierarchy can still catch it).
    """
