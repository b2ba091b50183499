"""Workers end when their launcher dies.

A launcher killed with SIGKILL cannot stop its workers, and orphaned workers keep training into the run
directory, racing the next run started there. On Linux the kernel can deliver a signal to a process when its
parent exits (``prctl(PR_SET_PDEATHSIG)``, through ctypes: no compiled extension); elsewhere a daemon thread
watches the parent pid. The launcher exports its pid as ``MCORE_LAUNCHER_PID`` so that a worker whose
launcher died before the request was made ends at once too; under ``torchrun`` the parent is its agent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "MCORE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def _request_parent_death_signal(sig: int) -> bool:
    """Ask the Linux kernel for ``sig`` when the parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)


def end_with_parent(expected_parent: int | None = None, *, poll_s: float = 1.0) -> str:
    """Make this process end (SIGKILL) when its parent exits; return how (``"prctl"`` or ``"watcher"``).

    SIGKILL rather than SIGTERM: without its launcher the run cannot continue or restart, and a checkpoint
    save started now would race a new run in the same directory; the last committed checkpoint stays intact.
    ``expected_parent``: the parent's pid, if known; a process already orphaned (its parent differs) ends now.
    """
    parent = os.getppid() if expected_parent is None else expected_parent
    how = "prctl" if _request_parent_death_signal(signal.SIGKILL) else "watcher"
    if how == "watcher":
        threading.Thread(target=_watch_parent, args=(parent, poll_s), name="mcore-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return how


def end_with_launcher() -> str | None:
    """:func:`end_with_parent` for a worker started by ``mcore-train --nproc-per-node`` (its launcher's pid is
    known) or by ``torchrun`` (its parent is the elastic agent); else nothing (None)."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)  # not inherited by processes this worker starts
    if launcher and launcher.isdigit():
        return end_with_parent(int(launcher))
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return end_with_parent()
    return None
