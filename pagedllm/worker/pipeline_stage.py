"""One pipeline stage's eager forward: receive the previous stage's residual stream, run this
stage's layers, send the result on.

Models never communicate (``models/interface.py``: a stage after the first takes ``intermediate``,
a stage before the last returns its residual stream); the runner does, here for eager steps and in
``CUDAGraphRunner.replay_stage`` for graphed ones, which moves the same tensors through its graph's
static buffers, outside the graph. At pipeline size 1 both are the plain ``model(input_ids,
positions)``.

Start-up's dummy forwards (memory profile, warm-up, compile pass) do not communicate: a stage
after the first runs on a zero residual stream, as vLLM's dummy runs do, so the stages' start-ups
need not run in step and a stage's graphs capture without its neighbours.
"""

from __future__ import annotations

import torch

from pagedllm.distributed import PipelineParallelGroup


def stage_forward(model: torch.nn.Module, pp: PipelineParallelGroup, input_ids: torch.Tensor,
                  positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The step's forward on this stage: the final hidden states ``[T, hidden]`` on the last stage,
    None before it (its residual stream went to the next stage). ``T = positions.shape[0]`` rows
    are exchanged, in the activations' ``dtype``. Cost: the stage's layers plus one receive and
    one send of ``[T, hidden]`` where the stage has neighbours."""
    if pp.size == 1:
        return model(input_ids, positions)
    intermediate = None
    if not pp.is_first:
        intermediate = pp.recv_prev((positions.shape[0], model.config.hidden_size), dtype, positions.device)
    out = model(input_ids, positions, intermediate)
    if pp.is_last:
        return out
    pp.send_next(out)
    return None


def dummy_stage_forward(model: torch.nn.Module, pp: PipelineParallelGroup, input_ids: torch.Tensor,
                        positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``stage_forward`` of a start-up batch without communication (module doc): zeros stand in
    for the previous stage's residual stream; None on a stage before the last."""
    if pp.size == 1:
        return model(input_ids, positions)
    intermediate = None
    if not pp.is_first:
        intermediate = torch.zeros(positions.shape[0], model.config.hidden_size, dtype=dtype, device=positions.device)
    out = model(input_ids, positions, intermediate)
    return out if pp.is_last else None
