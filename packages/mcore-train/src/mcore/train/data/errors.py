"""The error raised for unusable data files (missing, truncated, malformed)."""

from __future__ import annotations

from mcore.train.errors import UserError


class DataError(UserError, ValueError):
    """A data file that is missing, truncated or malformed, or data that cannot serve the request.

    It is a ``UserError`` (the ``mcore-train`` command prints it as one line and exits non-zero) and a
    ``ValueError`` (callers that only know the standard hierarchy can still catch it).
    """


class EmptySplitError(DataError):
    """A train/valid/test split that holds no documents of a corpus although samples were asked of it.

    ``split_name`` is ``train``, ``valid`` or ``test``; the run-level code turns it into a message that names
    its config keys.
    """

    def __init__(self, message: str, *, split_name: str, corpus: str, split: object) -> None:
        super().__init__(message)
        self.split_name = split_name
        self.corpus = corpus
        self.split = split
