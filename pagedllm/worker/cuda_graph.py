"""CUDA graphs for decode batches: one captured forward pass (up to the logits) per padded batch size.

A pure decode step (every request computes one token) of ``n`` requests replays the graph of
the smallest captured size >= n; the graph ends with the LM head, so a replay returns the logits
(model dtype) of every row, padding included, and the step samples from the first ``n``. Captured
graphs read the runner's persistent device input buffers (DeviceInputs), so a replay needs no
argument copies beyond the step's one input copy; padded rows carry slot -1 (KV store skipped)
and seq_len 0 (attention writes zeros), and their outputs are discarded. All graphs share one
memory pool; capture time is part of start-up.
Graphs of ``pdl.MAX_TOKENS`` request are captured with programmatic dependent launch.
With LoRA (``capture_lora``) a second set of graphs, one per size, runs the layers with their
adapter delta over the LoRA manager's fixed mapping (``lora/mapping.GraphMapping``), which a
step fills before ``replay_lora``; those graphs are captured without PDL (the LoRA kernels do not
wait on their predecessor in a dependent launch).

Invariant: ``self.graphs[bs]`` was captured with metadata built by the backend's builder over
``DeviceInputs.device_views(bs, bs)``: the device views that a decode step padded to ``bs`` fills
with its one input copy. Cost: one graph and one logits buffer ``[bs, vocab]`` per size, in one
shared memory pool.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedllm import pdl
from pagedllm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    CommonAttentionInputs,
    forward_context,
)
from pagedllm.worker.device_inputs import LONGEST_FIRST_FROM

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's default shape)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class CUDAGraphRunner:
    """The decode graphs of one model (see the module doc): ``capture_all`` at start-up, then
    ``replay(padded_size(n))`` for every pure decode step of ``n <= max_size`` requests."""

    def __init__(self, model, backend: AttentionBackend, inputs, max_num_seqs: int, device: torch.device,
                 allow_pdl: bool = True) -> None:
        self.model = model
        self.allow_pdl = allow_pdl  # KernelConfig.pdl
        self.backend = backend
        self.inputs = inputs  # DeviceInputs
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with the LoRA delta (capture_lora)
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def metadata(self, bs: int) -> AttentionMetadata:
        """What every replay of size ``bs`` attends with (built once, at capture)."""
        dev = self.inputs.device_views(bs, bs)
        longest_first = self.backend.uses_longest_first_order and bs >= LONGEST_FIRST_FROM
        return self.backend.metadata_builder.build(CommonAttentionInputs(
            num_actual_tokens=bs, max_query_len=1, query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
            block_tables=self.inputs.block_tables[:bs], slot_mapping=dev["slot_mapping"],
            longest_first=dev["decode_order"] if longest_first else None,
        ))

    def _safe_inputs(self, bs: int) -> dict[str, torch.Tensor]:
        """Token 0 at position 0, no KV writes, empty contexts: what warm-up and capture of size
        ``bs`` run on (written into that size's device views, which the graph will read)."""
        dev = self.inputs.device_views(bs, bs)
        dev["input_ids"].zero_()
        dev["positions"].zero_()
        dev["slot_mapping"].fill_(-1)
        dev["seq_lens"].zero_()
        dev["query_start_loc"].copy_(torch.arange(bs + 1, dtype=torch.int32))
        dev["decode_order"].copy_(torch.arange(bs, dtype=torch.int32))
        return dev

    @torch.inference_mode()
    def run_all_sizes(self) -> None:
        """One eager forward per captured size (no capture): the launches a capture will make."""
        for bs in reversed(self.sizes):
            dev = self._safe_inputs(bs)
            with forward_context(self.metadata(bs), self.backend), pdl.for_graph(bs, self.allow_pdl):
                self._forward(dev["input_ids"], dev["positions"])

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """What a graph runs: the forward pass and the LM head (logits in the model dtype, as the
        sampler takes them)."""
        return self.model.compute_logits(self.model(ids, pos), upcast=False)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every size, largest first (so smaller graphs reuse the pool). Returns seconds."""
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            dev = self._safe_inputs(bs)
            meta = self.metadata(bs)
            ids, pos = dev["input_ids"], dev["positions"]
            with forward_context(meta, self.backend), pdl.for_graph(bs, self.allow_pdl):
                self._forward(ids, pos)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(ids, pos)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (decode batch sizes 1..%d) in %.1f s", len(self.sizes), self.max_size, elapsed)
        return elapsed

    @torch.inference_mode()
    def capture_lora(self, lora_manager) -> float:
        """Capture every size again with the LoRA delta (``LoRAModelManager.graph_step``; every
        adapter group empty while capturing). Call after ``capture_all``. Returns seconds."""
        t0 = time.perf_counter()
        lora_manager.enable_graphs(self.max_size)
        for bs in reversed(self.sizes):
            dev = self._safe_inputs(bs)
            meta = self.metadata(bs)
            ids, pos = dev["input_ids"], dev["positions"]
            with forward_context(meta, self.backend), pdl.for_graph(bs, False), lora_manager.graph_step(bs):
                self._forward(ids, pos)  # warm-up: the LoRA kernels compile outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(ids, pos)
            self.lora_graphs[bs], self.lora_outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs with LoRA in %.1f s", len(self.sizes), elapsed)
        return elapsed

    def replay_lora(self, bs: int) -> torch.Tensor:
        """``replay`` of the graph of size ``bs`` with the LoRA delta (its mapping staged)."""
        self.lora_graphs[bs].replay()
        return self.lora_outputs[bs]

    def replay(self, bs: int) -> torch.Tensor:
        """Run the graph of size ``bs``; returns its logits ``[bs, vocab]`` (valid until the next
        replay)."""
        self.graphs[bs].replay()
        return self.outputs[bs]
