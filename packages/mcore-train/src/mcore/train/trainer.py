"""The training step: model chunks of this rank, data parallelism, the pipeline schedule and the optimizer.

``Trainer(config, runtime).train_step(microbatches)`` runs one optimizer step over the micro-batches of this
data-parallel rank (``num_microbatches`` of them) and returns the loss and gradient norm as device
tensors, so nothing forces a host synchronization: the caller reads them when it logs. On CUDA the
default precision is bf16 parameters with fp32 master weights and fp32 gradient buffers; on CPU fp32.
The only per-step host synchronization is the optimizer's non-finite check, on when
``train.skip_nonfinite`` is (the default on CPU and with fp16; off by default on CUDA with bf16/fp32).

The real training step on mock data, as a benchmark runs it (one process, or one rank under torchrun)::

    config = load_config(None, ["model=llama3-8b", "model.num_hidden_layers=4", "data.mock=true",
                                "data.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=8"])
    runtime = init_runtime(config)
    trainer = Trainer(config, runtime)
    data = build_run_data(config)
    stream = microbatch_stream(data.train, config, consumed_samples=0,
                               dp_rank=runtime.groups.dp_rank, dp_size=runtime.groups.dp_size)
    for _ in range(steps):
        out = trainer.train_step([microbatch_to_device(next(stream), runtime.device)
                                  for _ in range(trainer.num_microbatches)])
    torch.cuda.synchronize(); print(out.loss.item())
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore.models.gpt import GPTModel
from mcore.models.stages import build_stage_chunks
from mcore.models.stages import pipeline_layout as stage_layout
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.distributed_optimizer import DistributedOptimizer
from mcore.parallel.expert_parallel import moe_metrics
from mcore.parallel.finalize import finalize_model_grads
from mcore.parallel.loss_scaler import DynamicLossScaler
from mcore.parallel.optimizer import MixedPrecisionOptimizer, StepResult, default_param_groups
from mcore.parallel.param_attrs import is_shared_embedding, persistent_buffers
from mcore.parallel.pipeline import (
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    PipelineSchedule,
    ZeroBubbleH1,
    p2p_activation_shape,
)
from mcore.parallel.sharded_optimizer import FullyShardedOptimizer
from mcore.train.checkpoint.model_weights import load_model_weights
from mcore.train.config import Config
from mcore.train.context_parallel import CPBatches
from mcore.train.errors import UserError
from mcore.train.low_precision import apply_low_precision, base_precision, weight_cast_cache
from mcore.train.runtime import Runtime

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# optim.main_grads_dtype / exp_avg_dtype / exp_avg_sq_dtype (the precision-aware optimizer)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCHEDULES: dict[str, type[PipelineSchedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
    "zero-bubble": ZeroBubbleH1,
}


def resolve_precision(config: Config, device: torch.device) -> str:
    """``train.precision`` with ``auto`` resolved: bf16 on CUDA, fp32 elsewhere."""
    if config.train.precision != "auto":
        return config.train.precision
    return "bf16" if device.type == "cuda" else "fp32"


def resolve_skip_nonfinite(config: Config, device: torch.device, precision: str) -> bool:
    """Whether the optimizer checks every step for NaN/Inf (a host sync); fp16 always needs it."""
    if precision == "fp16":
        return True
    if config.train.skip_nonfinite is not None:
        return config.train.skip_nonfinite
    return device.type != "cuda"


def schedule_class(config: Config) -> type[PipelineSchedule]:
    """The pipeline schedule ``parallel.schedule`` names (``auto``: none, 1F1B or interleaved 1F1B)."""
    name = config.parallel.schedule
    if config.parallel.pp == 1:
        if name not in ("auto", "1f1b", "gpipe"):
            raise UserError(f"parallel.schedule={name} needs parallel.pp > 1")
        return NoPipelining
    if name == "auto":
        return Interleaved1F1B if config.parallel.vpp > 1 else OneFOneB
    if config.parallel.vpp > 1 and name != "interleaved":
        raise UserError(f"parallel.vpp={config.parallel.vpp} needs parallel.schedule=interleaved (or auto), got {name}")
    return SCHEDULES[name]


@dataclass
class StepOutput:
    """What one optimizer step produced (tensors stay on the device; read them when logging).

    ``loss``: mean micro-batch loss on the last pipeline stage (0 on other stages). ``finite``: whether the
    gradients were finite and so the update was applied (see ``StepResult.finite``), or ``None`` when the step
    was not checked (``train.skip_nonfinite`` off).
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    finite: bool | None
    lr: float
    loss_scale: float | None
    moe: dict[str, torch.Tensor] | None = None  # MoE load statistics (mcore.parallel.moe_metrics); None: dense


def microbatch_to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Move the tensors of a collated micro-batch to ``device`` (non-blocking from pinned memory)."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def pipeline_layout(config: Config, pp: int) -> list[int] | None:
    """Layers per virtual stage from ``parallel.pipeline_layout`` (``None``: the even split); see
    :func:`mcore.models.stages.pipeline_layout`."""
    return stage_layout(config.model, pp, config.parallel.vpp, config.parallel.pipeline_layout, config.data.seq_length)


class Trainer:
    """This rank's part of the model, its optimizer and the step function.

    Args:
        config: the run's configuration.
        runtime: rank, device and process groups (``init_runtime``).
        weights: optional ``CheckpointReader`` whose model weights are loaded before the optimizer takes
            its fp32 master copies (for fine-tuning and resuming).
        with_optimizer: build DDP and the optimizer (``False`` for evaluation only).

    ``chunks`` are this rank's model chunks (``GPTModel`` modules, one per virtual pipeline stage);
    ``ddp_chunks`` their ``DistributedDataParallel`` wrappers (empty without the optimizer), which the
    schedule runs when training. The rest of the training state (step, data position, optimizer) is read and
    restored through :meth:`state_dict` / :meth:`load_state_dict`, which the checkpoint code uses.
    """

    def __init__(self, config: Config, runtime: Runtime, *, weights: Any = None, with_optimizer: bool = True) -> None:
        self.config = config
        self.runtime = runtime
        self.device = runtime.device
        groups = runtime.groups
        self.groups = groups
        self.precision = resolve_precision(config, self.device)
        self.params_dtype = PRECISION_DTYPES[base_precision(self.precision, self.device)]
        self.skip_nonfinite = resolve_skip_nonfinite(config, self.device, self.precision)
        pp, vpp = groups.pp_size, config.parallel.vpp
        self.num_stages = pp * vpp
        self.pipeline_layout = pipeline_layout(config, pp)
        self._aux_loss_modules: list[torch.nn.Module] | None = None  # the MoE layers and MTP (train_step)
        self.chunks: list[GPTModel] = build_stage_chunks(
            config.model,
            groups,
            vpp=vpp,
            layout=self.pipeline_layout,
            seed=config.train.seed,
            sequence_parallel=config.parallel.sequence_parallel,
            recompute=None if config.train.recompute == "none" else config.train.recompute,
            recompute_modules=config.train.recompute_modules,
            # fully sharded training: the fp32 shards are the master weights, FSDP computes in params_dtype
            params_dtype=torch.float32 if config.parallel.dp_shard and with_optimizer else self.params_dtype,
            device=self.device,
        )
        # fp8 weight casts reused by a step's micro-batches, dropped before each optimizer step
        self.weight_casts = weight_cast_cache(config, config.num_microbatches(groups.dp_size))
        fp8_linears = 0
        for chunk in self.chunks:
            decisions = apply_low_precision(config, chunk, groups.tp, self.weight_casts)
            fp8_linears += sum(d.recipe == config.fp8.recipe for d in decisions)
            chunk.mtp_loss_weight = config.train.mtp_loss_weight
        if config.fp8.param_gather and not fp8_linears and groups.pp_size == 1:  # a pp stage may hold none: fine
            raise UserError(
                "fp8.param_gather=true, but every linear stays in high precision (fp8.keep / fp8.min_features): "
                "nothing to gather in fp8; set fp8.param_gather=false or quantize some linears"
            )
        self.activation_offload = None
        if config.train.activation_offload:
            from mcore.train.activation_offload import attach_activation_offload

            names = config.train.activation_offload
            self.activation_offload = attach_activation_offload(self.chunks, names, self.device)
        if weights is not None:
            local = self.named_local_parameters() + self.named_local_buffers()
            load_model_weights(weights, local, config.model, groups)

        self.iteration = 0
        self.consumed_samples = 0
        self.lr_schedule = config.lr_schedule()
        self.num_microbatches = config.num_microbatches(groups.dp_size)
        # parallel.cp: every micro-batch is cut into this rank's CP shard before the schedule runs it
        self.context_parallel = CPBatches.build(config.parallel, groups)
        self.dynamic_cp = None  # parallel.cp_dynamic: training steps place each document by its length
        if config.parallel.cp_dynamic and with_optimizer:
            from mcore.train.dynamic_cp import DynamicCP

            self.dynamic_cp = DynamicCP(config, groups, self.device)
        self.optimizer: MixedPrecisionOptimizer | None = None
        self.ddp_chunks: list[DistributedDataParallel] = []
        if with_optimizer:
            self._build_optimizer()
        self.schedule = self._build_schedule()

    # ------------------------------------------------------------------------------------------ building
    def _build_optimizer(self) -> None:
        cfg, groups = self.config, self.groups
        if cfg.parallel.dp_shard:
            from mcore.train.dp_shard import fully_shard_chunks

            self.ddp_chunks = fully_shard_chunks(self.chunks, groups, cfg, self.params_dtype, self.device)
        else:
            self.ddp_chunks = self._data_parallel_chunks()
        scaler = DynamicLossScaler(initial_scale=cfg.train.initial_loss_scale) if self.precision == "fp16" else None
        optimizer_cls = DistributedOptimizer if cfg.parallel.distributed_optimizer else MixedPrecisionOptimizer
        if cfg.parallel.dp_shard:
            optimizer_cls = FullyShardedOptimizer
        offload = {"offload_fraction": cfg.optim.offload_fraction} if cfg.optim.offload_fraction > 0 else {}
        if offload and scaler is not None:
            offload["fused_step"] = True  # the offloaded step unscales on the host: gradients stay scaled until then
        self.optimizer = optimizer_cls(
            self.ddp_chunks,
            default_param_groups(self.ddp_chunks, cfg.optim.weight_decay),
            lr=self.lr_schedule(0),
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
            clip_grad=cfg.optim.clip_grad,
            loss_scaler=scaler,
            groups=groups,
            check_nonfinite=self.skip_nonfinite,
            exp_avg_dtype=STATE_DTYPES[cfg.optim.exp_avg_dtype],
            exp_avg_sq_dtype=STATE_DTYPES[cfg.optim.exp_avg_sq_dtype],
            **offload,
        )

    def _data_parallel_chunks(self) -> list[DistributedDataParallel]:
        cfg, groups = self.config, self.groups
        return [
            DistributedDataParallel(
                chunk,
                groups.dp_cp,  # CP ranks are replicas too: their gradients are summed with the dp ranks' ones
                bucket_size=cfg.parallel.bucket_size,
                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                overlap_param_gather=cfg.parallel.overlap_param_gather,
                use_distributed_optimizer=cfg.parallel.distributed_optimizer,
                grad_dtype=STATE_DTYPES[cfg.optim.main_grads_dtype],  # bf16: Megatron's --main-grads-dtype
                gradient_accumulation_fusion=cfg.parallel.gradient_accumulation_fusion,
                expert_dp_group=groups.expert_dp,  # MoE experts: reduced over the expert grid's dp
                fp8_param_gather=cfg.fp8.param_gather,  # checked: fp8 recipe and distributed optimizer
            )
            for chunk in self.chunks
        ]

    def _build_schedule(self) -> PipelineSchedule:
        cfg, groups = self.config, self.groups
        cls = schedule_class(cfg)
        try:
            shape = p2p_activation_shape(
                cfg.data.seq_length // cfg.parallel.cp,  # each CP rank sends its own tokens' activations
                cfg.train.micro_batch_size,
                cfg.model.hidden_size,
                tp_size=groups.tp_size,
                sequence_parallel=cfg.parallel.sequence_parallel,
            )
            return cls(
                self._scheduled_chunks,
                num_microbatches=self.num_microbatches,
                pp_group=groups.pp,
                activation_shape=shape,
                activation_dtype=self.params_dtype,
                device=self.device,
                finalize_grads=self._finalize_grads,
                grad_scale_func=self.optimizer.scale_loss if self.optimizer is not None else None,
                # packed documents under CP are padded per micro-batch: the row length varies
                variable_shapes=cfg.parallel.cp > 1 and cfg.data.packing,
            )
        except ValueError as exc:
            raise UserError(f"pipeline schedule {cls.__name__}: {exc}") from None

    @property
    def _scheduled_chunks(self) -> list[torch.nn.Module]:
        """What the schedule runs: the DDP wrappers when training, the chunks themselves for evaluation only."""
        return list(self.ddp_chunks) if self.ddp_chunks else list(self.chunks)

    def _finalize_grads(self) -> None:
        finalize_model_grads(self.ddp_chunks, self.groups)

    # ------------------------------------------------------------------------------------------ stepping
    @property
    def is_last_stage(self) -> bool:
        return self.groups.pp_rank == self.groups.pp_size - 1

    def _forward_step(self, chunk_index: int, input_tensor: torch.Tensor | None, batch: Mapping[str, Any]):
        chunk = self.chunks[chunk_index]
        module = self.ddp_chunks[chunk_index] if self.ddp_chunks else chunk
        kwargs: dict[str, Any] = {"position_ids": batch["position_ids"], "cu_seqlens": batch.get("cu_seqlens")}
        if "context_parallel" in batch:
            kwargs["context_parallel"] = batch["context_parallel"]
        if batch.get("padding_mask") is not None:  # CP's per-document padding: out of the MoE routing statistics
            kwargs["padding_mask"] = batch["padding_mask"]
        if chunk.post_process:
            kwargs["labels"] = batch["labels"]
            if chunk.mtp is not None:  # MTP modules embed the next tokens on the last stage
                kwargs["mtp_input_ids"] = batch["tokens"]
        if chunk.pre_process:
            out = module(batch["tokens"], **kwargs)
        else:
            out = module(hidden_states=input_tensor, **kwargs)
        if not chunk.post_process:
            return out
        mask = batch["loss_mask"]
        if "context_parallel" in batch:  # cp x this shard's share of the micro-batch mean (DDP averages over dp x cp)
            return (out * mask).sum() * self.groups.cp_size / batch["loss_tokens"].clamp(min=1.0)
        # Mean over the tokens that count; clamp keeps an all-masked micro-batch at 0 instead of NaN.
        return (out * mask).sum() / mask.sum().clamp(min=1.0)

    def train_step(self, microbatches: Sequence[Mapping[str, Any]]) -> StepOutput:
        """One optimizer step over this rank's ``num_microbatches`` micro-batches (already on the device)."""
        if self.optimizer is None:
            raise RuntimeError("Trainer was built with with_optimizer=False; it cannot train")
        lr = self.lr_schedule(self.iteration)
        self.optimizer.set_lr(lr)
        self.optimizer.zero_grad()
        # MoE layers' and MTP's aux losses: their gradient, scaled as the loss is (under CP each rank's MTP loss is
        # its share of the micro-batch's and DDP averages over dp x cp: x cp, as _forward_step's loss)
        aux_scale = self.optimizer.loss_scale / self.num_microbatches * self.groups.cp_size
        if self._aux_loss_modules is None:  # found once: walking every module each step kept the GPU waiting
            self._aux_loss_modules = [
                m for chunk in self.chunks for m in chunk.modules() if hasattr(m, "aux_loss_scale")
            ]
        for module in self._aux_loss_modules:
            module.aux_loss_scale = aux_scale
        loss = self._forward_backward(microbatches)
        if self.weight_casts is not None:
            self.weight_casts.invalidate()  # the step changes the weights (and frees the casts before its peak)
        result: StepResult = self.optimizer.step()
        self.iteration += 1
        self.consumed_samples += self.config.train.global_batch_size
        return StepOutput(
            loss=loss,
            grad_norm=result.grad_norm,
            finite=result.finite if self.skip_nonfinite else None,
            lr=lr,
            loss_scale=result.loss_scale,
            moe=moe_metrics(self.chunks),
        )

    def _forward_backward(self, microbatches: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """The step's forward and backward passes, gradients reduced; returns the mean micro-batch loss of this
        rank's data-parallel replica (0 off the last pipeline stage)."""
        if self.dynamic_cp is not None:
            loss = self.dynamic_cp.forward_backward(microbatches, self.ddp_chunks[0], self.optimizer.scale_loss)
            self._finalize_grads()
            return loss
        losses = self.schedule.run(self._forward_step, self._local_microbatches(microbatches))
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        if self.context_parallel is not None:  # the shards' losses add up to cp x the micro-batch mean
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.groups.cp)
            loss /= self.groups.cp_size
        return loss

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Sequence[Mapping[str, Any]]]) -> torch.Tensor:
        """Mean loss over every micro-batch of ``batches`` (each item: one step's micro-batches).

        Collective: every rank calls it with the same number of steps; all ranks get the same value.
        """
        for chunk in self.chunks:
            chunk.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for microbatches in batches:
                local = self._local_microbatches(microbatches)
                losses = self.schedule.run(self._forward_step, local, forward_only=True)
                if losses:
                    total += torch.stack(losses).double().sum()
                    count += len(losses)
        finally:
            for chunk in self.chunks:
                chunk.train()
        pair = torch.stack([total, count])
        self.reduce_across_stages_and_replicas(pair)
        return (pair[0] / pair[1].clamp(min=1.0)).float()

    def _local_microbatches(self, microbatches: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The micro-batches as this rank runs them: its CP shard of each under context parallelism."""
        if self.context_parallel is None:
            return list(microbatches)
        return [self.context_parallel.shard(mb) for mb in microbatches]

    def reduce_across_stages_and_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the pipeline group (only the last stage holds losses) and the dp x cp
        group (CP ranks hold shares of the same micro-batches: the sum of their losses counts cp times)."""
        for group in (self.groups.pp, self.groups.dp_cp):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(tensor, group=group)
        return tensor

    # ------------------------------------------------------------------------------------------ names
    def named_local_parameters(self) -> list[tuple[str, torch.nn.Parameter, GPTModel]]:
        """(global name, parameter, chunk) of every parameter on this rank, shared copies included."""
        return [(name, p, chunk) for chunk in self.chunks for name, p in chunk.named_parameters()]

    def named_local_buffers(self) -> list[tuple[str, torch.Tensor, GPTModel]]:
        """(global name, buffer, chunk) of the persistent buffers on this rank (MoE expert biases): checkpointed
        and loaded with the parameters, never in the optimizer."""
        return [(name, b, chunk) for chunk in self.chunks for name, b in persistent_buffers(chunk)]

    # ------------------------------------------------------------------------------------------ state
    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    def checkpointed_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters that go into its checkpoint shard: the last stage's copy of a tied embedding
        is left out (it equals the first stage's ``embedding.weight``, from which it is loaded)."""
        out: dict[str, torch.nn.Parameter] = {}
        for name, param, chunk in self.named_local_parameters():
            if is_shared_embedding(param) and not chunk.pre_process:
                continue
            out[name] = param
        out.update((name, b) for name, b, _ in self.named_local_buffers())
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state, as a checkpoint saves it (collective with the distributed optimizer,
        which gathers its shards over dp).

        ``iteration`` and ``consumed_samples`` (the data position); ``lr``: the learning rate of the last step
        taken; ``model``: :meth:`checkpointed_parameters` (the live parameters: copy them before the next step);
        ``optimizer``: the optimizer's ``state_dict()`` (``step``, ``tensors`` keyed ``"<name>/<kind>"``,
        ``loss_scaler``), or ``None`` without an optimizer.
        """
        for chunk in self.ddp_chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.finish_param_sync()  # complete parameters (fp8_param_gather leaves other ranks' shards stale)
        return {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "lr": self.lr_schedule(max(self.iteration - 1, 0)),
            "model": self.checkpointed_parameters(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returns: ``iteration`` and ``consumed_samples`` (required),
        ``model`` (optional ``{name: tensor}`` of local parameters, copied in, shared copies included) and
        ``optimizer`` (optional; needs a trainer built with the optimizer)."""
        missing = [key for key in ("iteration", "consumed_samples") if key not in state]
        if missing:
            raise ValueError(f"Trainer.load_state_dict: state lacks {missing}; it needs iteration and consumed_samples")
        if state.get("model") is not None:
            tensors = state["model"]
            for name, param, _ in self.named_local_parameters() + self.named_local_buffers():
                if name in tensors:
                    param.copy_(tensors[name])
            for chunk in self.ddp_chunks:
                if isinstance(chunk, DistributedDataParallel):
                    chunk.params_replaced()  # fp8 copies of the old weights are stale now
        if state.get("optimizer") is not None:
            if self.optimizer is None:
                raise ValueError("Trainer.load_state_dict: optimizer state given, but the trainer has no optimizer")
            self.optimizer.load_state_dict(dict(state["optimizer"]))
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
