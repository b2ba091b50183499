"""Save and load the full training state of a :class:`~mcore.train.trainer.Trainer` in the mcore format.

Saving is collective: every rank snapshots its state (the distributed optimizer gathers its shards over
dp), the dp-rank-0 replica of each (tp, pp) position writes ``model/`` and ``optim/`` shards, every rank
writes its RNG states, and global rank 0 writes ``metadata.json`` and ``train_state.json`` and commits the
directory (see :mod:`mcore.train.checkpoint.directory`). With ``async_save`` the files are written by a
background thread from CPU copies taken at the save step, and the commit happens at a later step once
every rank has finished writing.

Loading works at any tp/pp/dp: each parameter's slice (and each optimizer state's) is read through
:meth:`CheckpointReader.read_local`, which reshards from whatever layout the checkpoint was saved at.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mcore.parallel.fsdp import full_tensor
from mcore.parallel.random import get_rng_tracker
from mcore.train.checkpoint.directory import CheckpointDirectory
from mcore.train.checkpoint.experts import expert_tp, full_expert_meta, gather_experts, saved_unsplit_over_etp
from mcore.train.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    TRAIN_STATE_FILE,
    Layout,
    rng_file,
    shard_file,
    tensor_meta_of,
    write_json_atomic,
)
from mcore.train.checkpoint.hf_assets import write_hf_assets
from mcore.train.checkpoint.model_weights import read_param
from mcore.train.checkpoint.reader import CheckpointReader
from mcore.train.errors import CheckpointError
from mcore.train.trainer import Trainer

OPTIM_KINDS = ("master", "exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------------------------------------ helpers
def _rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    for stream, state in get_rng_tracker().get_states().items():
        for key, tensor in state.items():
            out[f"tracker/{stream}/{key}"] = tensor.cpu()
    return out


def _restore_rng(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"], device)
    streams: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key.startswith("tracker/"):
            _, stream, inner = key.split("/", 2)
            streams.setdefault(stream, {})[inner] = tensor
    if streams:
        get_rng_tracker().set_states(streams)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write one safetensors file (a separate function so that fault-injection tests can intercept it)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def layout_of(trainer: Trainer) -> Layout:
    g = trainer.groups
    return Layout(tp=g.tp_size, pp=g.pp_size, vpp=trainer.config.parallel.vpp, dp=g.dp_size)


# ------------------------------------------------------------------------------------------------ loading
@torch.no_grad()
def load_training_state(
    trainer: Trainer, reader: CheckpointReader, *, load_optimizer: bool = True, load_rng: bool = True
) -> list[str]:
    """Restore optimizer, step, data position and RNG from a full checkpoint; return notes to print."""
    notes: list[str] = []
    state = reader.train_state
    if state is None or not reader.has_optimizer_state:
        raise CheckpointError(f"checkpoint {reader.path} holds no training state (a model-only checkpoint)")
    for key in ("iteration", "consumed_samples", "optimizer"):
        if key not in state:
            raise CheckpointError(f"{reader.path / TRAIN_STATE_FILE} is corrupt: key '{key}' is missing")
    restored: dict[str, Any] = {"iteration": state["iteration"], "consumed_samples": state["consumed_samples"]}
    if load_optimizer and trainer.has_optimizer:
        tensors = {}
        for name, param, _ in trainer.named_local_parameters():
            for kind in OPTIM_KINDS:
                key = f"{name}/{kind}"
                # masters in fp32; moments as saved (fp32 or bf16): the optimizer casts them to its own dtypes
                dtype = torch.float32 if kind == "master" else None
                tensors[key] = read_param(reader, name, param, trainer.groups, kind="optim", key=key, dtype=dtype)
        optim = state["optimizer"]
        scaler = optim.get("loss_scaler")
        restored["optimizer"] = {"step": int(optim["step"]), "tensors": tensors, "loss_scaler": scaler}
    else:
        notes.append("optimizer state not loaded (checkpoint.load_optimizer=false)")
    trainer.load_state_dict(restored)
    casts = trainer.optimizer.load_casts if "optimizer" in restored else []
    if casts:
        notes.append(
            f"optimizer moments cast on load ({'; '.join(casts)}): the checkpoint was saved with other "
            "optim.exp_avg_dtype / optim.exp_avg_sq_dtype"
        )
    same_layout = reader.layout == layout_of(trainer)
    if load_rng and same_layout:
        tensors = reader.rng_state(trainer.runtime.rank)
        if tensors is None:
            notes.append(f"no RNG state for rank {trainer.runtime.rank}; RNG streams start fresh")
        else:
            _restore_rng(tensors, trainer.device)
    elif load_rng:
        notes.append(
            f"checkpoint layout {reader.layout.to_dict()} differs from this run's {layout_of(trainer).to_dict()}: "
            f"weights and optimizer were resharded, RNG streams start fresh"
        )
    return notes


# ------------------------------------------------------------------------------------------------ saving
@dataclass
class _Snapshot:
    iteration: int
    temp_dir: Path
    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    metadata: dict[str, Any] | None  # rank 0 only
    train_state: dict[str, Any] | None  # rank 0 only
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CheckpointSaver:
    """Writes checkpoints of a :class:`Trainer` into ``directory``, synchronously or in the background.

    ``save`` is collective. With ``async_save`` it returns once the state is copied to CPU; call
    :meth:`poll` once per step on every rank (it commits a finished save) and :meth:`wait` before exiting.

    ``hf_assets`` (from :func:`~mcore.train.checkpoint.hf_assets.read_hf_assets` of the checkpoint the run
    started from) is written into every checkpoint's ``hf/`` by global rank 0; other ranks may pass None.
    """

    def __init__(
        self,
        trainer: Trainer,
        directory: CheckpointDirectory,
        *,
        keep_last: int,
        async_save: bool,
        hf_assets: dict[str, bytes] | None = None,
    ) -> None:
        self.trainer = trainer
        self.directory = directory
        self.keep_last = keep_last
        self.async_save = async_save
        self.hf_assets = hf_assets
        self._pending: _Snapshot | None = None
        self._thread: threading.Thread | None = None
        self.last_committed: Path | None = directory.latest()

    # ---- public
    def save(self, train_config: dict[str, Any] | None, extra_state: dict[str, Any] | None = None) -> None:
        """Snapshot the trainer's state now and write it (in the background with ``async_save``)."""
        self.wait()
        snap = self._snapshot(train_config, extra_state or {})
        if self.async_save:
            self._pending = snap
            self._thread = threading.Thread(target=self._write, args=(snap,), name="mcore-ckpt-writer", daemon=True)
            self._thread.start()
        else:
            self._write(snap)
            self._pending = snap
            self._finish(blocking=True)

    def poll(self) -> Path | None:
        """Commit a background save if every rank has finished writing it; returns the committed path."""
        if self._pending is None:
            return None
        return self._finish(blocking=False)

    def wait(self) -> Path | None:
        """Block until a pending save is written and committed."""
        if self._pending is None:
            return None
        return self._finish(blocking=True)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    # ---- internals
    def _snapshot(self, train_config: dict[str, Any] | None, extra_state: dict[str, Any]) -> _Snapshot:
        trainer = self.trainer
        rt, g = trainer.runtime, trainer.groups
        if not trainer.has_optimizer:
            raise RuntimeError("cannot save a training checkpoint of a Trainer without optimizer")
        state = trainer.state_dict()  # collective for the distributed optimizer
        opt_state, params = state["optimizer"], state["model"]
        writer = g.dp_rank == 0 and g.cp_rank == 0  # one writer per (tp, pp) shard: CP ranks are replicas
        # a fully sharded (dp_shard) parameter is all-gathered over dp here, on every rank (collective); an expert-
        # parallel one over ep (collective too), so that the file holds every expert whatever the ep. One tensor at a
        # time: the device holds at most one gathered copy beside the live state.
        model, optim = {}, {}

        def writes(p) -> bool:  # an expert weight gathered over etp goes into the tp-rank-0 file only
            return writer and (g.tp_rank == 0 or not saved_unsplit_over_etp(p, g))

        for n, p in params.items():
            whole = gather_experts(full_tensor(p.detach()), p, g)
            if writes(p):
                model[n] = whole.to("cpu", copy=True)
            del whole
        for key, tensor in opt_state["tensors"].items():
            name = key.rsplit("/", 1)[0]
            if name in params:
                tensor = gather_experts(tensor, params[name], g)
                if writes(params[name]):
                    optim[key] = tensor.detach().to("cpu", copy=True)
        metas = {n: full_expert_meta(tensor_meta_of(p, expert_tp(p, g)[0]), p, g).to_dict() for n, p in params.items()}
        token = uuid.uuid4().hex[:12]
        if rt.distributed:
            gathered: list[Any] = [None] * rt.world_size
            dist.all_gather_object(gathered, metas, group=rt.control_group)
            merged: dict[str, Any] = {}
            for part in gathered:
                merged.update(part)
            box = [token]
            dist.broadcast_object_list(box, src=0, group=rt.control_group)
            token = box[0]
        else:
            merged = metas
        iteration = state["iteration"]
        metadata = train_state = None
        if rt.rank == 0:
            layout = layout_of(trainer)
            order = sorted(merged, key=_name_order)
            metadata = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "iteration": iteration,
                "layout": layout.to_dict(),
                "model_config": trainer.config.model.to_dict(),
                "train_config": train_config,
                "tensors": {n: merged[n] for n in order},
            }
            train_state = {
                "iteration": iteration,
                "consumed_samples": state["consumed_samples"],
                "optimizer": {"step": opt_state["step"], "loss_scaler": opt_state.get("loss_scaler")},
                "lr": state["lr"],
                "world_size": rt.world_size,
                **extra_state,
            }
        return _Snapshot(
            iteration=iteration,
            temp_dir=self.directory.new_temp_dir(iteration, token),
            model=model,
            optim=optim,
            rng=_rng_tensors(trainer.device),
            metadata=metadata,
            train_state=train_state,
        )

    def _write(self, snap: _Snapshot) -> None:
        try:
            g, rank = self.trainer.groups, self.trainer.runtime.rank
            for sub in ("model", "optim", "rng"):
                (snap.temp_dir / sub).mkdir(parents=True, exist_ok=True)
            if snap.model:
                _save_shard(snap.model, snap.temp_dir / shard_file("model", g.tp_rank, g.pp_rank))
                _save_shard(snap.optim, snap.temp_dir / shard_file("optim", g.tp_rank, g.pp_rank))
            _save_shard(snap.rng, snap.temp_dir / rng_file(rank))
            if rank == 0 and self.hf_assets:
                write_hf_assets(self.hf_assets, snap.temp_dir)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank at commit time
            snap.error = exc
        finally:
            snap.done.set()

    def _finish(self, *, blocking: bool) -> Path | None:
        snap = self._pending
        if snap is None:
            raise RuntimeError("no checkpoint save is pending")
        rt = self.trainer.runtime
        if blocking and self._thread is not None:
            self._thread.join()
        status = torch.tensor([0.0 if snap.done.is_set() else 1.0, 1.0 if snap.error else 0.0])
        if rt.distributed:
            dist.all_reduce(status, group=rt.control_group)
        if status[0] > 0:
            return None  # some rank is still writing: try again at the next step
        self._pending = None
        self._thread = None
        if status[1] > 0:
            mine = f": {snap.error!r}" if snap.error else ""
            raise CheckpointError(
                f"saving checkpoint {snap.temp_dir.name} failed on {int(status[1])} rank(s){mine}; the previous "
                f"checkpoint ({self.last_committed or 'none'}) is untouched"
            )
        final = self.directory.final_dir(snap.iteration)
        if rt.rank == 0 and snap.metadata is not None and snap.train_state is not None:
            write_json_atomic(snap.temp_dir / TRAIN_STATE_FILE, snap.train_state)
            write_json_atomic(snap.temp_dir / METADATA_FILE, snap.metadata)
            final = self.directory.commit(snap.temp_dir, snap.iteration, keep_last=self.keep_last)
        if rt.distributed:
            dist.barrier(group=rt.control_group)
        self.last_committed = final
        return final


def _name_order(name: str) -> tuple:
    """Sort key giving embedding, layers in numeric order, then the rest."""
    parts = name.split(".")
    if parts[0] == "embedding":
        return (0, 0, name)
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]), name)
    return (2, 0, name)
