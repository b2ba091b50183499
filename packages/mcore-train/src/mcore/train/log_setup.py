"""Logging of the ``mcore-train`` command: time and level on every line, INFO on rank 0 and WARNING elsewhere,
so the kernel backend choices (``mcore.kernels`` logs them at INFO) and every warning reach the console."""

from __future__ import annotations

import logging
import os
import sys

_HANDLER_NAME = "mcore-train"


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (so redirecting it, as tests and
    notebooks do, redirects the log too), like :data:`logging.lastResort`."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging() -> logging.Handler:
    """Install (once) a handler on the root logger; Python warnings are routed through it as well.

    Rank 0 (``RANK`` unset or 0) logs INFO and above, other ranks WARNING and above with their rank in the line.
    A library user who configured logging already keeps their handlers; ours is added next to them.
    """
    root = logging.getLogger()
    for handler in root.handlers:
        if handler.get_name() == _HANDLER_NAME:
            return handler
    rank = int(os.environ.get("RANK", "0"))
    where = f" [rank {rank}]" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler = _CurrentStderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s"))
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.addHandler(handler)
    if root.level > handler.level or root.level == logging.NOTSET:
        root.setLevel(handler.level)
    logging.captureWarnings(True)
    return handler
