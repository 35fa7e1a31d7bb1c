"""This process's place in the tensor-parallel group, and the two collectives the layers need;
``init_distributed`` joins a multi-process world and makes this rank's group.

A process is one rank, so its tensor-parallel group is process state, set once by the worker
before it builds the model (``set_tp_group``) and read by the parallel layers when they are
constructed (their shard sizes) and called (the all-reduce after a row-parallel projection, the
gather of vocabulary-parallel logits). The default is the group of one rank: every shard is the
whole tensor and every collective returns its input, so a single-rank engine runs exactly the
unsharded code.

Invariant: ``0 <= rank < size``; with ``size > 1`` a ``torch.distributed`` process group of that
size carries the collectives. Cost: none at size 1; an all-reduce or all-gather of the activations
otherwise (on CUDA, activations up to ``SYMM_ALL_REDUCE_BYTES`` go through the one-shot
symmetric-memory all-reduce of ``symm_all_reduce.py``, larger ones through NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Decode-sized activations (up to 128 tokens of a 8192-wide model in bf16) take the one-shot path.
SYMM_ALL_REDUCE_BYTES = 2 * 2**20


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    small_all_reduce: Any = None  # a SymmMemAllReduce for small activations (CUDA), or None
    # MoE layers split their experts over the ranks (E/size whole experts each) instead of each
    # expert's intermediate dim (vLLM's ``enable_expert_parallel``; layers/fused_moe.py).
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks (in place where there is more than one)."""
        if self.size == 1:
            return x
        if self.small_all_reduce is not None and self.small_all_reduce.fits(x):
            return self.small_all_reduce(x)
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class PipelineParallelGroup:
    """This rank's pipeline stage: ``stage`` of ``size``, holding decoder layers ``layer_range``.

    Stage ``s`` receives the residual stream from the same tensor-parallel rank of stage ``s - 1``
    and sends its own to stage ``s + 1`` (point-to-point); only the last stage samples (the engine
    sends the earlier stages the sampled ids with the next step that computes them).
    Invariant: ``0 <= stage < size``; ``world_rank = stage * tp_size + tp_rank``. Cost: none at
    size 1; one send and one receive of ``[tokens, hidden]`` per stage boundary per step otherwise.
    """

    stage: int = 0
    size: int = 1
    world_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers of this stage: an equal, contiguous share."""
        start, length = shard_range(num_layers, self.stage, self.size, "num_hidden_layers")
        return range(start, start + length)

    def send_next(self, x: torch.Tensor) -> None:
        """Send ``x`` to the next stage. On return (NCCL) the current stream waits for the send, so
        the caller may overwrite ``x`` with later work on that stream (a CUDA graph's static output)."""
        torch.distributed.send(x.contiguous(), dst=self.world_rank + self.tp_size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.recv_prev_into(torch.empty(shape, dtype=dtype, device=device))

    def recv_prev_into(self, out: torch.Tensor) -> torch.Tensor:
        """Receive the previous stage's tensor into ``out`` (contiguous, its shape; e.g. rows of a CUDA
        graph's static input buffer); later work on the current stream sees it. Returns ``out``."""
        torch.distributed.recv(out, src=self.world_rank - self.tp_size)
        return out


_tp_group = TensorParallelGroup()
_pp_group = PipelineParallelGroup()


def get_pp_group() -> PipelineParallelGroup:
    return _pp_group


def set_pp_group(group: PipelineParallelGroup) -> PipelineParallelGroup:
    """Make ``group`` this process's pipeline stage; returns the previous one."""
    global _pp_group
    previous, _pp_group = _pp_group, group
    return previous


def get_tp_group() -> TensorParallelGroup:
    return _tp_group


def set_tp_group(group: TensorParallelGroup) -> TensorParallelGroup:
    """Make ``group`` this process's tensor-parallel group; returns the previous one."""
    global _tp_group
    previous, _tp_group = _tp_group, group
    return previous


def shard_range(total: int, rank: int, size: int, name: str) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s equal slice of ``total`` items; a ``ValueError`` naming
    ``name`` when ``total`` is not divisible by ``size``."""
    if total % size:
        raise ValueError(f"{name} ({total}) must be divisible by the tensor-parallel size ({size})")
    length = total // size
    return rank * length, length


def init_distributed(rank: int, world_size: int, tensor_parallel_size: int, init_method: str,
                     backend: str, dtype: torch.dtype = torch.bfloat16,
                     enable_expert_parallel: bool = False) -> TensorParallelGroup:
    """Join the ``torch.distributed`` world of ``world_size`` ranks (``backend``: "gloo" on the CPU,
    "nccl" on CUDA) and make this process's tensor-parallel group: the ``tensor_parallel_size``
    consecutive ranks ``rank`` belongs to (one group per pipeline stage; every rank creates every
    group, as ``torch.distributed.new_group`` requires) and its pipeline stage (``rank //
    tensor_parallel_size``); ``enable_expert_parallel``: its MoE layers split experts over the group.
    Returns the tensor-parallel group it set."""
    import datetime

    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(minutes=10))
    tp = tensor_parallel_size
    group = None
    for first in range(0, world_size, tp):
        ranks = list(range(first, first + tp))
        made = torch.distributed.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            group = made
    small = None
    if backend == "nccl" and tp > 1:
        from pagedllm import envs
        from pagedllm.distributed.symm_all_reduce import make_symm_all_reduce

        if envs.PAGEDLLM_SYMM_MEM_ALL_REDUCE:
            small = make_symm_all_reduce(group, torch.device("cuda", torch.cuda.current_device()),
                                         SYMM_ALL_REDUCE_BYTES, dtype)
    tp_group = TensorParallelGroup(rank % tp, tp, group, small, enable_expert_parallel)
    set_tp_group(tp_group)
    set_pp_group(PipelineParallelGroup(rank // tp, world_size // tp, rank, tp))
    return tp_group


def destroy_distributed() -> None:
    """Leave the world joined by ``init_distributed`` (no-op if none) and go back to one rank."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    set_tp_group(TensorParallelGroup())
    set_pp_group(PipelineParallelGroup())
