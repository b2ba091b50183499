"""What a stalled thread waits in: the ``torch.distributed`` call (and its peers) on its Python stack.

Two shapes occur: a blocking call (``dist.all_reduce(...)``, ``dist.recv(t, src=1)``), whose frames lie in
``torch/distributed/`` and whose arguments name the peers; and the ``.wait()`` of an asynchronous operation
(the gradient buckets' all-reduce), where the stack holds no torch frame at all, only the line
``handle.wait()`` on a ``torch.distributed.Work``. Both are described in words for the hang watchdog.
"""

from __future__ import annotations

import linecache
import os
import re
from types import FrameType
from typing import Any

_WAIT_LINE = re.compile(r"^(?:[\w.\[\]]+\s*=\s*)?([A-Za-z_][\w.]*)\.wait\(\s*\)")


def _in_dist(frame: FrameType) -> bool:
    return "/torch/distributed/" in frame.f_code.co_filename.replace(os.sep, "/")


def _group_ranks(group: Any) -> str:
    import torch.distributed as dist

    try:
        if group is None or group is dist.group.WORLD:
            return f" over all {dist.get_world_size()} ranks"
        return f" over ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - a description must never fail the watchdog
        return ""


def _peers(frames: list[FrameType]) -> str:
    """The peers of a ``torch.distributed`` call, from the arguments of its frames (innermost first)."""
    for frame in frames:
        args = frame.f_locals
        for key, word in (("src", "from"), ("dst", "to"), ("group_src", "from"), ("group_dst", "to")):
            if isinstance(args.get(key), int):
                return f" {word} rank {args[key]}"
        if "group" in args:
            return _group_ranks(args["group"])
    return ""


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _awaited_work(frame: FrameType) -> str | None:
    """``frame`` stands on ``x.y.wait()`` with ``x.y`` a ``torch.distributed.Work``: describe it, else None."""
    import torch.distributed as dist

    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    match = _WAIT_LINE.match(line)
    if match is None:
        return None
    first, *rest = match.group(1).split(".")
    scope = {**frame.f_globals, **frame.f_locals}
    if first not in scope:
        return None
    obj = scope[first]
    for attr in rest:  # attribute reads only: nothing is called or evaluated
        obj = getattr(obj, attr, None)
    if not isinstance(obj, dist.Work):
        return None
    owner = frame.f_locals.get("self")
    groups = [v for v in vars(owner).values() if isinstance(v, dist.ProcessGroup)] if owner is not None else []
    peers = _group_ranks(groups[0]) if len(groups) == 1 else ""
    return f"the .wait() of an asynchronous torch.distributed operation (`{line}`){peers} at {_site(frame)}"


def describe_blocking_call(frame: FrameType | None) -> str | None:
    """The ``torch.distributed`` call the stack ending in ``frame`` waits in, with its peers and call site."""
    stack = []  # innermost first
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    inner = next((i for i, f in enumerate(stack) if _in_dist(f)), None)
    if inner is None:
        return _awaited_work(stack[0]) if stack else None
    outer = inner
    while outer + 1 < len(stack) and _in_dist(stack[outer + 1]):
        outer += 1
    caller = stack[outer + 1] if outer + 1 < len(stack) else None
    where = f" called from {_site(caller)}" if caller else ""
    return f"torch.distributed {stack[inner].f_code.co_name}(){_peers(stack[inner : outer + 1])}{where}"
