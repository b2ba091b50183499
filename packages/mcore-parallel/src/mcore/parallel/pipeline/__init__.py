"""Pipeline parallelism: stage layouts, point-to-point transfers, schedules and their bubble accounting.

- :func:`stage_layer_ranges`: which layers each rank (and model chunk) holds; :func:`balanced_layout` evens out
  the ranks' work when the first/last stage also carry the embedding and the output layer;
- :class:`PipelineP2P`: batched sends/receives between adjacent stages;
- schedules :class:`NoPipelining`, :class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved1F1B`,
  :class:`ZeroBubbleH1`: each lists a rank's ops in order and reports its theoretical ``bubble_fraction``;
  ``run(forward_step, microbatches)`` executes one optimizer step's worth of micro-batches;
- :func:`simulate` / :func:`render`: ideal timelines and their text drawings, from the schedules' op orders.
"""

from mcore.parallel.pipeline.layout import balanced_layout, stage_layer_ranges, virtual_stage_index
from mcore.parallel.pipeline.ops import BACKWARD, FORWARD, WEIGHT, Op
from mcore.parallel.pipeline.p2p import PipelineP2P, p2p_activation_shape
from mcore.parallel.pipeline.p2p_exchanges import Message, Step, pipeline_plans, replay_plans
from mcore.parallel.pipeline.schedules import (
    GPipe,
    Interleaved1F1B,
    NoPipelining,
    OneFOneB,
    PipelineSchedule,
    ZeroBubbleH1,
)
from mcore.parallel.pipeline.timeline import StageTimeline, TimedOp, pipeline_idle_fraction, render, simulate

__all__ = [
    "balanced_layout",
    "stage_layer_ranges",
    "virtual_stage_index",
    "Op",
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "PipelineP2P",
    "p2p_activation_shape",
    "Message",
    "Step",
    "pipeline_plans",
    "replay_plans",
    "PipelineSchedule",
    "NoPipelining",
    "GPipe",
    "OneFOneB",
    "Interleaved1F1B",
    "ZeroBubbleH1",
    "StageTimeline",
    "TimedOp",
    "simulate",
    "render",
    "pipeline_idle_fraction",
]
