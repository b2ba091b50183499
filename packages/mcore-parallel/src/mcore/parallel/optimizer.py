"""AdamW on fp32 master weights: replicated (``MixedPrecisionOptimizer``) or sharded over data parallelism
(``DistributedOptimizer``, ZeRO-1, in :mod:`mcore.parallel.distributed_optimizer`).

Both optimizers keep, for each parameter (or, sharded, each piece of a parameter that falls in this
rank's shard of a gradient bucket), an fp32 master copy and apply AdamW to those. A step:

1. unscales the gradients (fp16 with ``DynamicLossScaler``);
2. computes the global gradient norm (no double counting across tp/pp/dp; see ``grad_clip``);
3. skips the step when the norm is not finite (fp16 overflow, or any inf/nan with ``check_nonfinite``),
   which is the step's only host synchronization;
4. clips, updates the masters, copies them into the model's (bf16/fp16/fp32) parameters and, sharded,
   all-gathers the updated parameters over dp (overlapped with the next forward when the DDP wrapper has
   ``overlap_param_gather``).

The update runs in one of two ways, with the same results (to fp32 rounding) and the same state:

* fused step (``fused_step=True``; the default on CUDA): ``mcore.kernels.adamw_step_``, one pass per
  tensor that reads the gradient in its own dtype, multiplies it by the clip coefficient and the inverse
  loss scale (a device tensor: steps 1 and 4's multiplies are folded into the update, the norm is taken
  of the still-scaled gradients and divided by the scale), updates master and moments and writes the
  model parameter. The gradient buffers are left as the backward wrote them (still loss-scaled).
* torch step (``fused_step=False``; the default elsewhere): unscale and clip in place with ``_foreach_mul_``,
  ``torch.optim.AdamW`` (fused on CUDA, foreach elsewhere), then copy the masters into the model.

Either way a ``torch.optim.AdamW`` object holds the param groups (``lr``, ``betas``, ``eps``,
``weight_decay``, ``lr_mult``) and the per-master state ``{"step", "exp_avg", "exp_avg_sq"}`` with the
dtypes and devices torch creates, so both kinds of step read and write the same state.

Precision-aware choices (Megatron-Core's ``--use-precision-aware-optimizer``): the gradient buffers may be bf16
(``DistributedDataParallel(grad_dtype=...)``: accumulation, reduction and the norm in bf16) and the two moments
may be stored in bf16 (``exp_avg_dtype``, ``exp_avg_sq_dtype``); either needs the fused step (the default then,
on any device): ``torch.optim.AdamW`` keeps its moments in the master's dtype and would need an fp32 copy of the
whole gradient, while ``adamw_step_`` upcasts each piece inside the update (see ``mcore.kernels.optimizer``).

``state_dict()`` is independent of the dp size: per parameter name (as in the module's
``named_parameters()``), TP-local full tensors ``"<name>/master"`` (fp32), ``"<name>/exp_avg"``,
``"<name>/exp_avg_sq"`` (in their storage dtype; gathered over dp), plus the step count and the loss-scaler state.
``load_state_dict`` casts moments saved in another dtype to this optimizer's (``load_casts`` says which).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from mcore.kernels import adamw_step_
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.grad_clip import clip_coefficient, clip_grads_, total_grad_norm
from mcore.parallel.grid import ProcessGroups
from mcore.parallel.loss_scaler import DynamicLossScaler
from mcore.parallel.offload import host_offload
from mcore.parallel.optimizer_state import check_loaded_state, loaded_casts, moment_dtypes
from mcore.parallel.optimizer_types import MasterPiece, StepResult, default_param_groups
from mcore.parallel.param_attrs import main_grad

__all__ = [
    "MixedPrecisionOptimizer",
    "StepResult",
    "default_param_groups",
]

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
_GROUP_KEYS = {"params", "weight_decay", "lr_mult"}


def _scalar_dtype(fused: bool) -> torch.dtype:
    # matches torch.optim's choice for the 'step' state, so a loaded state is indistinguishable from a fresh one
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class MixedPrecisionOptimizer:
    """AdamW on fp32 master copies of every parameter (replicated over dp).

    ``model_chunks``: the model (a module, typically the ``DistributedDataParallel`` wrapper) or its
    pipeline chunks; parameter names come from their ``named_parameters()``. ``param_groups``: dicts with
    ``params`` and optionally ``weight_decay`` and ``lr_mult`` (default: one group of every trainable
    parameter). ``clip_grad``: max global grad norm (0: no clipping). ``check_nonfinite``: skip steps whose
    gradient norm is inf/nan (one host sync per step; always on with a ``loss_scaler``). ``fused_step``:
    update with the fused ``mcore.kernels.adamw_step_`` (``True``) or with ``torch.optim.AdamW.step``
    (``False``); ``None`` picks the fused step on CUDA (see the module docstring). ``offload_fraction``: the share
    of the masters and moments kept in host memory and updated by the CPU (``offload_impl``: its AdamW, one of
    ``mcore.parallel.offload.HOST_ADAMW_IMPLS``; see ``mcore.parallel.offload``). ``exp_avg_dtype`` /
    ``exp_avg_sq_dtype``: the storage dtype of the two moments (fp32 or bf16; bf16 needs the fused step).
    """

    def __init__(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        param_groups: Sequence[dict] | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float = 0.0,
        loss_scaler: DynamicLossScaler | None = None,
        groups: ProcessGroups | None = None,
        check_nonfinite: bool = True,
        fused_step: bool | None = None,
        offload_fraction: float = 0.0,
        offload_impl: str | None = None,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        if not self.chunks or not all(isinstance(c, nn.Module) for c in self.chunks):
            raise TypeError("optimizer: model_chunks must be an nn.Module or a non-empty sequence of them")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("clip_grad", clip_grad)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"optimizer: {name} must be a finite number >= 0, got {value!r}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"optimizer: betas must be two numbers in [0, 1), got {betas!r}")
        if fused_step is not None and not isinstance(fused_step, bool):
            raise TypeError(f"optimizer: fused_step must be True, False or None (auto: CUDA), got {fused_step!r}")
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"optimizer: loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler)}")
        if type(self) is MixedPrecisionOptimizer:
            for i, c in enumerate(self.chunks):
                if isinstance(c, DistributedDataParallel) and c.use_distributed_optimizer:
                    raise ValueError(
                        f"MixedPrecisionOptimizer: model_chunks[{i}] reduce-scatters its gradients "
                        "(use_distributed_optimizer=True); use DistributedOptimizer with it"
                    )
        self.state_dtypes = {"master": torch.float32, **moment_dtypes(exp_avg_dtype, exp_avg_sq_dtype)}
        self.load_casts: list[str] = []  # what the last load_state_dict cast (one line per state kind)
        self.groups = groups or ProcessGroups.single()
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.check_nonfinite = check_nonfinite or loss_scaler is not None
        self.step_count = 0

        self.names: dict[nn.Parameter, str] = {}
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                self.names.setdefault(p, name)
        self._param_groups = self._normalize_groups(param_groups, weight_decay)
        params = [p for g in self._param_groups for p in g["params"]]
        self.device = params[0].device
        self._pieces = self._build_pieces()

        # torch's AdamW is fused on CUDA: that fixes the dtype and device of the 'step' state for both kinds of step
        self._fused = self.device.type == "cuda"
        self._fused_step = self._choose_fused_step(fused_step)
        # before the AdamW below takes the masters: the offloaded ones move to host memory
        self._offload = host_offload(self, offload_fraction, offload_impl)
        self._offloaded = frozenset(self._offload.indices) if self._offload is not None else frozenset()
        # the step count of each piece's state, mirrored on the host so that the fused step never reads it back
        self._piece_steps = [0] * len(self._pieces)
        self._adam = self._build_adam(lr, betas, eps)
        self._lr = lr

    # ---- construction ---------------------------------------------------------------------------------------

    def _low_precision_states(self) -> list[str]:
        """The states that are not fp32 (moments, gradient buffers): what only the fused step handles in place."""
        out = [f"{k}={str(d).removeprefix('torch.')}" for k, d in self.state_dtypes.items() if d != torch.float32]
        grads = {pc.grad_view.dtype for pc in self._pieces if pc.grad_view is not None} - {torch.float32}
        return out + [f"grad buffer={str(d).removeprefix('torch.')}" for d in sorted(grads, key=str)]

    def _choose_fused_step(self, fused_step: bool | None) -> bool:
        low = self._low_precision_states()
        if fused_step is None:  # CUDA, or states torch's AdamW would need fp32 copies of
            return self._fused or bool(low)
        if not fused_step and any(not s.startswith("grad buffer") for s in low):
            raise ValueError(
                f"optimizer: fused_step=False runs torch.optim.AdamW, which keeps its moments in the master's dtype "
                f"(fp32); {', '.join(low)} needs the fused step: pass fused_step=True or None"
            )
        return fused_step

    def _build_adam(self, lr: float, betas: tuple[float, float], eps: float) -> torch.optim.AdamW | None:
        """The AdamW holding the param groups and the state of every master (``None``: nothing on this rank)."""
        adam_groups = []
        self._adam_group_of: dict[int, int] = {}  # index in self._param_groups -> index in self._adam.param_groups
        for gi, g in enumerate(self._param_groups):
            masters = [pc.master for pc in self._pieces if pc.group_index == gi]
            if masters:
                self._adam_group_of[gi] = len(adam_groups)
                lr_mult = g.get("lr_mult", 1.0)
                adam_groups.append(
                    {"params": masters, "weight_decay": g["weight_decay"], "lr": lr * lr_mult, "lr_mult": lr_mult}
                )
        if not adam_groups:  # a rank whose shards hold no parameter (tiny model, large dp) has nothing to update
            return None
        fused = True if self._fused else None
        return torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps, fused=fused, foreach=None if fused else True)

    def _normalize_groups(self, param_groups: Sequence[dict] | None, weight_decay: float) -> list[dict]:
        if param_groups is None:
            param_groups = [{"params": [p for p in self.names if p.requires_grad]}]
        out, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"optimizer: param_groups[{i}] must be a dict with 'params', got {g!r}")
            unknown = set(g) - _GROUP_KEYS
            if unknown:
                raise ValueError(
                    f"optimizer: param_groups[{i}] has unknown keys {sorted(unknown)}; accepted: {sorted(_GROUP_KEYS)}"
                )
            params = list(g["params"])
            for p in params:
                if p not in self.names:
                    raise ValueError(
                        f"optimizer: param_groups[{i}] holds a parameter of shape {tuple(p.shape)} that is not in "
                        "model_chunks"
                    )
                if id(p) in seen:
                    raise ValueError(f"optimizer: parameter {self.names[p]!r} appears in more than one param group")
                if not p.is_contiguous():
                    raise ValueError(f"optimizer: parameter {self.names[p]!r} must be contiguous")
                seen.add(id(p))
            out.append(
                {
                    "params": params,
                    "weight_decay": float(g.get("weight_decay", weight_decay)),
                    "lr_mult": float(g.get("lr_mult", 1.0)),
                }
            )
        if not seen:
            raise ValueError("optimizer: no parameter to optimize (param_groups are empty)")
        return out

    def _group_index(self) -> dict[nn.Parameter, int]:
        return {p: gi for gi, g in enumerate(self._param_groups) for p in g["params"]}

    def _build_pieces(self) -> list[MasterPiece]:
        pieces = []
        for p, gi in self._group_index().items():
            flat = p.detach().view(-1)
            aliased = p.dtype == torch.float32
            master = flat if aliased else flat.float().clone()
            buffer = main_grad(p)
            grad_view = buffer.view(-1) if buffer is not None else None
            pieces.append(MasterPiece(p, self.names[p], 0, p.numel(), master, gi, aliased, grad_view))
        return pieces

    # ---- hooks for the sharded subclass -----------------------------------------------------------------------

    def _norm_dp_group(self):
        return None  # replicated gradients: every dp rank already holds the full, identical gradient

    def _norm_expert_groups(self):
        """Groups the expert parameters' squared norm is summed over (None: the model has none)."""
        if not any(getattr(p, "expert_parallel", False) for p in self.names):
            return None
        # replicated over expert dp after DDP's all-reduce; the sharded subclass adds expert dp
        return (self.groups.etp, self.groups.ep, self.groups.expert_dp if self._shards_over_dp else None)

    _shards_over_dp = False

    def _after_update(self) -> None:
        """Nothing to do: every rank updated its full parameters (the sharded subclass all-gathers here)."""

    def _load_params(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the model parameters from the loaded masters: every rank received the full tensors, so each sets
        its whole parameter without a gather."""
        for p in self._optimized_params():
            p.data.copy_(tensors[f"{self.names[p]}/master"].to(device=p.device, dtype=p.dtype))

    # ---- public API ---------------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner AdamW's param groups (``lr``, ``weight_decay``, ``lr_mult``; may be edited)."""
        return [] if self._adam is None else self._adam.param_groups

    @property
    def lr(self) -> float:
        return self._lr

    @property
    def fused_step(self) -> bool:
        """Whether ``step()`` runs the fused ``mcore.kernels.adamw_step_`` (fixed at construction)."""
        return self._fused_step

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group to ``lr * lr_mult``."""
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"set_lr: lr must be a finite number >= 0, got {lr!r}")
        self._lr = float(lr)
        for g in self.param_groups:
            g["lr"] = self._lr * g.get("lr_mult", 1.0)

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    def zero_grad(self) -> None:
        """Zero the DDP gradient buffers of the chunks and drop ``param.grad``."""
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
        for p in self.names:
            p.grad = None

    def _gradients(self, upcast: bool) -> list[torch.Tensor | None]:
        """Each piece's gradient (a flat view, or an fp32 copy when ``upcast`` and it is not fp32)."""
        grads = []
        for pc in self._pieces:
            if pc.grad_view is not None:
                g = pc.grad_view[pc.lo : pc.hi]
            elif pc.param.grad is not None:
                g = pc.param.grad.reshape(-1)[pc.lo : pc.hi]
            else:
                grads.append(None)  # unused parameter: AdamW skips it, as torch.optim would
                continue
            grads.append(g.float() if upcast else g)
        return grads

    @torch.no_grad()
    def step(self) -> StepResult:
        """Unscale, measure, (maybe) skip, clip, update; see the module docstring."""
        grads = self._gradients(upcast=not self._fused_step)
        # offloaded gradients are unscaled and clipped on the host (their device copy may still be read)
        present = [g for i, g in enumerate(grads) if g is not None and i not in self._offloaded]
        inv_scale = None if self.loss_scaler is None else 1.0 / self.loss_scaler.scale
        if inv_scale is not None and present and not self._fused_step:
            torch._foreach_mul_(present, inv_scale)
        norm = total_grad_norm(
            [(pc.param, g) for pc, g in zip(self._pieces, grads)],
            tp_group=self.groups.tp,
            pp_group=self.groups.pp,
            dp_group=self._norm_dp_group(),
            device=self.device,
            expert_groups=self._norm_expert_groups(),
            etp_group=self.groups.etp,
        )
        if inv_scale is not None and self._fused_step:
            norm = norm * inv_scale  # the gradients are still scaled: ||g / s|| = ||g|| / s
        if self.check_nonfinite and not bool(torch.isfinite(norm).item()):
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf=True)
            if self._offload is not None:
                self._offload.drop_pending()
            return StepResult(finite=False, grad_norm=norm, loss_scale=self._reported_scale())
        on_device = [None if i in self._offloaded else g for i, g in enumerate(grads)]
        if self._fused_step:
            self._fused_update(on_device, norm, inv_scale)
        else:
            self._torch_update(on_device, present, norm)
        if self._offload is not None:  # after the device update is queued: the GPU works while the CPU does
            self._offload.update(self, grads, norm, inv_scale)
        self._after_update()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        self.step_count += 1
        return StepResult(finite=True, grad_norm=norm, loss_scale=self._reported_scale())

    def _torch_update(self, grads: list[torch.Tensor | None], present: list[torch.Tensor], norm: torch.Tensor) -> None:
        if self.clip_grad > 0:
            clip_grads_(present, self.clip_grad, norm)
        for pc, g in zip(self._pieces, grads):
            pc.master.grad = g
        if self._adam is not None:
            self._adam.step()
        for i, pc in enumerate(self._pieces):
            pc.master.grad = None
            if not pc.aliased and i not in self._offloaded:
                pc.param.data.view(-1)[pc.lo : pc.hi].copy_(pc.master)

    def _fused_update(self, grads: list[torch.Tensor | None], norm: torch.Tensor, inv_scale: float | None) -> None:
        """One ``adamw_step_`` call per (param group, step count): clip and unscale folded into the update."""
        if self._adam is None:
            return
        multiplier = self._grad_multiplier(norm, inv_scale)
        # an unused parameter (no gradient) is skipped and keeps its step count, as torch.optim does
        calls: dict[tuple[int, int], list[int]] = {}
        for i, (pc, g) in enumerate(zip(self._pieces, grads)):
            if g is not None:
                calls.setdefault((self._adam_group_of[pc.group_index], self._piece_steps[i] + 1), []).append(i)
        for (ai, steps), indices in calls.items():
            group = self._adam.param_groups[ai]
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    f"optimizer: param group {ai} sets amsgrad={group.get('amsgrad')} "
                    f"maximize={group.get('maximize')}; the fused step implements plain AdamW "
                    "(construct with fused_step=False for these)"
                )
            pieces = [self._pieces[i] for i in indices]
            states = [self._state_of(pc.master) for pc in pieces]
            beta1, beta2 = group["betas"]
            adamw_step_(
                [pc.master for pc in pieces],
                [grads[i] for i in indices],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                steps=steps,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                grad_multiplier=multiplier,
                model_params=[None if pc.aliased else pc.param.data.view(-1)[pc.lo : pc.hi] for pc in pieces],
            )
            torch._foreach_add_([st["step"] for st in states], 1.0)
            for i in indices:
                self._piece_steps[i] = steps

    def _grad_multiplier(self, norm: torch.Tensor, inv_scale: float | None) -> torch.Tensor | None:
        """The fused step's gradient multiplier: clip coefficient times inverse loss scale (a device tensor)."""
        multiplier = clip_coefficient(self.clip_grad, norm) if self.clip_grad > 0 else None
        if inv_scale is not None:
            if multiplier is None:
                multiplier = torch.full((), inv_scale, dtype=torch.float32, device=self.device)
            else:
                multiplier = multiplier * inv_scale
        return multiplier

    def _step_tensor(self, value: int, device: torch.device) -> torch.Tensor:
        """A 'step' state entry as torch.optim.AdamW creates it (fp32 on the device when fused, else on the CPU).

        ``torch.full`` rather than ``torch.tensor``: a fill on the device, not a copy from pageable host memory."""
        device = device if self._fused else torch.device("cpu")
        return torch.full((), float(value), dtype=_scalar_dtype(self._fused), device=device)

    def _state_of(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The AdamW state of ``master``, created (zero moments, step 0) on first use as torch.optim does."""
        state = self._adam.state[master]
        if not state:
            state["step"] = self._step_tensor(0, master.device)
            for kind in ("exp_avg", "exp_avg_sq"):
                dtype = self.state_dtypes[kind]
                state[kind] = torch.zeros_like(master, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _reported_scale(self) -> float | None:
        return None if self.loss_scaler is None else self.loss_scaler.scale

    # ---- state ------------------------------------------------------------------------------------------------

    def _piece_state(self, pc: MasterPiece, kind: str) -> torch.Tensor:
        if kind == "master":
            return pc.master
        state = {} if self._adam is None else self._adam.state.get(pc.master, {})
        return state[kind] if kind in state else torch.zeros_like(pc.master, dtype=self.state_dtypes[kind])

    def _full_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        out = {}
        for pc in self._pieces:
            shape = pc.param.shape
            out[pc.param] = {k: self._piece_state(pc, k).detach().view(shape).clone() for k in STATE_KINDS}
        return out

    def state_dict(self) -> dict:
        """``{"step": int, "tensors": {"<name>/<kind>": TP-local full tensor}, "loss_scaler": dict | None}``; each
        tensor in its storage dtype (``state_dtypes``: fp32 masters, the moments as configured).

        Collective over the dp group for ``DistributedOptimizer`` (every dp rank must call it)."""
        tensors = {}
        for p, states in self._full_states().items():
            for kind, t in states.items():
                tensors[f"{self.names[p]}/{kind}"] = t
        return {
            "step": self.step_count,
            "tensors": tensors,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def _optimized_params(self) -> list[nn.Parameter]:
        return [p for g in self._param_groups for p in g["params"]]

    @torch.no_grad()
    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a ``state_dict()`` saved at any dp size; also sets the model parameters from the masters."""
        names = {self.names[p]: tuple(p.shape) for p in self._optimized_params()}
        tensors = check_loaded_state(state, names, STATE_KINDS, strict)
        step = int(state["step"])
        self.load_casts = loaded_casts(tensors, self.state_dtypes)
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.finish_param_sync()  # a gather still in flight would overwrite what is loaded here
        for pc in self._pieces:
            full = {k: tensors[f"{pc.name}/{k}"].reshape(-1)[pc.lo : pc.hi] for k in STATE_KINDS}
            pc.master.copy_(full["master"])
            if self._adam is not None:
                device = pc.master.device  # the host for offloaded pieces
                self._adam.state[pc.master] = {
                    "step": self._step_tensor(step, device),
                    **{
                        k: full[k].to(device=device, dtype=self.state_dtypes[k]).clone()
                        for k in ("exp_avg", "exp_avg_sq")
                    },
                }
        self._load_params(tensors)
        self._piece_steps = [step] * len(self._pieces)
        self.step_count = step
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
