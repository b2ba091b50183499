"""A cluster: GPUs per node, the network between nodes, and the time of each collective on a process group.

Ranks are laid out as Megatron-Core orders them, ``tp-cp-ep-dp-pp`` (tensor parallel innermost, so that it stays
inside a node): a group of ``n`` ranks whose members are ``stride`` ranks apart has ``min(n, gpus_per_node //
stride)`` members per node. Inside a node a collective runs at the calibration's NVLink bus bandwidth for its
message size; across nodes a ring collective is bounded by the NICs its members use: with ``g`` members per node,
``g x (NICs x NIC speed / GPUs per node) x network_efficiency``, and pays ``network_latency_us`` per ring step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mcore.train.errors import UserError
from mcore.train.planning.calibration import Calibration, load_calibration


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs of one calibrated model, joined by ``nics_per_node`` NICs of ``nic_gbit``."""

    name: str
    calibration: str
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbit: float = 400.0
    network_efficiency: float = 0.8
    network_latency_us: float = 8.0

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nics_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"cluster {self.name}: {key} must be >= 1, got {getattr(self, key)}")
        if self.nic_gbit <= 0 or not 0 < self.network_efficiency <= 1:
            raise ValueError(f"cluster {self.name}: nic_gbit must be > 0 and network_efficiency in (0, 1]")

    @property
    def nic_gbps_per_gpu(self) -> float:
        """Network GB/s one GPU gets when every GPU of the node sends at once."""
        return self.nics_per_node * self.nic_gbit / 8 / self.gpus_per_node * self.network_efficiency

    def gpu(self) -> Calibration:
        return load_calibration(self.calibration)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # DGX H100: 8 H100 SXM on NVLink 4 / NVSwitch, 8 ConnectX-7 NDR 400 Gb/s compute NICs (one per GPU)
    "dgx-h100": Cluster("dgx-h100", "h100-sxm", gpus_per_node=8, nics_per_node=8, nic_gbit=400.0),
    # an HGX H200 node: the same NVLink 4 fabric and NICs, H200 GPUs (141 GB, 4.8 TB/s)
    "h200-node": Cluster("h200-node", "h200-sxm", gpus_per_node=8, nics_per_node=8, nic_gbit=400.0),
}


def load_cluster(name_or_path: str) -> Cluster:
    """A preset (``dgx-h100``, ``h200-node``) or a JSON file with :class:`Cluster`'s fields."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.suffix:
        raise UserError(f"unknown cluster {name_or_path!r}; presets: {sorted(PRESETS)} or a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Cluster(**data)
    except FileNotFoundError:
        raise UserError(f"cluster file not found: {path}") from None
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise UserError(f"invalid cluster file {path}: {exc}") from None


@dataclass(frozen=True)
class Group:
    """``size`` ranks, ``stride`` apart in the global rank order."""

    size: int
    stride: int

    def per_node(self, gpus_per_node: int) -> int:
        return max(1, min(self.size, gpus_per_node // max(1, self.stride)))


class Network:
    """Collective times (seconds) on a cluster; ``nbytes`` is NCCL's size (the whole buffer)."""

    def __init__(self, cluster: Cluster, gpu: Calibration | None = None) -> None:
        self.cluster = cluster
        self.gpu = gpu or cluster.gpu()

    def _busbw(self, collective: str, group: Group, nbytes: float) -> tuple[float, bool]:
        intra = self.gpu.nvlink_busbw(collective, nbytes)
        per_node = group.per_node(self.cluster.gpus_per_node)
        if group.size <= per_node:
            return intra, False
        return min(intra, per_node * self.cluster.nic_gbps_per_gpu), True

    def _latency(self, steps: int, crosses: bool) -> float:
        per_step = self.cluster.network_latency_us if crosses else self.gpu.nvlink_latency_us / 2
        return steps * per_step * 1e-6

    def collective(self, kind: str, group: Group, nbytes: float) -> float:
        """Time of ``kind`` (all_reduce, all_gather, reduce_scatter, all_to_all) of ``nbytes`` over ``group``."""
        n = group.size
        if n == 1 or nbytes <= 0:
            return 0.0
        busbw, crosses = self._busbw(kind, group, nbytes)
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        if kind == "all_to_all" and crosses:
            # the share leaving the node goes through this GPU's NIC share; the rest over NVLink
            per_node = group.per_node(self.cluster.gpus_per_node)
            out = nbytes * (n - per_node) / n / (self.cluster.nic_gbps_per_gpu * 1e9)
            inside = nbytes * (per_node - 1) / n / (self.gpu.nvlink_busbw(kind, nbytes) * 1e9)
            return max(out, inside) + self._latency(2, True)
        return nbytes * factor / (busbw * 1e9) + self._latency(steps, crosses)

    def p2p(self, nbytes: float, crosses_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        if crosses_node:
            return nbytes / (self.cluster.nic_gbps_per_gpu * 1e9) + self._latency(1, True)
        return nbytes / (self.gpu.nvlink_busbw("p2p", nbytes) * 1e9) + self._latency(1, False)
