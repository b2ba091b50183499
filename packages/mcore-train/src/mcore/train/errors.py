"""The one exception type that the ``mcore-train`` command turns into a one-line message."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, files, checkpoints) rather than a bug in mcore.

    The CLI prints ``mcore-train: error: <message>`` on stderr and exits with code 2; the traceback is
    shown only with ``--debug``. Messages name what was expected, what was received and how to fix it.
    """


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible with the model being trained."""
