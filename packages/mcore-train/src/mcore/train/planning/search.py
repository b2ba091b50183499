"""Enumerate the layouts of a model on N GPUs, keep those that fit, rank them by predicted tokens/s.

Sizes tried: ``tp`` powers of two up to a node, ``cp`` powers of two up to a node / tp (each with the p2p ring and
the a2a ``cp_comm_type``), ``pp`` any divisor of the
rest (balanced uneven layouts where the layers do not divide), ``vpp`` the divisors of the layers per stage
(interleaved), ``ep`` every divisor of the experts (MoE; those the grid cannot hold are refused with their
reason), ``etp`` 1 or tp, ``dp`` what remains, micro-batch sizes
dividing the per-rank batch. For each such layout two families of memory modes are tried, each from the fastest
to the most frugal (no recompute, selective, full): ZeRO-1 (the distributed optimizer), ZeRO-3 (``dp_shard``) and
ZeRO-1 with half the optimizer offloaded (no recompute, selective); the fastest of the first fits is kept, and full
recompute with offload only when none fits. Every layout that cannot
run is kept too, with its reasons: sizes that do not divide (``Layout.problems``) or memory that does not fit
(the smallest need and the GB available).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, replace

from mcore.parallel.pipeline import balanced_layout
from mcore.train.planning.cluster import Network
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import GB, stage_memory
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import StepPrediction, predict_step

EXACT_TOP = 16  # layouts re-ranked with the exact schedule replay
# what base_layouts does not enumerate, said with every search (a layout left out is named, not skipped silently)
NOT_ENUMERATED = (
    "not enumerated: tp or cp that are not powers of two or span more than a node, micro-batches other than "
    "1, 2, 4, 8, etp other than 1 and tp, cp_comm_type all_gather and a2a+p2p, other memory modes than those tried"
)
CP_SEARCHED = ("p2p", "a2a")  # the ring and Ulysses; all_gather holds the whole K/V, a2a+p2p mixes the two
ZERO3 = {"dp_shard": True, "distributed_optimizer": False, "overlap_param_gather": False}
# Families of memory modes, each from the fastest to the most frugal: the first that fits in each family competes
HALF_OFFLOAD = {"optimizer_offload_fraction": 0.5}
MEMORY_MODES = (
    ({"recompute": "none"}, {"recompute": "selective"}, {"recompute": "full"}),
    ({**ZERO3, "recompute": "none"}, {**ZERO3, "recompute": "selective"}, {**ZERO3, "recompute": "full"}),
    # one host step per optimizer step against a forward per micro-batch: with many micro-batches the cheaper
    ({**HALF_OFFLOAD, "recompute": "none"}, {**HALF_OFFLOAD, "recompute": "selective"}),
)
LAST_RESORT = (
    {"recompute": "full", "optimizer_offload_fraction": 0.5},
    {"recompute": "full", "optimizer_offload_fraction": 1.0},
)


@dataclass(frozen=True)
class Candidate:
    """One layout: its prediction when it runs, else why not."""

    layout: Layout
    prediction: StepPrediction | None
    memory_gb: float
    reasons: tuple[str, ...] = ()

    @property
    def runs(self) -> bool:
        return self.prediction is not None


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_splits(shape: ModelShape, pp: int, seq_length: int) -> list[tuple[int, tuple[int, ...] | None]]:
    """(vpp, layout) choices for ``pp`` stages: every even split, and where none exists (or only without
    interleaving) balanced layouts (``mcore.parallel.pipeline.balanced_layout``) for vpp 1, 2 and 4."""
    if pp == 1:
        return [(1, None)]
    out: list[tuple[int, tuple[int, ...] | None]] = []
    if shape.layers % pp == 0:
        out += [(v, None) for v in _divisors(shape.layers // pp)]
    extra = 6.0 * shape.vocab * shape.hidden / shape.layer_flops_per_token(shape.layers - 1, seq_length)
    for v in (1, 2, 4):
        if pp * v <= shape.layers and shape.layers % (pp * v):
            out.append((v, tuple(balanced_layout(shape.layers, pp, v, last_stage_extra=extra))))
    return out


def base_layouts(shape: ModelShape, gpus: int, global_batch: int, seq_length: int, gpus_per_node: int):
    """Every (tp, cp, pp, vpp, ep, etp, dp, micro-batch) combination with tp x cp x pp x dp = ``gpus``."""
    for tp in _powers(min(gpus_per_node, gpus)):
        for cp in _powers(min(gpus_per_node // tp, gpus // tp)):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                eps = _divisors(shape.num_experts) if shape.is_moe else [1]  # too large an ep: refused, with why
                etps = sorted({1, tp}) if shape.is_moe else [None]
                per_rank = global_batch // dp if global_batch % dp == 0 else 0
                mbs = [m for m in (1, 2, 4, 8) if per_rank and per_rank % m == 0] or [1]
                comms = CP_SEARCHED if cp > 1 else ("p2p",)
                for vpp, split in pipeline_splits(shape, pp, seq_length):
                    for ep, etp, mb, comm in itertools.product(eps, etps, mbs, comms):
                        yield Layout(
                            tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp, cp_comm_type=comm, ep=ep, etp=etp, micro_batch=mb,
                            global_batch=global_batch, seq_length=seq_length, sequence_parallel=tp > 1,
                            distributed_optimizer=dp * cp > 1, overlap_param_gather=dp * cp > 1,
                            pipeline_layout=split,
                        )  # fmt: skip


def _first_fit(shape: ModelShape, layout: Layout, modes, memory_gb: float) -> tuple[Layout | None, float | None]:
    """The first of ``modes`` that fits (and the smallest need seen), skipping ZeRO-3 at dp=1."""
    smallest = None
    for mode in modes:
        if mode.get("dp_shard") and layout.dp * layout.cp == 1:
            continue
        trial = layout.replace(**mode)
        if trial.problems(shape):
            continue
        need = max(s.total for s in stage_memory(shape, trial)) / GB
        if need <= memory_gb:
            return trial, need
        smallest = need if smallest is None else min(smallest, need)
    return None, smallest


def evaluate(shape: ModelShape, layout: Layout, network: Network, memory_gb: float) -> Candidate:
    """The fastest of each family's first fitting memory mode (optimizer offload only when none fits), predicted
    with the closed-form pipeline; or why nothing fits."""
    problems = layout.problems(shape)
    if problems:
        return Candidate(layout, None, 0.0, tuple(problems))
    fits, needs = [], []
    for index, family in enumerate(MEMORY_MODES):
        if index == 2 and fits and fits[0][0].recompute == "none" and not fits[0][0].dp_shard:
            break  # ZeRO-1 fits without recompute: offloading can only be slower
        trial, need = _first_fit(shape, layout, family, memory_gb)
        (fits if trial is not None else needs).append((trial, need) if trial is not None else need)
    if not fits:
        trial, need = _first_fit(shape, layout, LAST_RESORT, memory_gb)
        if trial is not None:
            fits.append((trial, need))
        needs.append(need)
    if fits:
        scored = [(predict_step(shape, t, network, exact=False), t, n) for t, n in fits]
        prediction, trial, need = min(scored, key=lambda x: x[0].step_s)
        return Candidate(trial, prediction, need)
    smallest = min(n for n in needs if n is not None)
    why = f"needs {smallest:.1f} GB per GPU even with full recompute, ZeRO-3 and offload; {memory_gb:g} GB available"
    return Candidate(layout, None, smallest, (why,))


def search(
    shape: ModelShape, gpus: int, global_batch: int, seq_length: int, network: Network, memory_gb: float | None = None
) -> list[Candidate]:
    """Every candidate, runnable ones first by predicted tokens/s, then the rest."""
    memory = network.gpu.memory_gb if memory_gb is None else memory_gb
    layouts = base_layouts(shape, gpus, global_batch, seq_length, network.cluster.gpus_per_node)
    out = [evaluate(shape, layout, network, memory) for layout in layouts]
    runs = sorted((c for c in out if c.runs), key=lambda c: -c.prediction.tokens_per_s)
    # the closed-form pipeline ranks them all; the schedule replay then re-ranks the leaders
    exact = [replace(c, prediction=predict_step(shape, c.layout, network)) for c in runs[:EXACT_TOP]]
    runs = sorted(exact, key=lambda c: -c.prediction.tokens_per_s) + runs[EXACT_TOP:]
    return runs + [c for c in out if not c.runs]


def format_search(candidates: list[Candidate], top: int = 5) -> str:
    """The best layouts with their overrides, and a count of every reason the others cannot run."""
    runs = [c for c in candidates if c.runs]
    lines = [f"{len(candidates)} layouts: {len(runs)} run, {len(candidates) - len(runs)} cannot"]
    for i, c in enumerate(runs[:top]):
        p, lay = c.prediction, c.layout
        lines.append(
            f"{i + 1}. {p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}%, step {p.step_s:.3f} s, "
            f"{c.memory_gb:.1f} GB/GPU: tp {lay.tp} cp {lay.cp}{f' ({lay.cp_comm_type})' if lay.cp > 1 else ''} "
            f"pp {lay.pp} vpp {lay.vpp} ep {lay.ep} dp {lay.dp} "
            f"mbs {lay.micro_batch} recompute {lay.recompute}"
        )
    if runs:
        lines.append("overrides of the best: " + " ".join(runs[0].layout.overrides()))
    else:
        lines.append("no layout fits: see the reasons below")
    kinds: Counter[str] = Counter()
    example: dict[str, str] = {}
    for c in candidates:
        for reason in c.reasons:
            kind = _reason_kind(reason)
            kinds[kind] += 1
            example.setdefault(kind, reason)
    if kinds:
        lines.append("why the others cannot run (layouts per reason, with one example):")
        lines += [f"  {n:>6}  {example[kind]}" for kind, n in kinds.most_common()]
    lines.append(NOT_ENUMERATED)
    return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    """A reason without its numbers, so that the same rule broken at different sizes counts once."""
    return re.sub(r"[0-9.]+", "N", reason)
