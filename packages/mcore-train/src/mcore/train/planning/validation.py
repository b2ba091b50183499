"""The planner against our measurements: every timed configuration of ``docs/performance.md``, from the raw JSON.

Read: the single-GPU throughput runs (``throughput-h200-*/mcore_<shape>.json``: 1b, 8b4l, before and after the
per-layer-parts refactor), the two-GPU runs (``multi-gpu-*/results.json``: every layout of the table, 8b4l), the
single-GPU MoE runs (``moe-h200-*/mcore_<shape>.json``: mixtral2l, qwen3moe4l) and the single-GPU memory-mode runs
(``memory_modes.py``'s summaries: ZeRO-1, ``dp_shard`` at world size 1, optimizer and activation offload) and
the hybrid Nemotron-H steps (``ssm_throughput.py``'s training records: ZeRO-1, FSDP2 with the Mamba core
recomputed). Not
read: the fp32 smoke runs (a host-bound model, no speed measurement), runs of superseded code (``before-fusion-*``,
``SUPERSEDED_MOE_RUNS``), the attention and FP8 kernel benchmarks (kernels alone, no training step: ``kernel_rates``
checks the calibration against them) and the low-precision GPU training runs (stopped before any timing). Each
case gives the model shape, the layout exactly as run, the measured median step time and the measured peak memory
per rank (``torch.cuda.max_memory_allocated``, compared with the plan's ``allocated``: no runtime allowance or
margin).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mcore.models.families import get_config
from mcore.models.families.gpt_oss import alternating_layer_types
from mcore.train.planning.cluster import Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import GB, stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import predict_step

THROUGHPUT_RUNS = "throughput-h200-"
MOE_RUNS = "moe-h200-"
# the MoE records: moe-h200-<run>/mcore_<shape>.json, and later calls' moe-<shapes>-h200-<run>/<shape>/mcore_*.json
# and the helper calls' moe branch records, one per variant (helpers-h200-<run>/moe/mcore-<variant>_<shape>.json:
# ``--expert-gemm per_expert``, ``--fsdp``)
MOE_RUN_FILES = (f"{MOE_RUNS}*/mcore_*.json", "moe-*-h200-*/*/mcore_*.json", "helpers-h200-*/moe/mcore-*_*.json")
GPT_OSS_WINDOW = 128
# MoE runs of code rewritten since: the permutes (Triton tiles) and the grouped GEMM's output zeroing changed at
# the moe branch's 4d34bbc / 1904bee; the calibration describes the code after them (moe-h200-2026-12-01-e21cc44)
SUPERSEDED_MOE_RUNS = ("moe-h200-2026-12-01",)
MULTI_GPU_RUNS = "multi-gpu-h200-2026-11-30-rerun"
# benchmarks/memory_modes.py's summaries: the probe call (activation offload), the two final calls of 2026-12-01 and
# the later runs of their own directory (memory-<part>-h200-<date>-<session>)
MEMORY_MODE_RUNS = (
    "probe-h200-*/memory_modes/summary.json",
    "final-h200-*/call*/mm*/summary.json",
    "memory-*-h200-*/summary.json",
)
# benchmarks/ssm_throughput.py's training records: a hybrid preset through the real Trainer, one GPU
SSM_RUN_FILES = "helpers-h200-*/ssm/mcore_*.json"
SCHEDULES = {"none": "none", "1f1b": "1f1b", "interleaved-1f1b": "interleaved", "zb-h1": "zero-bubble"}
# benchmarks/_common.py's 8b4l: the Llama-3-8B layer shape with 4 layers (the two-GPU runs record only its size)
SHAPE_8B4L = {"hidden": 4096, "layers": 4, "heads": 32, "kv": 8, "ffn": 14336, "vocab": 128256}


@dataclass(frozen=True)
class Case:
    """One measured run and what the planner says of it."""

    name: str
    shape: ModelShape
    layout: Layout
    measured_step_s: float
    measured_peak_gb: tuple[float, ...]  # per pipeline rank (first rank of each stage)

    def predicted(self, network: Network) -> tuple[float, tuple[float, ...]]:
        """(step seconds, allocated GB per pipeline rank)."""
        step = predict_step(self.shape, self.layout, network).step_s
        return step, tuple(s.allocated / GB for s in stage_memory(self.shape, self.layout))


def _shape(fields: dict, name: str) -> ModelShape:
    heads = fields["heads"]
    return ModelShape(
        hidden=fields["hidden"], ffn=fields["ffn"], layers=fields["layers"], heads=heads, kv_heads=fields["kv"],
        head_dim=fields["hidden"] // heads, vocab=fields["vocab"], name=name,
    )  # fmt: skip


def throughput_cases(results: Path) -> list[Case]:
    """The single-GPU runs (every ``throughput-h200-*`` directory): one micro-batch per step, distributed optimizer
    at dp=1."""
    out = []
    for path in sorted(results.glob(f"{THROUGHPUT_RUNS}*/mcore_*.json")):
        run = path.parent.name.removeprefix(THROUGHPUT_RUNS)
        r = json.loads(path.read_text())
        shape = _shape(r, r["shape"])
        if shape.total_parameters() != r["params"]:
            raise ValueError(f"{path}: shape {r['shape']} has {shape.total_parameters()} parameters, run {r['params']}")
        layout = Layout(micro_batch=r["mbs"], global_batch=r["mbs"], seq_length=r["seq"], distributed_optimizer=True)
        out.append(Case(f"{r['shape']} (1 GPU, {run})", shape, layout, r["step_s"], (r["peak_mem_gb"],)))
    return out


def multi_gpu_cases(results: Path) -> list[Case]:
    """The two-GPU table (and its one-GPU references), 8b4l."""
    data = json.loads((results / MULTI_GPU_RUNS / "results.json").read_text())
    shape = _shape(SHAPE_8B4L, "8b4l")
    out = []
    for name, r in data["configs"].items():
        if shape.total_parameters() != r["params"]:
            raise ValueError(f"{name}: 8b4l has {shape.total_parameters()} parameters, the run {r['params']}")
        lay = r["layout"]
        custom = r["layers_per_stage"]
        layout = Layout(
            tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], vpp=lay["vpp"], micro_batch=r["micro_batch_size"],
            global_batch=r["global_batch_size"], seq_length=r["seq_length"],
            sequence_parallel=r["sequence_parallel"], schedule=SCHEDULES[r["schedule"]],
            distributed_optimizer=r["distributed_optimizer"], overlap_grad_reduce=r["overlap_grad_reduce"],
            overlap_param_gather=r["overlap_param_gather"], pipeline_layout=tuple(custom) if custom else None,
        )  # fmt: skip
        per_rank = r["peak_mem_gb_per_rank"]
        stages = per_rank[:: max(1, len(per_rank) // lay["pp"])][: lay["pp"]] if lay["pp"] > 1 else per_rank[:1]
        out.append(Case(f"{name} ({r['world_size']} GPU)", shape, layout, r["step_s"], tuple(stages)))
    return out


def _sliding_layers(layers: int) -> tuple[bool, ...]:
    return tuple(t == "sliding_attention" for t in alternating_layer_types(layers))


def _moe_shape(r: dict) -> ModelShape:
    """The shape of a ``moe_throughput.py`` record: every layer routed, no shared expert; GPT-OSS's layers alternate
    a sliding window of 128 (``benchmarks/gpt_oss_bench.py``, as gpt-oss-20b) with full attention and carry its
    biases and sinks."""
    gpt_oss = r["family"] == "gpt_oss"
    mla = r["family"] == "deepseek_v3"  # MLA without q-LoRA, shared experts, dense first layers (moonlight8l)
    shape = ModelShape(
        hidden=r["hidden"], ffn=r.get("dense_ffn", r["moe_ffn"]), layers=r["layers"], heads=r["heads"],
        kv_heads=r["kv"], head_dim=r["qk_nope"] if mla else r["head_dim"], vocab=r["vocab"],
        num_experts=r["experts"], top_k=r["topk"], moe_ffn=r["moe_ffn"], qk_norm=r["family"] == "qwen3_moe",
        name=r["shape"],
        attention_bias=gpt_oss, proj_bias=gpt_oss, expert_bias=gpt_oss, sinks=gpt_oss,
        window=GPT_OSS_WINDOW if gpt_oss else 0,
        window_layers=_sliding_layers(r["layers"]) if gpt_oss else None,
        **(_mla_fields(r) if mla else {}),
    )  # fmt: skip
    if shape.total_parameters() != r["params"]:
        raise ValueError(f"MoE shape {r['shape']} has {shape.total_parameters()} parameters, the run {r['params']}")
    return shape


def _mla_fields(r: dict) -> dict:
    """A DeepSeek-V3-architecture record's MLA and shared-expert fields as the planner's (its ``head_dim`` is set
    to the no-rope part, ``qk_nope``, the planner's convention under MLA)."""
    return dict(
        kv_lora_rank=r["kv_lora"],
        qk_rope_head_dim=r["qk_rope"],
        v_head_dim=r["v_head"],
        shared_ffn=r["shared"] * r["moe_ffn"],
        first_dense_layers=r["first_dense"],
    )


def _moe_layout(r: dict) -> Layout:
    """One GPU, one micro-batch per step: ZeRO-1 at dp=1, or FSDP2 (``impl`` mcore-fsdp: moe_throughput's
    FSDP_OVERRIDES, parameters resharded after forward, its default); the expert GEMMs as recorded."""
    fsdp = r["impl"] == "mcore-fsdp"
    return Layout(
        micro_batch=r["mbs"], global_batch=r["mbs"], seq_length=r["seq"], distributed_optimizer=not fsdp,
        dp_shard=fsdp, expert_gemm=r.get("expert_gemm", "grouped"),
    )  # fmt: skip


def moe_cases(results: Path) -> list[Case]:
    """The single-GPU MoE runs (``benchmarks/moe_throughput.py``): one micro-batch per step, the distributed
    optimizer at dp=1."""
    out = []
    for path in sorted(p for pattern in MOE_RUN_FILES for p in results.glob(pattern)):
        top = path.relative_to(results).parts[0]
        if top in SUPERSEDED_MOE_RUNS:
            continue
        r = json.loads(path.read_text())
        shape = _moe_shape(r)
        run = top.removeprefix(MOE_RUNS).removeprefix("moe-")
        variant = r["impl"].removeprefix("mcore").lstrip("-")
        name = f"{r['shape']}{' ' + variant if variant else ''} (1 GPU, MoE, {run})"
        out.append(Case(name, shape, _moe_layout(r), r["step_s"], (r["peak_mem_gb"],)))
    return out


def _overrides(run: dict) -> dict[str, str]:
    """The run's ``key=value`` overrides, the last of a key winning (as ``load_config`` reads them)."""
    return dict(o.split("=", 1) for o in run["overrides"])


def _memory_mode_shape(params: int) -> ModelShape:
    """``benchmarks/memory_modes.py`` runs 8b4l and the full Llama-3-8B; the records give their size."""
    shapes = [_shape(SHAPE_8B4L, "8b4l"), ModelShape.from_config(get_config("llama3-8b"), name="llama3-8b")]
    for shape in shapes:
        if shape.total_parameters() == params:
            return shape
    raise ValueError(f"memory-mode run of {params} parameters: neither 8b4l nor llama3-8b")


def memory_mode_cases(results: Path) -> list[Case]:
    """The single-GPU memory-mode runs (``benchmarks/memory_modes.py``): ZeRO-1, ``dp_shard`` at world size 1,
    optimizer offload (8b4l, the full Llama-3-8B), activation offload; each with the layout its overrides set."""
    out = []
    for path in sorted(p for pattern in MEMORY_MODE_RUNS for p in results.glob(pattern)):
        run_dir = path.parent.relative_to(results).parts
        where = "/".join(run_dir[:2]) if run_dir[0].startswith("final-") else run_dir[0]
        for name, r in json.loads(path.read_text())["results"].items():
            if r is None or r.get("impl") != "mcore":
                continue
            o = _overrides(r)
            parts = o.get("train.activation_offload", "[]").strip("[]")
            layout = Layout(
                micro_batch=r["micro_batch_size"], global_batch=r["global_batch_size"], seq_length=r["seq_length"],
                distributed_optimizer=r["distributed_optimizer"], dp_shard=o.get("parallel.dp_shard") == "true",
                optimizer_offload_fraction=float(o.get("optim.offload_fraction", 0.0)),
                overlap_grad_reduce=r["overlap_grad_reduce"], overlap_param_gather=r["overlap_param_gather"],
                recompute=o.get("train.recompute", "none"),
                activation_offload=tuple(p.strip() for p in parts.split(",") if p.strip()),
            )  # fmt: skip
            shape = _memory_mode_shape(r["params"])
            out.append(Case(f"{name} (1 GPU, {where})", shape, layout, r["step_s"], (r["peak_mem_gb"],)))
    return out


def ssm_cases(results: Path) -> list[Case]:
    """The hybrid (Nemotron-H) training steps of ``benchmarks/ssm_throughput.py``: the preset's shape, one
    sequence per step, the layout its overrides set (ZeRO-1 at dp=1, or ``dp_shard`` with selective recompute)."""
    out = []
    for path in sorted(results.glob(SSM_RUN_FILES)):
        r = json.loads(path.read_text())
        shape = ModelShape.from_config(get_config(r["preset"]), name=r["preset"])
        if shape.total_parameters() != r["params"]:
            raise ValueError(f"{path}: {r['preset']} has {shape.total_parameters()} parameters, the run {r['params']}")
        o = {k: v for k, v in (x.split("=", 1) for x in r["overrides"])}
        dp_shard = o.get("parallel.dp_shard") == "true"
        layout = Layout(
            micro_batch=1, global_batch=1, seq_length=r["seq"], dp_shard=dp_shard,
            distributed_optimizer=o.get("parallel.distributed_optimizer") == "true",
            recompute=o.get("train.recompute", "none"),
        )  # fmt: skip
        if round(r["tokens_per_s"] * r["step_s"]) != r["seq"]:
            raise ValueError(f"{path}: not one sequence of {r['seq']} tokens per step")
        run = path.parent.parent.name
        out.append(Case(f"{r['preset']} {r['config']} (1 GPU, {run})", shape, layout, r["step_s"], (r["peak_mem_gb"],)))
    return out


def measured_cases(results: Path) -> list[Case]:
    return (
        throughput_cases(results)
        + multi_gpu_cases(results)
        + moe_cases(results)
        + memory_mode_cases(results)
        + ssm_cases(results)
    )
