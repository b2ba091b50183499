"""Tensor-parallel layers: column- and row-parallel linears and a vocab-parallel embedding.

Layouts (``tp`` = size of ``tp_group``; ``None`` means tp = 1 and the layers are plain layers):

* ``ColumnParallelLinear``: weight ``[out/tp, in]``; input ``[..., in]`` (with sequence parallelism
  ``[s/tp, b, in]``, all-gathered along dim 0); output ``[..., out/tp]`` or, with ``gather_output``,
  ``[..., out]``.
* ``RowParallelLinear``: weight ``[out, in/tp]``; input ``[..., in/tp]``; output ``[..., out]`` summed over
  TP (with sequence parallelism reduce-scattered to ``[s/tp, b, out]``).
* ``VocabParallelEmbedding``: weight ``[V/tp, h]`` (rows ``[r*V/tp, (r+1)*V/tp)`` on rank ``r``); ids of any
  shape -> ``ids.shape + (h,)`` (with sequence parallelism feed ``[s, b]`` ids, get ``[s/tp, b, h]``).

Each module's ``reset_parameters(generator)`` draws the full weight with ``init_method(full, generator)``
and keeps its slice, so a seed gives the same full weights at any tp. The parameter attributes of
docs/architecture.md (``tensor_parallel``, ``partition_dim``, ``partition_blocks``, ``sequence_parallel``,
``vocab_padded_dim``, ``vocab_size``) are set on every parameter created here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore.kernels.low_precision_linear import LowPrecisionLinear
from mcore.parallel.comm import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    group_rank,
    group_size,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from mcore.parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.parallel.embedding_lookup import embedding_lookup
from mcore.parallel.init import InitMethod, normal_init, partition_slice
from mcore.parallel.param_attrs import (
    mark_vocab_padded,
    mark_wgrad_in_main_grad,
    set_tensor_parallel_attributes,
    take_wgrad_target,
)
from mcore.parallel.random import RNGStatesTracker, get_rng_tracker
from mcore.parallel.weight_grad_store import DefersWeightGrads, WeightGradStore, attach_weight_grad_store

__all__ = [
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "WeightGradStore",
    "attach_weight_grad_store",
    "get_rng_tracker",
    "set_tensor_parallel_attributes",
    "vocab_parallel_cross_entropy",
]


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp != 0:
        raise ValueError(f"{what}={n} not divisible by the tensor-parallel size {tp}; pad it to a multiple of {tp}")
    return n // tp


def _full_tensor(shape: tuple[int, ...], init_method: InitMethod, generator: torch.Generator | None) -> torch.Tensor:
    # drawn in fp32 on the generator's device, so the weights do not depend on params_dtype or device
    full = torch.empty(shape, dtype=torch.float32, device=generator.device if generator is not None else "cpu")
    init_method(full, generator)
    return full


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


# Whether this torch's CUDA addmm can write fp32 results from bf16/fp16 operands (``out_dtype``, torch >= 2.8);
# found out on first use, then remembered.
_MIXED_DTYPE_ADDMM: bool | None = None


def accumulate_weight_grad_(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += grad_out^T @ x`` with ``grad_out [n, out]`` and ``x [n, in]``, accumulated in ``main_grad``'s
    precision by the GEMM itself (gradient-accumulation fusion: no low-precision weight gradient is materialized
    and no separate add pass reads it back)."""
    global _MIXED_DTYPE_ADDMM
    a, b = grad_out.t(), x
    if main_grad.dtype == a.dtype:
        main_grad.addmm_(a, b)
        return
    if main_grad.is_cuda and _MIXED_DTYPE_ADDMM is not False:
        try:
            torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
            _MIXED_DTYPE_ADDMM = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MIXED_DTYPE_ADDMM = False  # older torch: fall through to the unfused form
    main_grad.add_(a.matmul(b))


# how a bf16 GEMM writes (beta 0) an fp32 target on CUDA: "mm" (mm(out_dtype=)), "addmm" (addmm(beta=0,
# out_dtype=)), "unfused" (neither exists in this torch: a bf16 GEMM then a copy), None: not tried yet
_MIXED_DTYPE_WRITE: str | None = None


def write_weight_grad_(target: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """``target = grad_out^T @ x`` in ``target``'s precision by the GEMM itself; ``target`` is not read (beta 0), so
    it may hold anything (a step's first weight gradient: DDP then need not zero-fill it, nor the GEMM read it)."""
    global _MIXED_DTYPE_WRITE
    a, b = grad_out.t(), x
    if target.dtype == a.dtype:
        torch.mm(a, b, out=target)
        return
    if target.is_cuda and _MIXED_DTYPE_WRITE != "unfused":
        for name in (_MIXED_DTYPE_WRITE,) if _MIXED_DTYPE_WRITE else ("mm", "addmm"):
            try:
                if name == "mm":
                    torch.mm(a, b, out_dtype=target.dtype, out=target)
                else:  # beta 0: cuBLAS does not read the output (NaN in it is not propagated)
                    torch.addmm(target, a, b, beta=0, out_dtype=target.dtype, out=target)
                _MIXED_DTYPE_WRITE = name
                return
            except (RuntimeError, TypeError, NotImplementedError):
                continue
        _MIXED_DTYPE_WRITE = "unfused"  # older torch: the unfused form from now on
    target.copy_(a.matmul(b))


def _weight_grad(param: nn.Parameter, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient, or ``None`` when it went straight into ``param.main_grad``.

    While the ``DistributedDataParallel`` wrapper of ``param`` lives (:func:`~mcore.parallel.param_attrs.
    take_wgrad_target`) the GEMM writes the fp32 ``main_grad`` itself and tells DDP's gradient hook (which autograd
    still calls, with ``param.grad`` left empty) that the gradient is there. The step's first weight gradient of
    ``param`` overwrites (beta 0: DDP's ``zero_grad_buffer`` then leaves that region unfilled, and the GEMM does not
    read it: on the 8b4l shape 7.7 GB of fill and 7.7 GB of reads per step); later ones (micro-batches, a weight
    used twice) accumulate.
    """
    target, overwrite = take_wgrad_target(param)
    if target is not None:
        (write_weight_grad_ if overwrite else accumulate_weight_grad_)(target, grad_out, x)
        mark_wgrad_in_main_grad(param)
        return None
    return grad_out.t().matmul(x)


class _LinearWithDeferrableWeightGrad(torch.autograd.Function):
    """``F.linear`` whose weight gradient is queued in the layer's ``WeightGradStore`` while that is deferring,
    and accumulated straight into ``main_grad`` for parameters of a ``DistributedDataParallel``
    (see ``_weight_grad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the Parameter itself: a deferred gradient is accumulated into its .grad
        ctx.has_bias = bias is not None
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)
        if ctx.needs_input_grad[1]:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            param = ctx.param
            store = ctx.store
            if store is not None and store.is_deferring():
                store.put(param, lambda: _weight_grad(param, g2, x2))
            else:
                grad_w = _weight_grad(param, g2, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None, low_precision=None
) -> torch.Tensor:
    if low_precision is not None:  # an FP8/FP4 linear installed by mcore.parallel.low_precision
        if store is not None and isinstance(low_precision, LowPrecisionLinear):  # TE's linears cannot defer
            return low_precision(x, weight, bias, defer=store.defer)
        return low_precision(x, weight, bias)
    return _LinearWithDeferrableWeightGrad.apply(x, weight, bias, store)


def _check_last_dim(x: torch.Tensor, expected: int, layer: str, hint: str) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{layer}: expected input [..., {expected}] ({hint}), got shape {tuple(x.shape)}")


class ColumnParallelLinear(DefersWeightGrads, nn.Module):
    """``y = x W^T + b`` with ``W`` split along its output rows over the TP group.

    ``partition_blocks`` describes a fused weight (e.g. ``(intermediate, intermediate)`` for ``[gate; up]``):
    each block is split separately, so rank ``r`` holds ``[gate_r; up_r]``. With ``gather_output`` the
    output is all-gathered and put back into the full layout (blocks in order).
    """

    low_precision = None  # set by mcore.parallel.low_precision.enable_low_precision

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_blocks: Sequence[int] | None = None,
        init_method: InitMethod | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _positive_int(in_features, "ColumnParallelLinear in_features")
        self.out_features = _positive_int(out_features, "ColumnParallelLinear out_features")
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.init_method = init_method or normal_init(0.02)
        # set by attach_weight_grad_store (a zero-bubble schedule's queue of deferred weight gradients)
        self.weight_grad_store: WeightGradStore | None = None
        blocks = None if partition_blocks is None else tuple(int(b) for b in partition_blocks)
        if blocks is not None and sum(blocks) != out_features:
            raise ValueError(
                f"ColumnParallelLinear: partition_blocks {blocks} sum to {sum(blocks)}, expected out_features "
                f"{out_features}"
            )
        for b in blocks or (out_features,):
            _divide(b, self.tp_size, "ColumnParallelLinear output block size" if blocks else "out_features")
        self.partition_blocks = blocks
        self.local_out_features = out_features // self.tp_size

        self.weight = nn.Parameter(torch.empty(self.local_out_features, in_features, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.weight, tensor_parallel=True, partition_dim=0, partition_blocks=blocks)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.local_out_features, dtype=params_dtype, device=device))
            set_tensor_parallel_attributes(self.bias, tensor_parallel=True, partition_dim=0, partition_blocks=blocks)
        else:
            self.register_parameter("bias", None)
        if not _is_meta(device):
            self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``[out, in]`` weight and keep this rank's rows; zero the bias."""
        full = _full_tensor((self.out_features, self.in_features), self.init_method, generator)
        with torch.no_grad():
            self.weight.copy_(partition_slice(full, 0, self.tp_rank, self.tp_size, self.partition_blocks))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.in_features, "ColumnParallelLinear", "in_features")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tp_region(x, self.tp_group)
        y = _linear(x, self.weight, self.bias, self.weight_grad_store, self.low_precision)
        if not self.gather_output or self.tp_size == 1:
            return y
        y = gather_from_tp_region(y, self.tp_group)
        if self.partition_blocks is not None and len(self.partition_blocks) > 1:
            # gathered as [b0_r0, b1_r0, b0_r1, b1_r1, ...]; the full layout is [b0_r0, b0_r1, ..., b1_r0, ...]
            per_rank = y.split(self.local_out_features, dim=-1)
            local_blocks = [b // self.tp_size for b in self.partition_blocks]
            split = [chunk.split(local_blocks, dim=-1) for chunk in per_rank]
            y = torch.cat([split[r][i] for i in range(len(local_blocks)) for r in range(self.tp_size)], dim=-1)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, partition_blocks={self.partition_blocks}"
        )


class RowParallelLinear(DefersWeightGrads, nn.Module):
    """``y = x W^T + b`` with ``W`` split along its input columns over the TP group; the output is summed
    over TP (reduce-scattered along dim 0 with sequence parallelism). The bias is replicated and added
    after the reduction; under sequence parallelism it sees a sequence shard, so it carries
    ``sequence_parallel=True`` and ``finalize_model_grads`` all-reduces its gradient over TP."""

    low_precision = None  # set by mcore.parallel.low_precision.enable_low_precision

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _positive_int(in_features, "RowParallelLinear in_features")
        self.out_features = _positive_int(out_features, "RowParallelLinear out_features")
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(the input must already be split along its last dim)"
            )
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.init_method = init_method or normal_init(0.02)
        self.weight_grad_store: WeightGradStore | None = None  # see attach_weight_grad_store
        self.local_in_features = _divide(in_features, self.tp_size, "RowParallelLinear in_features")

        self.weight = nn.Parameter(torch.empty(out_features, self.local_in_features, dtype=params_dtype, device=device))
        set_tensor_parallel_attributes(self.weight, tensor_parallel=True, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device))
            set_tensor_parallel_attributes(self.bias, tensor_parallel=False, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)
        if not _is_meta(device):
            self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``[out, in]`` weight and keep this rank's columns; zero the bias."""
        full = _full_tensor((self.out_features, self.in_features), self.init_method, generator)
        with torch.no_grad():
            self.weight.copy_(partition_slice(full, 1, self.tp_rank, self.tp_size))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            _check_last_dim(x, self.local_in_features, "RowParallelLinear", "in_features / tp, input_is_parallel")
        else:
            _check_last_dim(x, self.in_features, "RowParallelLinear", "in_features, input_is_parallel=False")
            x = scatter_to_tp_region(x, self.tp_group)
        y = _linear(x, self.weight, None, self.weight_grad_store, self.low_precision)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary over the TP group.

    Each rank looks up the ids in its row range (others give zeros) and the partial results are summed
    over TP (reduce-scattered along dim 0 with sequence parallelism). Under DDP the weight gradient is added
    into ``main_grad`` at the looked-up rows only (``embedding_lookup``). ``vocab_size`` (default
    ``num_embeddings``) marks rows at or beyond it as padding (``weight.vocab_size``); this keyword is an
    addition to the contract's signature.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = _positive_int(num_embeddings, "VocabParallelEmbedding num_embeddings")
        self.embedding_dim = _positive_int(embedding_dim, "VocabParallelEmbedding embedding_dim")
        if vocab_size is not None and not 1 <= vocab_size <= num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding: vocab_size must be in [1, num_embeddings={num_embeddings}], got {vocab_size}"
            )
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        self.init_method = init_method or normal_init(0.02)
        self.local_num_embeddings = _divide(num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings")
        self.vocab_start_index = self.tp_rank * self.local_num_embeddings
        self.vocab_end_index = self.vocab_start_index + self.local_num_embeddings

        self.weight = nn.Parameter(
            torch.empty(self.local_num_embeddings, embedding_dim, dtype=params_dtype, device=device)
        )
        set_tensor_parallel_attributes(self.weight, tensor_parallel=True, partition_dim=0)
        mark_vocab_padded(self.weight, 0, num_embeddings if vocab_size is None else vocab_size)
        if not _is_meta(device):
            self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the full ``[num_embeddings, h]`` table and keep this rank's rows."""
        full = _full_tensor((self.num_embeddings, self.embedding_dim), self.init_method, generator)
        with torch.no_grad():
            self.weight.copy_(partition_slice(full, 0, self.tp_rank, self.tp_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"VocabParallelEmbedding: expected integer token ids, got dtype {ids.dtype}")
        if self.tp_size == 1:
            out = embedding_lookup(ids, self.weight)
        else:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = embedding_lookup(local, self.weight, outside)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
