"""Process groups and the collectives the parallel layers call (tensor and pipeline parallel)."""

from pagedllm.distributed.parallel_state import (
    PipelineParallelGroup,
    TensorParallelGroup,
    destroy_distributed,
    get_pp_group,
    get_tp_group,
    init_distributed,
    set_pp_group,
    set_tp_group,
    shard_range,
)

__all__ = ["PipelineParallelGroup", "TensorParallelGroup", "destroy_distributed", "get_pp_group", "get_tp_group",
           "init_distributed", "set_pp_group", "set_tp_group", "shard_range"]
