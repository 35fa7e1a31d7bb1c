"""KV cache sizing and allocation.

CPU: the pool is ``kv_cache_memory`` bytes (default: enough for max_num_seqs full-length requests,
capped at 2 GiB). CUDA: a memory profile — run the largest batch once, then give the KV cache
``gpu_memory_utilization * total - (peak use during the profile)``. Both divide a byte budget by
the bytes of one block, which follow the cache's dtype (``kv_cache_dtype``): a float8 cache holds
twice the blocks of a bf16 one (four times those of float32) in the same memory.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedllm")

_DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def cpu_num_blocks(kv_cache_memory: int | None, block_bytes: int, block_size: int, max_num_seqs: int,
                   max_model_len: int) -> int:
    if kv_cache_memory is None:
        blocks_needed = max_num_seqs * ((max_model_len + block_size - 1) // block_size) + 1
        return max(1, min(blocks_needed, _DEFAULT_CPU_KV_BYTES // block_bytes))
    num_blocks = kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes is smaller than one KV block ({block_bytes} bytes)")
    return int(num_blocks)


def cuda_num_blocks(device: torch.device, gpu_memory_utilization: float, peak_bytes: int, block_bytes: int) -> int:
    """Blocks that fit in the share of device memory left after the profiled peak use."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - peak_bytes - max(used_by_others, 0)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache "
            f"(total {total / 2**30:.1f} GiB, model peak {peak_bytes / 2**30:.1f} GiB): raise it"
        )
    return int(num_blocks)


def allocate_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def log_kv_cache(num_blocks: int, block_size: int, dtype: torch.dtype, block_bytes: int) -> None:
    """The start-up line that states the cache's dtype, its element size and its capacity."""
    logger.info("KV cache: %d blocks of %d tokens in %s (%d byte(s) an element, %.2f GiB)", num_blocks, block_size,
                str(dtype).removeprefix("torch."), torch.finfo(dtype).bits // 8, num_blocks * block_bytes / 2**30)
