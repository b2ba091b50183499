"""What every pipeline schedule shares: validation, running an op order, gradient-sync control, accounting.

A schedule is defined by one class method, :meth:`PipelineSchedule.op_order`, which lists the ops (``F``,
``B``, ``W`` of a chunk and micro-batch) rank ``r`` runs, in order, with its warmup / steady / cooldown phases.
:meth:`PipelineSchedule.run` executes that order, doing before each op the one batched exchange that
:func:`~mcore.parallel.pipeline.p2p_exchanges.pipeline_plans` prescribes, so every schedule gets the same, checked
communication (see ``plan.py``); the op order is also what the timeline drawings are made from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, Op
from mcore.parallel.pipeline.p2p import PipelineP2P
from mcore.parallel.pipeline.p2p_exchanges import ACTIVATION, GRADIENT, Step, pipeline_plans
from mcore.parallel.pipeline.timeline import StageTimeline, TimedOp

__all__ = ["PipelineSchedule", "ForwardStep"]

ForwardStep = Callable[[int, "torch.Tensor | None", Any], torch.Tensor]
"""``forward_step(chunk_index, input_tensor, microbatch) -> Tensor``: the model chunk's forward on one micro-batch.

``input_tensor`` is ``None`` on the first virtual stage (chunk 0 of pipeline rank 0), which reads its input from
``microbatch``; elsewhere it is the activation received from the previous stage. On the last virtual stage the
function returns the micro-batch's scalar loss, elsewhere the activation to send on.
"""


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class PipelineSchedule:
    """Base class: construct once per model (chunks, group, sizes), then call :meth:`run` every step.

    Args:
        model_chunks: this rank's model chunks (``vpp = len(model_chunks)``). A chunk that has ``no_sync()``
            (``DistributedDataParallel``) gets its gradient synchronisation disabled for every backward pass
            except those of its last micro-batch, so its buckets are reduced while the other chunks' backward
            passes still run.
        num_microbatches: micro-batches per :meth:`run` (per optimizer step).
        pp_group: the pipeline process group (``None`` for a single stage).
        pp_rank / pp_size: this rank's position and the number of stages; default: read from ``pp_group``.
        prev_rank / next_rank: global ranks of the neighbouring stages; default: from ``pp_group``, wrapping
            around (the last rank sends to rank 0) when ``vpp > 1``.
        activation_shape / activation_dtype: the shape and dtype of the activation each stage sends (with
            sequence parallelism the sequence-sharded shape, see ``p2p_activation_shape``).
        device: where receive buffers live (the rank's CUDA device with NCCL; CPU with gloo).
        variable_shapes: activations change shape between micro-batches; shapes are then sent ahead of data.
        finalize_grads: called once after the last backward of :meth:`run` (e.g. ``finalize_model_grads``:
            finish the data-parallel reduction, all-reduce tied-embedding and sequence-parallel gradients).
        grad_scale_func: maps the ``1/num_microbatches``-scaled loss to the tensor to differentiate
            (loss scaling for fp16); default: identity.
        measure: record the wall time of every op; after :meth:`run`, :attr:`last_timeline` holds them.
    """

    name: ClassVar[str] = "base"
    splits_backward: ClassVar[bool] = False
    # the schedules that run one model chunk per rank (all but Interleaved1F1B) refuse vpp > 1
    one_chunk_per_rank: ClassVar[bool] = False

    def __init__(
        self,
        model_chunks: Sequence[nn.Module],
        *,
        num_microbatches: int,
        pp_group: dist.ProcessGroup | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        prev_rank: int | None = None,
        next_rank: int | None = None,
        activation_shape: Sequence[int] | None = None,
        activation_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        variable_shapes: bool = False,
        finalize_grads: Callable[[], None] | None = None,
        grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        measure: bool = False,
    ) -> None:
        if isinstance(model_chunks, nn.Module) or not isinstance(model_chunks, Sequence) or not model_chunks:
            raise TypeError(
                f"model_chunks must be a non-empty list of nn.Module (one per virtual stage of this rank), "
                f"got {type(model_chunks).__name__}; wrap a single module as [module]"
            )
        for i, chunk in enumerate(model_chunks):
            if not isinstance(chunk, nn.Module):
                raise TypeError(f"model_chunks[{i}] must be an nn.Module, got {type(chunk).__name__}")
        self.model_chunks = list(model_chunks)
        self.vpp = len(self.model_chunks)
        self.num_microbatches = _check_int("num_microbatches", num_microbatches, 1)
        self.pp_group = pp_group
        self.pp_rank, self.pp_size = self._resolve_position(pp_group, pp_rank, pp_size)
        type(self).check_sizes(self.pp_size, self.vpp, self.num_microbatches)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.finalize_grads = finalize_grads
        self.grad_scale_func = grad_scale_func
        self.measure = measure
        self.last_timeline: StageTimeline | None = None
        self._plans: dict[bool, list[list[Step]]] = {}
        self.p2p: PipelineP2P | None = None
        if self.pp_size > 1:
            if pp_group is None:
                raise ValueError(f"pp_size={self.pp_size} needs the pipeline process group (pp_group)")
            prev_rank = self._neighbour("prev_rank", prev_rank, -1)
            next_rank = self._neighbour("next_rank", next_rank, +1)
            self.p2p = PipelineP2P(
                pp_group,
                prev_rank,
                next_rank,
                shape=activation_shape,
                dtype=activation_dtype,
                device=self.device,
                variable_shapes=variable_shapes,
            )
        self.activation_shape = None if activation_shape is None else tuple(activation_shape)
        self.activation_dtype = activation_dtype
        self.variable_shapes = variable_shapes

    def _neighbour(self, name: str, given: int | None, step: int) -> int | None:
        """The global rank of the neighbouring stage (wrapping around only with interleaving, whose last rank
        feeds rank 0); a given value must agree with the group."""
        at_edge = self.pp_rank + step not in range(self.pp_size)
        if at_edge and self.vpp == 1:
            return given  # never used: no transfer crosses the pipeline's ends without interleaving
        expected = dist.get_global_rank(self.pp_group, (self.pp_rank + step) % self.pp_size)
        if given is not None and given != expected:
            raise ValueError(
                f"{name}={given} but pipeline rank {self.pp_rank}'s neighbour in pp_group is global rank "
                f"{expected}; leave {name} out to take it from the group"
            )
        return expected

    @staticmethod
    def _resolve_position(group: dist.ProcessGroup | None, pp_rank: int | None, pp_size: int | None) -> tuple[int, int]:
        if group is None:
            rank, size = 0 if pp_rank is None else pp_rank, 1 if pp_size is None else pp_size
        else:
            rank = dist.get_rank(group) if pp_rank is None else pp_rank
            size = dist.get_world_size(group) if pp_size is None else pp_size
            if (rank, size) != (dist.get_rank(group), dist.get_world_size(group)):
                raise ValueError(
                    f"pp_rank={rank}, pp_size={size} disagree with pp_group, where this process is rank "
                    f"{dist.get_rank(group)} of {dist.get_world_size(group)}; leave them out to read them from the "
                    f"group"
                )
        _check_int("pp_size", size, 1)
        _check_int("pp_rank", rank, 0)
        if rank >= size:
            raise ValueError(f"pp_rank={rank} must be < pp_size={size}")
        if group is None and size > 1:
            raise ValueError(f"pp_size={size} needs the pipeline process group (pp_group)")
        return rank, size

    # ----- what a schedule defines -------------------------------------------------------------------------

    @classmethod
    def check_sizes(cls, pp: int, vpp: int, num_microbatches: int) -> None:
        """Raise ``ValueError`` naming the numbers if the schedule cannot run with these sizes."""
        _check_int("pp", pp, 1)
        _check_int("vpp", vpp, 1)
        _check_int("num_microbatches", num_microbatches, 1)
        if cls.one_chunk_per_rank and vpp != 1:
            raise ValueError(
                f"{cls.__name__} runs one model chunk per rank, got vpp={vpp}; use Interleaved1F1B for vpp > 1"
            )

    @staticmethod
    def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
        """Theoretical idle share of each stage's time for this schedule (see the subclasses for the formula)."""
        raise NotImplementedError

    @classmethod
    def ticks(
        cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False
    ) -> list[tuple[Op, ...]]:
        """The ops rank ``pp_rank`` runs, in order, grouped by the exchange that precedes each group.

        Usually one op per group; the interleaved schedule pairs a forward with a backward in its steady state.
        """
        raise NotImplementedError

    @classmethod
    def op_order(cls, pp: int, pp_rank: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> list[Op]:
        """The ops rank ``pp_rank`` runs, in order."""
        return [op for group in cls.ticks(pp, pp_rank, vpp, num_microbatches, forward_only) for op in group]

    @classmethod
    def plans(cls, pp: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> list[list[Step]]:
        """Every rank's op order with its communication: exactly what :meth:`run` executes on each rank."""
        ticks = [cls.ticks(pp, r, vpp, num_microbatches, forward_only) for r in range(pp)]
        return pipeline_plans(ticks, pp, vpp)

    # ----- split backward hooks (zero bubble) ----------------------------------------------------------------

    def _before_backward_passes(self) -> None:
        """Called at the start of a :meth:`run` that will differentiate."""

    def _backward_context(self) -> contextlib.AbstractContextManager:
        """Entered around every B pass (zero bubble: defer the weight gradients)."""
        return contextlib.nullcontext()

    def _after_backward_passes(self) -> None:
        """Called after the last op of a :meth:`run` that differentiated, before ``finalize_grads``."""

    def _weight_pass(self, chunk: int, microbatch: int) -> None:
        """The W pass of a split backward."""
        raise RuntimeError(f"{type(self).__name__} does not split the backward, but its op order has a W pass")

    # ----- running ---------------------------------------------------------------------------------------------

    def run(
        self, forward_step: ForwardStep, microbatches: Iterable[Any], forward_only: bool = False
    ) -> list[torch.Tensor]:
        """Run forward (and backward) of every micro-batch; return the losses on the last stage.

        ``microbatches`` holds ``num_microbatches`` items, one per micro-batch, handed to ``forward_step``
        unchanged (stages that need no data may pass ``[None] * num_microbatches``). Before backward each loss
        is scaled by ``1 / num_microbatches``, so gradients are those of the mean loss. Returns the detached,
        unscaled loss of every micro-batch, in order, on the rank holding the last virtual stage; ``[]`` elsewhere.
        Gradients accumulate into the parameters' ``.grad`` (or ``main_grad`` under DDP); ``finalize_grads`` runs
        at the end. With ``forward_only`` no graph is kept and nothing is differentiated.
        """
        if not callable(forward_step):
            raise TypeError(f"forward_step must be callable, got {type(forward_step).__name__}")
        items = list(microbatches)
        if len(items) != self.num_microbatches:
            raise ValueError(
                f"got {len(items)} micro-batches but the schedule was built for num_microbatches="
                f"{self.num_microbatches}; pass exactly that many (placeholders such as None on stages that read "
                f"no data)"
            )
        if forward_only not in self._plans:
            self._plans[forward_only] = self.plans(self.pp_size, self.vpp, self.num_microbatches, forward_only)
        plan = self._plans[forward_only][self.pp_rank]
        state = _RunState(forward_step, items, forward_only)
        for step in plan:
            if step.op is not None and step.op.kind == BACKWARD:
                state.last_microbatch[step.op.chunk] = step.op.microbatch
        if not forward_only:
            self._before_backward_passes()
        timeline = StageTimeline(pp_rank=self.pp_rank) if self.measure else None
        if timeline is not None:
            if self.pp_group is not None:
                dist.barrier(group=self.pp_group)  # a common start, so that the stages' spans are comparable
            timeline.start = self._clock()
        for step in plan:
            self._exchange(step, state)
            if step.op is None:
                continue
            start = self._clock() if timeline is not None else 0.0
            if step.op.kind == FORWARD:
                self._forward_pass(step.op, state)
            elif step.op.kind == BACKWARD:
                self._backward_pass(step.op, state)
            else:
                with self._grad_sync(step.op, state):
                    self._weight_pass(step.op.chunk, step.op.microbatch)
            if timeline is not None:
                timeline.ops.append(TimedOp(step.op, start, self._clock()))
        if timeline is not None:
            timeline.end = self._clock()
            self.last_timeline = timeline
        if not forward_only:
            self._after_backward_passes()
            if self.finalize_grads is not None:
                self.finalize_grads()
        return [state.losses[mb] for mb in sorted(state.losses)]

    def _stage(self, op: Op) -> int:
        return op.chunk * self.pp_size + self.pp_rank

    def _is_last_stage(self, op: Op) -> bool:
        return self._stage(op) == self.pp_size * self.vpp - 1

    def _forward_pass(self, op: Op, state: _RunState) -> None:
        x = state.inbox.pop((ACTIVATION, op.chunk, op.microbatch), None)
        if x is not None and not state.forward_only:
            x.requires_grad_(True)
        with torch.no_grad() if state.forward_only else torch.enable_grad():
            y = state.forward_step(op.chunk, x, state.items[op.microbatch])
        if self._is_last_stage(op):
            self._check_loss(y, op)
            state.losses[op.microbatch] = y.detach()
            if not state.forward_only:
                scaled = y / self.num_microbatches
                if self.grad_scale_func is not None:
                    scaled = self.grad_scale_func(scaled)
                state.saved[(op.chunk, op.microbatch)] = (x, scaled)
        else:
            self._check_activation(y, op)
            state.outbox[(ACTIVATION, op.chunk, op.microbatch)] = y
            if not state.forward_only:
                state.saved[(op.chunk, op.microbatch)] = (x, y)

    def _backward_pass(self, op: Op, state: _RunState) -> None:
        x, y = state.saved.pop((op.chunk, op.microbatch))
        grad = None if self._is_last_stage(op) else state.inbox.pop((GRADIENT, op.chunk, op.microbatch))
        with self._grad_sync(op, state), self._backward_context():
            torch.autograd.backward(y, grad_tensors=grad)
        if x is None:  # first virtual stage: nobody waits for an input gradient
            return
        if x.grad is None:
            raise RuntimeError(
                f"chunk {op.chunk} (virtual stage {self._stage(op)}) produced no gradient for its input on "
                f"micro-batch {op.microbatch}: its output must depend on input_tensor"
            )
        state.outbox[(GRADIENT, op.chunk, op.microbatch)] = x.grad

    def _grad_sync(self, op: Op, state: _RunState) -> contextlib.AbstractContextManager:
        """Gradient sync stays on only for the chunk's last micro-batch, whose backward completes the gradients;
        the chunk's buckets are then reduced while the other chunks' backward passes still run."""
        module = self.model_chunks[op.chunk]
        if op.microbatch == state.last_microbatch[op.chunk] or not hasattr(module, "no_sync"):
            return contextlib.nullcontext()
        return module.no_sync()

    def _exchange(self, step: Step, state: _RunState) -> None:
        if not step.messages:
            return
        if self.p2p is None:
            raise RuntimeError(f"op {step.op} needs communication but this schedule has a single stage")
        sends: dict[str, torch.Tensor] = {}
        receives: dict[str, tuple] = {}
        for msg in step.messages:
            key = (msg.kind, msg.chunk, msg.microbatch)
            if msg.send:
                sends[msg.peer] = state.outbox.pop(key)
            else:
                receives[msg.peer] = key
        from_prev, from_next = self.p2p.communicate(
            send_prev=sends.get("prev"),
            send_next=sends.get("next"),
            recv_prev="prev" in receives,
            recv_next="next" in receives,
        )
        if "prev" in receives:
            state.inbox[receives["prev"]] = from_prev
        if "next" in receives:
            state.inbox[receives["next"]] = from_next

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _check_loss(self, y: object, op: Op) -> None:
        if not isinstance(y, torch.Tensor) or y.dim() != 0:
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"forward_step(chunk_index={op.chunk}, microbatch={op.microbatch}) is the last virtual stage and "
                f"must return the micro-batch's scalar loss, got {shape}; reduce the loss to a 0-dim tensor"
            )

    def _check_activation(self, y: object, op: Op) -> None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"forward_step(chunk_index={op.chunk}, microbatch={op.microbatch}) must return a tensor, "
                f"got {type(y).__name__}"
            )
        if not self.variable_shapes and tuple(y.shape) != self.activation_shape:
            raise ValueError(
                f"forward_step(chunk_index={op.chunk}, microbatch={op.microbatch}) returned shape {tuple(y.shape)} "
                f"but activation_shape={self.activation_shape}; pass the shape each stage sends (with sequence "
                f"parallelism the [s/tp, b, h] shard) or variable_shapes=True"
            )
        if y.dtype != self.activation_dtype:
            raise ValueError(
                f"forward_step(chunk_index={op.chunk}, microbatch={op.microbatch}) returned dtype {y.dtype} "
                f"but activation_dtype={self.activation_dtype}"
            )


@dataclass
class _RunState:
    """Everything one :meth:`PipelineSchedule.run` call keeps between ops."""

    forward_step: ForwardStep
    items: list[Any]
    forward_only: bool
    inbox: dict[tuple, torch.Tensor] = field(default_factory=dict)  # received, waiting for their op
    outbox: dict[tuple, torch.Tensor] = field(default_factory=dict)  # produced, waiting for their exchange
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    last_microbatch: dict[int, int] = field(default_factory=dict)  # chunk -> micro-batch of its final backward
