"""Tensor, sequence, pipeline and data parallelism on torch.distributed.

Process groups are built once from a ``ParallelConfig`` and passed explicitly to the modules that need them.
Pipeline parallelism lives in ``mcore.parallel.pipeline`` (imported on demand).
"""

from mcore.parallel.comm import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from mcore.parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.parallel.data_parallel import DistributedDataParallel
from mcore.parallel.distributed_optimizer import DistributedOptimizer
from mcore.parallel.expert_parallel import GroupedExperts, MoEConfig, MoELayer, moe_metrics, update_expert_biases
from mcore.parallel.finalize import finalize_model_grads
from mcore.parallel.grad_clip import clip_grad_norm, total_grad_norm
from mcore.parallel.grid import GROUP_KINDS, ParallelConfig, ProcessGroups, build_process_groups, rank_groups
from mcore.parallel.init import (
    constant_init,
    normal_init,
    partition_slice,
    scaled_normal_init,
    seeded_generator,
)
from mcore.parallel.loss_scaler import DynamicLossScaler
from mcore.parallel.optimizer import (
    MixedPrecisionOptimizer,
    StepResult,
    default_param_groups,
)
from mcore.parallel.random import RNGStatesTracker, get_rng_tracker, model_parallel_seed
from mcore.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    attach_weight_grad_store,
    set_tensor_parallel_attributes,
)
from mcore.parallel.weight_grad_store import WeightGradStore

__version__ = "0.1.0"

__all__ = [
    "GROUP_KINDS",
    "ColumnParallelLinear",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "MixedPrecisionOptimizer",
    "ParallelConfig",
    "ProcessGroups",
    "RNGStatesTracker",
    "RowParallelLinear",
    "StepResult",
    "VocabParallelEmbedding",
    "WeightGradStore",
    "build_process_groups",
    "clip_grad_norm",
    "constant_init",
    "copy_to_tp_region",
    "default_param_groups",
    "finalize_model_grads",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "get_rng_tracker",
    "model_parallel_seed",
    "moe_metrics",
    "normal_init",
    "partition_slice",
    "rank_groups",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scaled_normal_init",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "seeded_generator",
    "attach_weight_grad_store",
    "set_tensor_parallel_attributes",
    "total_grad_norm",
    "update_expert_biases",
    "vocab_parallel_cross_entropy",
]
