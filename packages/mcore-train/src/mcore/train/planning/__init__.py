"""The planner behind ``mcore-train plan``: memory, step time and MFU of a model and layout, before any GPU.

- ``shape``: the model as matmuls, parameters and activations (from a config, or written out);
- ``layout``: parallel sizes and memory settings, with every reason a layout cannot run;
- ``memory``: peak memory per pipeline rank;
- ``calibration`` / ``cluster``: the GPU's measured rates and the network between GPUs;
- ``time_model`` / ``pipeline_sim`` / ``step``: the step time, overlap as mcore's code does it;
- ``search``: all layouts on N GPUs, ranked;
- ``measure``: ``mcore-train plan --calibrate``, the measurements behind a calibration file.
"""

from mcore.train.planning.calibration import Calibration, load_calibration
from mcore.train.planning.cluster import Cluster, Network, load_cluster
from mcore.train.planning.layout import Layout
from mcore.train.planning.memory import StageMemory, stage_memory
from mcore.train.planning.search import search
from mcore.train.planning.shape import ModelShape
from mcore.train.planning.step import StepPrediction, predict_step

__all__ = [
    "Calibration",
    "Cluster",
    "Layout",
    "ModelShape",
    "Network",
    "StageMemory",
    "StepPrediction",
    "load_calibration",
    "load_cluster",
    "predict_step",
    "search",
    "stage_memory",
]
