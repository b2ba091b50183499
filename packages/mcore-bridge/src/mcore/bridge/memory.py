"""Give freed tensor memory back to the operating system between tensors.

glibc serves allocations below its (adaptive, up to 32 MiB) mmap threshold from the heap and keeps freed heap
pages, so a stream of medium-sized tensors ratchets the resident size up by tens of MiB beyond what is live.
``malloc_trim(0)`` returns those pages; elsewhere (other C libraries, other systems) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc); call between tensors of a streaming conversion."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
