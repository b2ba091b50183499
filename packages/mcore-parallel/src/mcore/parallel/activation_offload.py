"""Activation offload: the tensors that selected modules save for backward go to host memory during the forward
and come back just before the backward needs them (Megatron's fine-grained activation offloading).

``ActivationOffload(device).attach(groups)`` takes, in forward order, one list of modules per layer (say the
attention and MLP of each decoder layer). While one of those modules runs forward, every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), parameters and tensors under ``min_numel`` elements excepted, is
copied device-to-host into pinned memory on a side stream, behind the compute that produced it; the caching
allocator reuses its device memory once the copy is done (``record_stream``). In backward the first saved tensor
a layer asks for brings back all of that layer's tensors and starts bringing back the previous layer's, on the
side stream, so that its copy overlaps this layer's backward; the compute stream waits only for the tensor it
needs now.

Recompute composes: a region checkpointed inside an offloaded module (selective recompute of the attention core)
keeps its own hooks, so what it discards is recomputed, and the rest is offloaded. On CPU the same code runs with
synchronous copies (a host copy of a host tensor: only for testing the path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["ActivationOffload"]


class _Layer:
    """The tensors one forward of one layer offloaded, and the layer that ran before it (prefetched after it)."""

    __slots__ = ("fetched", "previous", "saved")

    def __init__(self, previous: _Layer | None) -> None:
        self.saved: list[_Saved] = []
        self.previous = previous
        self.fetched = False


class _Saved:
    __slots__ = ("device_copy", "event", "host", "layer")

    def __init__(self, host: torch.Tensor, layer: _Layer) -> None:
        self.host = host
        self.layer = layer
        self.device_copy: torch.Tensor | None = None
        self.event = None


class ActivationOffload:
    """Offloads what the attached modules save for backward to host memory (see the module docstring)."""

    def __init__(self, device: torch.device | str, *, min_numel: int = 1024) -> None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"ActivationOffload: min_numel must be an int >= 0, got {min_numel!r}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            # "cuda" != "cuda:0" as torch.device values: without the index no saved tensor would match below
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_numel = min_numel
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._current: _Layer | None = None
        self._current_key: object | None = None
        self._current_modules: set[int] = set()
        self._contexts: list = []
        self._handles: list = []
        self.offloaded_tensors = 0  # counters for tests and logs
        self.offloaded_bytes = 0

    def attach(self, layers: Sequence[Sequence[nn.Module]]) -> None:
        """Offload what the modules of each layer (a list per layer, layers in forward order) save."""
        for modules in layers:
            key = object()  # the layer these modules belong to
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._entering(key, id(module))))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- forward: device -> host ----------------------------------------------------------------------------------

    def _entering(self, key: object, module_id: int):
        def hook(module: nn.Module, args) -> None:
            if not torch.is_grad_enabled():
                self._contexts.append(None)
                return
            # a new group for each forward of a layer: another layer, or the same module again (next micro-batch)
            if self._current is None or self._current_key is not key or module_id in self._current_modules:
                last = self._current
                if last is not None and not last.saved and not last.fetched:
                    last = last.previous  # nothing to bring back there: link past it
                self._current = _Layer(last)
                self._current_key, self._current_modules = key, set()
            self._current_modules.add(module_id)
            context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            context.__enter__()
            self._contexts.append(context)

        return hook

    def _exit(self, module: nn.Module, args, output) -> None:
        context = self._contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor):
        if (
            isinstance(tensor, nn.Parameter)
            or tensor.numel() < self.min_numel
            or tensor.device != self.device
            or tensor.layout != torch.strided
        ):
            return tensor
        layer = self._current
        if self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            ready = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is reused only once the copy has read it
        else:
            host = tensor.detach().clone()
        saved = _Saved(host, layer)
        layer.saved.append(saved)
        self.offloaded_tensors += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        return saved

    # ---- backward: host -> device -----------------------------------------------------------------------------

    def _fetch(self, layer: _Layer) -> None:
        layer.fetched = True
        saved, layer.saved = layer.saved, []  # from now on the _Saved objects live in autograd's graph only
        self._copy_back(saved)

    def _copy_back(self, saved: list[_Saved]) -> None:
        if not self.cuda:
            for s in saved:
                s.device_copy = s.host.clone()
            return
        # the copies land in memory that the compute stream may have just freed: start after its queued work
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for s in saved:
            s.device_copy = torch.empty(s.host.shape, dtype=s.host.dtype, device=self.device)
            with torch.cuda.stream(self.stream):
                s.device_copy.copy_(s.host, non_blocking=True)
                s.event = self.stream.record_event()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        layer = packed.layer
        if not layer.fetched:  # the first tensor this layer's backward asks for: bring back all of them
            self._fetch(layer)
        previous, layer.previous = layer.previous, None
        if previous is not None and not previous.fetched:
            self._fetch(previous)  # the layer whose backward comes next
        if packed.device_copy is None:  # unpacked a second time (retain_graph): from the host copy again
            self._copy_back([packed])
        out, packed.device_copy = packed.device_copy, None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.event)
        return out
