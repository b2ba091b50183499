"""Data parallelism with gradient reduction overlapped with backward.

``DistributedDataParallel`` keeps every gradient in contiguous buffers (``param.main_grad``) of ``grad_dtype``
(fp32; bf16 halves their memory and the reduction's bytes: Megatron's ``--main-grads-dtype``), split into buckets
(see ``grad_buffer``). A post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and
frees ``param.grad``; when a bucket's last gradient arrives its collective starts asynchronously
(``overlap_grad_reduce``), while autograd keeps computing the gradients of earlier layers. Gradients are
averaged over ``dp_group`` (pass the dp x cp group under context parallelism).

Gradient-accumulation fusion (``gradient_accumulation_fusion``, on by default, Megatron's option of that name):
the tensor-parallel linears compute their weight gradient with a GEMM that writes ``main_grad`` (in its dtype)
directly: it overwrites on a step's first micro-batch (beta 0, the region not zero-filled before) and accumulates
on later ones, instead of materializing a bf16 gradient that the hook then adds (a full extra pass over every
weight gradient, ~5% of a step on an H200 for an 8B-layer shape). Other parameters go through the hook.

Gradient accumulation: run the backward of every micro-batch but the last inside ``no_sync()``; the
gradients add up in ``main_grad`` and are reduced once. Then ``finish_grad_sync()`` (or
``finalize_model_grads``) waits for the collectives.

With ``use_distributed_optimizer`` the buckets are reduce-scattered (each dp rank owns one contiguous
shard of each) and ``start_param_sync()`` all-gathers the updated parameters after the optimizer step;
with ``overlap_param_gather`` those gathers run asynchronously and each submodule waits for its
bucket in a forward pre-hook.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mcore.parallel.comm import group_rank, group_size
from mcore.parallel.fp8_param_gather import Fp8GatherBuffer, fp8_gathered_layers
from mcore.parallel.grad_buffer import GradBuffer
from mcore.parallel.param_attrs import (
    attach_gradient_plumbing,
    main_grad,
    mark_main_grad_zeroed,
    take_main_grad_unfilled,
    take_wgrad_in_main_grad,
    wgrad_overwrites_main_grad,
)

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``dp_group`` (``None``: one rank; buffers still used).

    ``overlap_param_gather`` (only with ``use_distributed_optimizer``) and ``gradient_accumulation_fusion`` are
    additions to the contract's signature. Wrap the model before building its optimizer: with the distributed
    optimizer the parameters' storage moves into the flat parameter buffer. ``expert_dp_group``: the group over
    which parameters flagged ``expert_parallel`` are reduced (``groups.expert_dp``); the default ``"dense"``
    reduces them with the rest, which is right only when ep = etp = 1. ``skip_overwritten_fill`` (default on):
    ``zero_grad_buffer`` does not zero-fill the ``main_grad`` of parameters whose first weight gradient of a step
    overwrites it (the tensor-parallel linears' and the experts' GEMMs: ``param_attrs.take_wgrad_target``), one
    pass over most of the gradient memory less per step, the rest zeroed in one multi-tensor launch; off, every
    gradient is zero-filled (the results are the same bit for bit). ``fp8_param_gather`` (with
    ``use_distributed_optimizer``; the model's fp8 recipe installed first: tensor-wise, delayed or block-wise): the fp8
    linears' weights are all-gathered as their fp8 casts, 1 byte per element (``fp8_param_gather.py``); their
    bf16 values are then complete only after ``finish_param_sync()``, and ``params_replaced()`` must follow any
    write of the parameters outside the optimizer.
    """

    def __init__(
        self,
        module: nn.Module,
        dp_group: dist.ProcessGroup | None,
        *,
        bucket_size: int = 40_000_000,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        overlap_param_gather: bool = False,
        gradient_accumulation_fusion: bool = True,
        expert_dp_group: dist.ProcessGroup | None | str = "dense",
        skip_overwritten_fill: bool = True,
        fp8_param_gather: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(
                f"DistributedDataParallel: bucket_size must be a positive int (elements), got {bucket_size!r}"
            )
        if not isinstance(grad_dtype, torch.dtype) or not grad_dtype.is_floating_point:
            raise TypeError(f"DistributedDataParallel: grad_dtype must be a floating torch.dtype, got {grad_dtype!r}")
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError(
                "DistributedDataParallel: overlap_param_gather=True needs use_distributed_optimizer=True "
                "(only the distributed optimizer all-gathers parameters)"
            )
        if fp8_param_gather and not use_distributed_optimizer:
            raise ValueError(
                "DistributedDataParallel: fp8_param_gather=True needs use_distributed_optimizer=True (it all-gathers "
                "the fp8 casts of the parameter shards the distributed optimizer updates)"
            )
        self.module = module
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        self.skip_overwritten_fill = bool(skip_overwritten_fill)
        self._sync_enabled = True

        # No parameter is allowed: an empty virtual pipeline stage (a chunk without layers, which a balanced
        # layout gives when the output layer outweighs the layers) only forwards activations; it gets no buffer.
        params = [p for p in module.parameters() if p.requires_grad]
        # Expert parameters (``expert_parallel``, see expert_parallel.py) get their own buffers, reduced over
        # ``expert_dp_group`` and scaled by 1 / dense dp size; "dense" treats them like the rest (ep = etp = 1).
        separate_experts = not (isinstance(expert_dp_group, str) and expert_dp_group == "dense")
        # fp8 linears' weights gather their fp8 casts (fp8_param_gather.py): a buffer of their own
        fp8_layers = fp8_gathered_layers(module) if fp8_param_gather else {}
        by_key: dict[tuple[torch.dtype, torch.device, bool, bool], list[nn.Parameter]] = {}
        for p in reversed(params):  # backward order
            expert = separate_experts and getattr(p, "expert_parallel", False)
            by_key.setdefault((p.dtype, p.device, expert, p in fp8_layers), []).append(p)
        self._grad_buffers: list[GradBuffer] = []
        for (_, _, expert, fp8), group in by_key.items():
            common = {"dp_group": expert_dp_group if expert else dp_group, "bucket_size": bucket_size}
            common |= {"grad_dtype": grad_dtype, "grad_scale": 1.0 / self.dp_size if expert else None}
            if fp8:
                self._grad_buffers.append(Fp8GatherBuffer(group, layers=fp8_layers, **common))
            else:
                self._grad_buffers.append(
                    GradBuffer(group, use_distributed_optimizer=use_distributed_optimizer, **common)
                )
        self._buffer_of = {p: buf for buf in self._grad_buffers for p in buf.ranges}

        self._hook_handles = []
        for p in params:
            hook = self._make_grad_hook()
            # WeightGradStore calls the hook after a deferred weight gradient; the tensor-parallel linears
            # accumulate weight gradients into main_grad in the GEMM for as long as this wrapper lives (a module
            # trained on after its wrapper is gone gets its gradients in .grad again, not in an orphaned buffer)
            attach_gradient_plumbing(p, owner=self, grad_ready_hook=hook, fuse_wgrad=gradient_accumulation_fusion)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        if overlap_param_gather:
            for sub in module.modules():
                if any(p in self._buffer_of for p in sub.parameters(recurse=False)):
                    self._hook_handles.append(sub.register_forward_pre_hook(self._wait_for_params))

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        """The flat buffers, one per parameter dtype (read by the optimizer)."""
        return self._grad_buffers

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _make_grad_hook(self):
        # The hook lives in the parameter's C++ hook list, which Python's garbage collector cannot see: a closure
        # holding the wrapper (or the parameter) strongly would make an uncollectable cycle and keep the model
        # and its gradient buffers alive after the last reference to them is gone.
        wrapper = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            ddp = wrapper()
            if ddp is None:
                return
            # autograd calls this once per backward even when p.grad stayed empty: a deferred weight gradient
            # (WeightGradStore; the parameter is ready only once it has been computed) or one the linear layer
            # accumulated straight into main_grad (then it said so, see param_attrs). A parameter used by such a
            # linear and elsewhere (tied embeddings) gets both: the rest arrives in p.grad.
            fused = take_wgrad_in_main_grad(p, grad_arrived=p.grad is not None)
            if p.grad is None and not fused:
                return
            if p.grad is not None:
                if take_main_grad_unfilled(p):  # zero_grad_buffer left it stale for an overwrite that did not come
                    main_grad(p).zero_()
                main_grad(p).add_(p.grad)
                p.grad = None
            if ddp._sync_enabled and ddp.overlap_grad_reduce:
                ddp._buffer_of[p].mark_ready(p)

        return hook

    def _wait_for_params(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=False):
            buf = self._buffer_of.get(p)
            if buf is not None:
                buf.wait_param_gather(buf.bucket_of[p])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (every micro-batch but the last)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Wait until every bucket is reduced (issuing those not issued yet): ``main_grad`` then holds the
        average over the dp group (with the distributed optimizer: in this rank's shard of each bucket)."""
        for buf in self._grad_buffers:
            buf.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero ``main_grad`` (and ``param.grad``) before the next step's first micro-batch; with
        ``skip_overwritten_fill``, the regions of parameters whose first weight gradient overwrites are left
        unfilled (``GradBuffer.zero``: whatever would read them zeroes them first)."""
        for buf in self._grad_buffers:
            unfilled = [p for p in buf.ranges if wgrad_overwrites_main_grad(p)] if self.skip_overwritten_fill else []
            buf.zero(unfilled)
            left = {id(p) for p in unfilled}  # marked by zero()
            for p in buf.ranges:
                p.grad = None
                if id(p) not in left:
                    mark_main_grad_zeroed(p)  # the expert GEMMs' first weight gradient writes it, not adds to it

    def launched_buckets(self) -> int:
        """Buckets whose collective has been issued in the current step (all buffers)."""
        return sum(buf.launched_buckets() for buf in self._grad_buffers)

    def num_buckets(self) -> int:
        return sum(len(buf.buckets) for buf in self._grad_buffers)

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather the parameter shards updated by the distributed optimizer. Asynchronous with
        ``overlap_param_gather`` (the next forward waits per bucket) unless ``force_sync``."""
        for buf in self._grad_buffers:
            buf.start_param_gather()
        if force_sync or not self.overlap_param_gather:
            for buf in self._grad_buffers:
                buf.finish_param_gather()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather in flight (before reading parameters outside forward); with
        ``fp8_param_gather`` also all-gather the fp8 linears' weights in their own dtype (collective over dp)."""
        for buf in self._grad_buffers:
            buf.finish_param_gather()
            if isinstance(buf, Fp8GatherBuffer):
                buf.gather_high_precision()

    def params_replaced(self) -> None:
        """Say that the parameters were written whole on every rank outside the optimizer (a loaded checkpoint):
        with ``fp8_param_gather`` the fp8 copies of the old values are dropped and cast afresh at their next use."""
        for buf in self._grad_buffers:
            if isinstance(buf, Fp8GatherBuffer):
                buf.params_replaced()

    # Parameter names and state dicts are the wrapped module's: no "module." prefix.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError(
                "DistributedDataParallel.load_state_dict: assign=True would detach the parameters from the buffers"
            )
        self.finish_param_sync()
        result = self.module.load_state_dict(state_dict, strict=strict)
        self.params_replaced()
        return result
