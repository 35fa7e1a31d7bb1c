"""Process groups and the collectives the parallel layers call (tensor parallel today)."""

from pagedllm.distributed.parallel_state import TensorParallelGroup, get_tp_group, set_tp_group, shard_range

__all__ = ["TensorParallelGroup", "get_tp_group", "set_tp_group", "shard_range"]
