"""The attributes mcore puts on parameters, and the one place that reads and writes them.

Parallel layers, DDP, the optimizer, gradient clipping, checkpoints and the bridge pass facts about a parameter
along on the parameter itself, as Megatron-Core does: the tensor is what every one of them holds. Those facts are
plain attributes (so ``torch.nn.Parameter`` keeps working everywhere), but only this module names them; the
others call the typed helpers below. ``docs/architecture.md`` lists them with who sets and who reads each.

Layout (set when the parameter is created; read by grad clipping, finalize, checkpoints and the bridge):

- ``tensor_parallel`` / ``partition_dim`` / ``partition_blocks``: the tensor is this TP rank's slice along
  ``partition_dim``; ``partition_blocks`` (full sizes) when the dimension concatenates blocks (fused QKV,
  gate/up) that are split block by block. :func:`set_tensor_parallel_attributes`, :func:`tp_split`.
- ``sequence_parallel``: replicated over TP but fed sequence-parallel activations, so its gradient is a partial
  sum to all-reduce over TP (norm weights, row-parallel biases). :func:`is_sequence_parallel`.
- ``shared_embedding``: one of the copies of a tied embedding that live on the first and last pipeline stage;
  their gradients are summed. :func:`mark_shared_embedding`, :func:`is_shared_embedding`.
- ``vocab_padded_dim`` / ``vocab_size``: dimension padded to the padded vocabulary and the real vocabulary
  size (rows past it are padding that checkpoints drop). :func:`mark_vocab_padded`, :func:`vocab_padding`.
- ``mcore_fp32_compute``: the model computes with this parameter in fp32 whatever the run's compute dtype (Mamba-2's
  ``A_log``, ``D``, ``dt_bias``); FSDP2's mixed precision then gathers it in fp32 (``fsdp``).
  :func:`mark_fp32_compute`, :func:`computes_in_fp32`.

Gradient plumbing (set by ``DistributedDataParallel`` while it wraps the module):

- ``main_grad``: the view into DDP's gradient buffer (fp32, or bf16 with ``grad_dtype``) that gradients
  accumulate into. :func:`main_grad`, :func:`set_main_grad`, :func:`accumulated_grad`.
- ``mcore_fuse_wgrad``: a weak reference to the DDP wrapper when weight-gradient GEMMs may accumulate straight
  into ``main_grad``; ``mcore_wgrad_in_main_grad``: the GEMM did so this backward (so DDP must not add
  ``.grad`` again). :func:`fused_wgrad_target`, :func:`take_wgrad_in_main_grad`.
- ``mcore_grad_ready_hook``: what ``WeightGradStore`` calls once a deferred weight gradient is in place.
  :func:`grad_ready_hook`.
- ``mcore_wgrad_buffer`` (set by ``FullyShardedDataParallel`` at one rank on the gathered parameters): where a
  weight-gradient GEMM accumulates when the parameter has no ``main_grad``: a function giving the fp32 gradient of
  the shard, allocated at its first use. :func:`attach_wgrad_buffer`.
- ``mcore_main_grad_zeroed``: ``main_grad`` holds nothing of this step yet (DDP zeroed it, and no gradient came
  since), so a weight-gradient GEMM may write it instead of adding to it (``beta = 0``: it is not read).
  :func:`mark_main_grad_zeroed` (DDP's ``zero_grad_buffer``), :func:`take_wgrad_target` (the GEMMs that can
  overwrite: the tensor-parallel linears', the experts' and the fp8 linears'); every other writer clears it
  (:func:`fused_wgrad_target`, DDP's gradient hook through :func:`take_wgrad_in_main_grad`), so a parameter
  written twice in one step accumulates the second time.
- ``mcore_wgrad_overwrites``: the first weight gradient of a step overwrote ``main_grad`` (:func:`take_wgrad_target`
  gave ``overwrite``), so DDP's next ``zero_grad_buffer`` leaves it unfilled: :func:`wgrad_overwrites_main_grad`.
  ``mcore_main_grad_unfilled``: ``main_grad`` holds stale values, not zeros (:func:`mark_main_grad_unfilled`); the
  first writer of the step that adds zeroes it first (:func:`fused_wgrad_target`, :func:`take_main_grad_unfilled`
  in DDP's hook), and DDP zeroes it before reducing a bucket if nothing wrote it (a step without its gradient).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "TensorParallelSplit",
    "accumulated_grad",
    "attach_gradient_plumbing",
    "attach_wgrad_buffer",
    "computes_in_fp32",
    "fused_wgrad_target",
    "grad_ready_hook",
    "is_sequence_parallel",
    "is_shared_embedding",
    "is_tensor_parallel",
    "main_grad",
    "mark_fp32_compute",
    "mark_main_grad_unfilled",
    "mark_sequence_parallel",
    "mark_shared_embedding",
    "mark_vocab_padded",
    "mark_main_grad_zeroed",
    "mark_wgrad_in_main_grad",
    "persistent_buffers",
    "set_main_grad",
    "set_tensor_parallel_attributes",
    "take_main_grad_unfilled",
    "take_wgrad_in_main_grad",
    "take_wgrad_target",
    "tp_split",
    "vocab_padding",
    "wgrad_overwrites_main_grad",
]

# The attribute names, in one place (other modules use the helpers, never the names).
_TENSOR_PARALLEL = "tensor_parallel"
_PARTITION_DIM = "partition_dim"
_PARTITION_BLOCKS = "partition_blocks"
_SEQUENCE_PARALLEL = "sequence_parallel"
_SHARED_EMBEDDING = "shared_embedding"
_VOCAB_PADDED_DIM = "vocab_padded_dim"
_VOCAB_SIZE = "vocab_size"
_FP32_COMPUTE = "mcore_fp32_compute"
_MAIN_GRAD = "main_grad"
_FUSE_WGRAD = "mcore_fuse_wgrad"
_WGRAD_IN_MAIN_GRAD = "mcore_wgrad_in_main_grad"
_GRAD_READY_HOOK = "mcore_grad_ready_hook"
_WGRAD_BUFFER = "mcore_wgrad_buffer"
_MAIN_GRAD_ZEROED = "mcore_main_grad_zeroed"
_MAIN_GRAD_UNFILLED = "mcore_main_grad_unfilled"
_WGRAD_OVERWRITES = "mcore_wgrad_overwrites"


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the buffers ``module.state_dict()`` holds (the MoE layers' aux-loss-free expert bias):
    model state that no optimizer updates, which checkpoints and the bridge save and load with the parameters.
    Replicated over every parallel group (no layout attributes)."""
    keys = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in keys]


# ------------------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class TensorParallelSplit:
    """How a tensor-parallel parameter is split: along ``dim``, block by block when ``blocks`` (full sizes)."""

    dim: int
    blocks: tuple[int, ...] | None = None


def set_tensor_parallel_attributes(
    param: torch.Tensor,
    *,
    tensor_parallel: bool,
    partition_dim: int | None = None,
    partition_blocks: Sequence[int] | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Set the layout attributes that DDP, the optimizer, grad clipping and checkpoints read."""
    if tensor_parallel and partition_dim is None:
        raise ValueError("set_tensor_parallel_attributes: a tensor-parallel parameter needs its partition_dim")
    setattr(param, _TENSOR_PARALLEL, tensor_parallel)
    setattr(param, _PARTITION_DIM, partition_dim)
    setattr(param, _PARTITION_BLOCKS, None if partition_blocks is None else tuple(int(b) for b in partition_blocks))
    setattr(param, _SEQUENCE_PARALLEL, sequence_parallel)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, _TENSOR_PARALLEL, False))


def tp_split(param: torch.Tensor) -> TensorParallelSplit | None:
    """How ``param`` is split over TP ranks, or ``None`` when every TP rank holds all of it."""
    if not is_tensor_parallel(param):
        return None
    blocks = getattr(param, _PARTITION_BLOCKS, None)
    return TensorParallelSplit(int(getattr(param, _PARTITION_DIM)), None if blocks is None else tuple(blocks))


def mark_sequence_parallel(param: torch.Tensor, sequence_parallel: bool) -> None:
    setattr(param, _SEQUENCE_PARALLEL, bool(sequence_parallel))


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, _SEQUENCE_PARALLEL, False))


def mark_shared_embedding(param: torch.Tensor, shared: bool) -> None:
    setattr(param, _SHARED_EMBEDDING, bool(shared))


def is_shared_embedding(param: torch.Tensor) -> bool:
    return bool(getattr(param, _SHARED_EMBEDDING, False))


def mark_fp32_compute(param: torch.Tensor) -> None:
    setattr(param, _FP32_COMPUTE, True)


def computes_in_fp32(param: torch.Tensor) -> bool:
    return bool(getattr(param, _FP32_COMPUTE, False))


def mark_vocab_padded(param: torch.Tensor, dim: int, vocab_size: int) -> None:
    """Dimension ``dim`` of ``param`` (whole, or this TP rank's slice) spans the padded vocabulary, of which the
    first ``vocab_size`` entries are real tokens."""
    setattr(param, _VOCAB_PADDED_DIM, int(dim))
    setattr(param, _VOCAB_SIZE, int(vocab_size))


def vocab_padding(param: torch.Tensor) -> tuple[int, int] | None:
    """``(dim, vocab_size)`` of a vocabulary-padded parameter, else ``None``."""
    dim = getattr(param, _VOCAB_PADDED_DIM, None)
    return None if dim is None else (int(dim), int(getattr(param, _VOCAB_SIZE)))


# ------------------------------------------------------------------------------------------------ gradients
def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 gradient-buffer view of ``param`` (``None`` when no DDP wrapper gave it one)."""
    return getattr(param, _MAIN_GRAD, None)


def set_main_grad(param: torch.Tensor, view: torch.Tensor) -> None:
    setattr(param, _MAIN_GRAD, view)


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient accumulates: ``main_grad`` under DDP, else ``.grad``."""
    buffer = main_grad(param)
    return buffer if buffer is not None else param.grad


def attach_gradient_plumbing(
    param: torch.Tensor, *, owner: object, grad_ready_hook: Callable[[torch.Tensor], None], fuse_wgrad: bool
) -> None:
    """What ``DistributedDataParallel`` (``owner``) hangs on each parameter it wraps: the hook a deferred weight
    gradient calls, and (``fuse_wgrad``) permission for weight-gradient GEMMs to write into ``main_grad``
    while the owner is alive (a weak reference, so a dropped wrapper turns the fusion off)."""
    setattr(param, _GRAD_READY_HOOK, grad_ready_hook)
    setattr(param, _FUSE_WGRAD, weakref.ref(owner) if fuse_wgrad else None)
    setattr(param, _WGRAD_IN_MAIN_GRAD, False)


def attach_wgrad_buffer(
    param: torch.Tensor, *, owner: object, buffer: Callable[[torch.Tensor, bool], tuple[torch.Tensor, bool]]
) -> None:
    """Let weight-gradient GEMMs write into ``buffer(param, zeroed)`` while ``owner`` is alive (a weak reference,
    as for DDP). ``buffer`` returns ``(tensor, fresh)``: a tensor of ``param``'s shape (fp32) and whether it was
    created by this call, i.e. holds nothing of this step yet; a tensor it creates is zero when ``zeroed``, else
    uninitialised (the caller then writes all of it)."""
    setattr(param, _FUSE_WGRAD, weakref.ref(owner))
    setattr(param, _WGRAD_BUFFER, buffer)


def _wgrad_target(param: torch.Tensor, zeroed: bool) -> tuple[torch.Tensor | None, bool]:
    owner = getattr(param, _FUSE_WGRAD, None)
    if owner is None or owner() is None:
        return None, False
    buffer = main_grad(param)
    if buffer is not None:
        unfilled = take_main_grad_unfilled(param)
        fresh = unfilled or bool(getattr(param, _MAIN_GRAD_ZEROED, False))
        setattr(param, _MAIN_GRAD_ZEROED, False)  # whatever the caller does next, it writes main_grad
        if unfilled and zeroed:  # the caller adds: it needs the zeros that zero_grad_buffer left out
            buffer.zero_()
        if fresh and not zeroed:  # the caller overwrites: the next zero_grad_buffer may leave main_grad unfilled
            setattr(param, _WGRAD_OVERWRITES, True)
        return buffer, fresh
    attached = getattr(param, _WGRAD_BUFFER, None)
    if attached is None:
        return None, False
    return attached(param, zeroed)


def fused_wgrad_target(param: torch.Tensor) -> torch.Tensor | None:
    """``main_grad`` (or the attached wgrad buffer) when a weight-gradient GEMM may accumulate into it now (the
    owning wrapper is alive), else ``None`` (the GEMM returns the gradient as usual). The caller adds to it."""
    return _wgrad_target(param, zeroed=True)[0]


def take_wgrad_target(param: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``(target, overwrite)``: the target of :func:`fused_wgrad_target` (``None``: return the gradient as usual)
    and whether it holds nothing of this step yet (the step's first weight gradient of ``param``). With
    ``overwrite`` the caller must write **every** element (zeros for experts without rows) instead of adding, and
    must not read the target (it may be uninitialised); the next caller in the step gets ``overwrite=False``."""
    return _wgrad_target(param, zeroed=False)


def mark_main_grad_zeroed(param: torch.Tensor) -> None:
    """``main_grad`` of ``param`` was just zeroed (the start of a step): its first weight-gradient GEMM may write it
    without reading it (:func:`take_wgrad_target`)."""
    setattr(param, _MAIN_GRAD_ZEROED, True)
    setattr(param, _MAIN_GRAD_UNFILLED, False)


def wgrad_overwrites_main_grad(param: torch.Tensor) -> bool:
    """Whether a step's first weight gradient of ``param`` has overwritten ``main_grad`` (:func:`take_wgrad_target`
    gave ``overwrite``): DDP then skips zero-filling it (a step whose first writer adds still gets zeros, see
    :func:`mark_main_grad_unfilled`)."""
    return bool(getattr(param, _WGRAD_OVERWRITES, False))


def mark_main_grad_unfilled(param: torch.Tensor) -> None:
    """``main_grad`` of ``param`` holds nothing of this step and was **not** zeroed (stale values): a writer that
    overwrites writes it as is, one that adds must zero it first (:func:`take_main_grad_unfilled`)."""
    setattr(param, _MAIN_GRAD_ZEROED, True)
    setattr(param, _MAIN_GRAD_UNFILLED, True)


def take_main_grad_unfilled(param: torch.Tensor) -> bool:
    """Whether ``main_grad`` is still unfilled (:func:`mark_main_grad_unfilled`); clears the mark: the caller
    zeroes or overwrites it now."""
    unfilled = bool(getattr(param, _MAIN_GRAD_UNFILLED, False))
    if unfilled:
        setattr(param, _MAIN_GRAD_UNFILLED, False)
    return unfilled


def mark_wgrad_in_main_grad(param: torch.Tensor) -> None:
    """The weight gradient of this backward is already in ``main_grad``."""
    setattr(param, _WGRAD_IN_MAIN_GRAD, True)


def take_wgrad_in_main_grad(param: torch.Tensor, *, grad_arrived: bool = True) -> bool:
    """Whether this backward's weight gradient went into ``main_grad``; resets the flag for the next one. DDP's
    gradient hook calls it after every backward of ``param``, which may then add ``param.grad`` into ``main_grad``:
    from here on ``main_grad`` is no longer known to be zero. ``grad_arrived=False`` (``param.grad`` is empty):
    nothing will be added, so a zeroed ``main_grad`` stays known zero, and a weight gradient deferred into a
    ``WeightGradStore`` may still overwrite it as the step's first (as it would have undeferred)."""
    if grad_arrived:
        setattr(param, _MAIN_GRAD_ZEROED, False)
    fused = bool(getattr(param, _WGRAD_IN_MAIN_GRAD, False))
    if fused:
        setattr(param, _WGRAD_IN_MAIN_GRAD, False)
    return fused


def grad_ready_hook(param: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
    return getattr(param, _GRAD_READY_HOOK, None)
