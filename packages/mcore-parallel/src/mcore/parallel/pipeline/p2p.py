"""Point-to-point transfers between adjacent pipeline stages.

One call to :meth:`PipelineP2P.communicate` issues ONE ``torch.distributed.batch_isend_irecv`` with every send and
receive of that moment and waits for all of it: with NCCL the batch runs as one grouped launch, so a send to the
next stage and a receive from it cannot block each other; with gloo the ops simply run concurrently.

Shapes are known ahead: every micro-batch's activation has ``shape`` (with sequence parallelism that is the
sequence-sharded ``[s/tp, b, h]``, see :func:`p2p_activation_shape`), so receive buffers are allocated without
asking the sender. For models whose activation shape changes between micro-batches, ``variable_shapes=True``
first exchanges a small int64 header with the shape, in a batch shaped like the data batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineP2P", "p2p_activation_shape"]

_MAX_DIMS = 8


def p2p_activation_shape(
    seq_length: int, micro_batch_size: int, hidden_size: int, *, tp_size: int = 1, sequence_parallel: bool = False
) -> tuple[int, int, int]:
    """The ``[s, b, h]`` shape a stage sends; with sequence parallelism each TP rank sends its ``s / tp`` shard."""
    for name, value in (
        ("seq_length", seq_length),
        ("micro_batch_size", micro_batch_size),
        ("hidden_size", hidden_size),
        ("tp_size", tp_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not sequence_parallel:
        return (seq_length, micro_batch_size, hidden_size)
    if seq_length % tp_size != 0:
        raise ValueError(
            f"with sequence parallelism seq_length={seq_length} must be divisible by tp_size={tp_size} "
            f"(each TP rank sends s/tp rows); pad the sequence to a multiple of {tp_size}"
        )
    return (seq_length // tp_size, micro_batch_size, hidden_size)


class PipelineP2P:
    """Batched sends and receives with the previous and next pipeline stage.

    Args:
        group: the pipeline-parallel process group.
        prev_rank / next_rank: global ranks of the neighbouring stages (``None`` where there is none).
        shape: the activation (and gradient) shape; required unless ``variable_shapes``.
        dtype / device: of the transferred tensors (with NCCL the device must be the rank's CUDA device).
        variable_shapes: exchange each tensor's shape before its data (one extra small batch per call).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        prev_rank: int | None,
        next_rank: int | None,
        *,
        shape: Sequence[int] | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        variable_shapes: bool = False,
    ) -> None:
        if not variable_shapes:
            if shape is None:
                raise ValueError(
                    "shape is required with fixed shapes; pass the activation shape or variable_shapes=True"
                )
            shape = tuple(shape)
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
                raise ValueError(f"shape must be a non-empty sequence of ints >= 1, got {shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.shape = None if shape is None else tuple(shape)
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.variable_shapes = variable_shapes

    def _peer(self, side: str) -> int:
        rank = self.prev_rank if side == "prev" else self.next_rank
        if rank is None:
            raise ValueError(f"this stage has no {side} stage ({side}_rank=None) but a transfer with it was requested")
        return rank

    def _check_send(self, side: str, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send_{side} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtype:
            raise ValueError(f"send_{side} has dtype {tensor.dtype} but the pipeline transfers {self.dtype}")
        if not self.variable_shapes and tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"send_{side} has shape {tuple(tensor.shape)} but the pipeline was set up for {self.shape}; "
                f"fix the activation shape, or use variable_shapes=True if it really varies per micro-batch"
            )
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"send_{side} has {tensor.dim()} dims; at most {_MAX_DIMS} are supported")
        return tensor.detach().contiguous()

    def _batch(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Post all ops as one batch and wait. Sends go out to next before prev and receives are posted from
        prev before next, so with two stages (prev == next) a rank's sends line up with its peer's receives."""
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for peer, t in recvs]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def communicate(
        self,
        *,
        send_prev: torch.Tensor | None = None,
        send_next: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send and receive in one batch; returns ``(from_prev, from_next)`` (``None`` where nothing was asked)."""
        send_sides = [(s, t) for s, t in (("next", send_next), ("prev", send_prev)) if t is not None]
        recv_sides = [s for s, wanted in (("prev", recv_prev), ("next", recv_next)) if wanted]
        sends = [(self._peer(s), self._check_send(s, t)) for s, t in send_sides]
        recv_peers = [self._peer(s) for s in recv_sides]
        if self.variable_shapes:
            shapes = self._exchange_shapes([t for _, t in sends], recv_peers, [p for p, _ in sends])
        else:
            shapes = [self.shape] * len(recv_peers)
        buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        self._batch(sends, list(zip(recv_peers, buffers)))
        received = dict(zip(recv_sides, buffers))
        return received.get("prev"), received.get("next")

    def _exchange_shapes(
        self, tensors: list[torch.Tensor], recv_peers: list[int], send_peers: list[int]
    ) -> list[tuple[int, ...]]:
        headers = []
        for t in tensors:
            header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            header[0] = t.dim()
            header[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            headers.append(header)
        incoming = [torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device) for _ in recv_peers]
        self._batch(list(zip(send_peers, headers)), list(zip(recv_peers, incoming)))
        shapes = []
        for header in incoming:
            values = header.tolist()
            shapes.append(tuple(values[1 : 1 + values[0]]))
        return shapes
