"""Selective recompute by module (Megatron-Core's ``--recompute-modules``) and the two checkpoint forms it uses.

``recompute="selective"`` with ``recompute_modules`` lists exactly which sub-blocks drop their activations in
forward and run again in backward (Megatron's names):

- ``core_attn``: the attention core (scores, softmax, weighted sum; with flash attention its log-sum-exp);
- ``mla_up_proj``: MLA's up-projections and the rotary step: q, k and v are rebuilt from the latents;
- ``layernorm``: the two pre-norms' outputs (the inputs of the mixer and of the MLP);
- ``mlp``: a dense MLP (not an MoE layer, as in Megatron);
- ``moe``: the whole MoE layer (router, dispatch, experts, combine; its all-to-alls run again in backward);
- ``shared_experts``: an MoE layer's shared experts;
- ``moe_act``: the routed experts' activation. Our grouped experts always recompute it (the SwiGLU / squared
  ReLU output is never kept, see ``mcore.kernels.grouped_gemm``), so the name is accepted for Megatron recipes
  and changes nothing in the model.

Without a list (``None``), each part keeps its own selective default: attention recomputes its core, MLA its
up-projections and core, Mamba-2 its conv + SSD + norm.

Two forms:

- :func:`checkpoint_region` (``torch.utils.checkpoint``, non-reentrant): a region keeps only its inputs. Module
  buffers are restored after the recomputed forward, so that state a forward updates (the MoE layer's token counts
  for the aux-loss-free bias) counts each micro-batch once.
- :func:`discard_output`: a producer whose output is consumed right away (a norm, MLA's up-projections). The
  consumer would save that output, so checkpointing the producer alone saves nothing; instead the consumer runs
  under saved-tensor hooks that replace every saved tensor sharing the output's storage by a token, and backward
  rebuilds it by re-running the producer (once, without grad). The producer itself runs as a checkpointed region,
  so its own backward recomputes it once more: two cheap recomputes instead of Megatron's one, with stock autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "mlp", "moe", "shared_experts", "moe_act")
# what "selective" recomputes without a list (the parts' defaults before recompute_modules existed)
DEFAULT_SELECTIVE = frozenset({"core_attn", "mla_up_proj"})


def check_recompute_modules(modules: Iterable[str] | None, recompute: str | None, where: str) -> tuple | None:
    """``modules`` as a tuple (``None`` stays ``None``); one ``ValueError`` naming the valid names otherwise."""
    if modules is None:
        return None
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"{where}: recompute_modules must be a list of names from {list(RECOMPUTE_MODULES)}")
    modules = tuple(modules)
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"{where}: unknown recompute_modules {unknown}; valid names: {list(RECOMPUTE_MODULES)}")
    if len(set(modules)) != len(modules):
        raise ValueError(f"{where}: recompute_modules lists a name twice: {list(modules)}")
    if recompute != "selective":
        raise ValueError(
            f"{where}: recompute_modules {list(modules)} needs recompute 'selective' (got {recompute!r}); full "
            "recompute already recomputes every module"
        )
    return modules


def recomputes(recompute: str | None, modules: frozenset[str] | tuple | None, name: str) -> bool:
    """Whether module ``name`` is recomputed under ``recompute`` / ``modules`` (see the module doc)."""
    if recompute != "selective":
        return False
    return name in (DEFAULT_SELECTIVE if modules is None else modules)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module | None) -> Iterator[None]:
    if module is None:
        yield
        return
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def checkpoint_region(fn: Callable, *args: Any, state: nn.Module | None = None) -> Any:
    """``fn(*args)`` keeping only ``args`` for backward; ``state``'s buffers are put back after the recompute."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(
        fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), _buffers_restored(state))
    )


class _Rebuilt:
    """The producer's outputs, rebuilt on the first unpack and dropped once every token was unpacked.

    The producer's inputs are held as the hooks active outside pack them (``outer``): held directly, an input
    that is itself a discarded output (a norm's, feeding MLA) or an offloaded activation would stay in memory."""

    def __init__(self, producer: Callable, args: tuple, layouts: list, outer: tuple[Callable, Callable]) -> None:
        self.producer, self.layouts, self.unpack = producer, layouts, outer[1]
        self.tensor_args = [isinstance(a, torch.Tensor) for a in args]
        self.args = tuple(outer[0](a.detach()) if t else a for a, t in zip(args, self.tensor_args))
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.pending = 0

    def get(self, index: int) -> torch.Tensor:
        if self.outputs is None:
            args = tuple(self.unpack(a) if t else a for a, t in zip(self.args, self.tensor_args))
            with torch.no_grad():
                self.outputs = _as_tuple(self.producer(*args))
            got = [(o.shape, o.stride(), o.storage_offset()) for o in self.outputs]
            if got != self.layouts:
                raise RuntimeError(f"discard_output: the recomputed outputs' layout {got} differs from {self.layouts}")
        out = self.outputs[index]
        self.pending -= 1
        if self.pending <= 0:
            self.outputs = None
        return out


@dataclass(frozen=True)
class _Token:
    """What is saved in place of a view of a discarded output: its producer's holder and the view's geometry."""

    holder: _Rebuilt
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _identity(t: Any) -> Any:
    return t


def _outer_hooks() -> tuple[Callable, Callable]:
    """The saved-tensor hooks active around this call (identity when none)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    return (hooks[0], hooks[1]) if hooks else (_identity, _identity)


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def discard_output(producer: Callable, args: tuple, consumer: Callable) -> Any:
    """``consumer(*producer(*args))`` with ``producer``'s outputs not kept for backward (see the module doc).

    ``producer`` returns a tensor or a tuple of tensors on distinct storages (views are fine: a deterministic
    producer rebuilds the same layout, which :meth:`_Rebuilt.get` checks)."""
    if not torch.is_grad_enabled():
        return consumer(*_as_tuple(producer(*args)))
    outputs = _as_tuple(checkpoint_region(producer, *args))
    keys = [(out.untyped_storage().data_ptr(), out.dtype) for out in outputs]
    offsets = [out.storage_offset() for out in outputs]  # ints: the hooks must not keep the outputs alive
    if len(set(keys)) != len(keys):
        raise ValueError("discard_output: the producer's outputs must not share storage (return separate tensors)")
    # tensors we keep go through the hooks active outside (activation offload, a saved-bytes counter, an enclosing
    # discard_output), which the innermost hooks would otherwise hide
    outer_pack, outer_unpack = _outer_hooks()
    layouts = [(out.shape, out.stride(), out.storage_offset()) for out in outputs]
    rebuilt = _Rebuilt(producer, args, layouts, (outer_pack, outer_unpack))

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.dtype) if t.layout == torch.strided else None
        if key in keys:
            rebuilt.pending += 1
            index = keys.index(key)
            return _Token(rebuilt, index, t.shape, t.stride(), t.storage_offset() - offsets[index])
        return outer_pack(t)

    def unpack(packed):
        if not isinstance(packed, _Token):
            return outer_unpack(packed)
        out = packed.holder.get(packed.index)
        return out.as_strided(packed.size, packed.stride, out.storage_offset() + packed.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(*outputs)
