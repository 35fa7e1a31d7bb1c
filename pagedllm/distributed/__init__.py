"""Process groups and the collectives the parallel layers call (tensor parallel today)."""

from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_distributed,
    get_tp_group,
    init_distributed,
    set_tp_group,
    shard_range,
)

__all__ = ["TensorParallelGroup", "destroy_distributed", "get_tp_group", "init_distributed", "set_tp_group",
           "shard_range"]
