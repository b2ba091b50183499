"""Pipeline schedules: each class lists a rank's op order; the shared base class runs it."""

from mcore.parallel.pipeline.schedules.base import ForwardStep, PipelineSchedule
from mcore.parallel.pipeline.schedules.gpipe import GPipe
from mcore.parallel.pipeline.schedules.interleaved import Interleaved1F1B
from mcore.parallel.pipeline.schedules.no_pipelining import NoPipelining
from mcore.parallel.pipeline.schedules.one_f_one_b import OneFOneB
from mcore.parallel.pipeline.schedules.zero_bubble import ZeroBubbleH1

__all__ = ["ForwardStep", "PipelineSchedule", "NoPipelining", "GPipe", "OneFOneB", "Interleaved1F1B", "ZeroBubbleH1"]
