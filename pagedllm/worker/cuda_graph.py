"""CUDA graphs for decode batches: one captured forward pass (up to the logits) per padded batch shape.

A pure decode step (every request computes one token) of ``n`` requests replays the graph of
the smallest captured size >= n; the graph ends with the LM head, so a replay returns the logits
(model dtype) of every row, padding included, and the step samples from the first ``n``.
With speculative decoding (``verify_query_len = 1 + k``) a second set of graphs serves steps whose
requests each compute at most ``1 + k`` tokens (verification of k drafts): every request is staged
with exactly ``1 + k`` queries (``input_prep.stage_uniform_batch``: leading dummy queries that
write no KV), so the attention metadata of such a step has a fixed shape; the graph returns the
logits of all ``1 + k`` rows of each request and the step takes the rows of its real tokens. Captured
graphs read the runner's persistent device input buffers (DeviceInputs), so a replay needs no
argument copies beyond the step's one input copy; padded rows carry slot -1 (KV store skipped)
and seq_len 0 (attention writes zeros), and their outputs are discarded. All graphs share one
memory pool; capture time is part of start-up.
Graphs of ``pdl.MAX_TOKENS`` request are captured with programmatic dependent launch.
Under pipeline parallel each stage captures its own layers (``replay_stage``, vLLM's way): a stage
after the first reads the previous stage's residual stream from a static input buffer
(``intermediate``, rows ``[:bs * q]`` for graph ``(bs, q)``) that the receive fills before the
replay, and a stage before the last ends its graphs with its residual stream (not the logits), which
is sent from the graph's static output after the replay; the send and the receive are never
captured. Speculative decoding is refused with pipeline parallel, so a stage has decode graphs only.
With LoRA (``capture_lora``) a second set of graphs, one per size, runs the layers with their
adapter delta over the LoRA manager's fixed mapping (``lora/mapping.GraphMapping``), which a
step fills before ``replay_lora``; those graphs are captured without PDL (the LoRA kernels do not
wait on their predecessor in a dependent launch).

Invariant: ``self.graphs[bs, q]`` was captured with metadata built by the backend's builder over
``DeviceInputs.device_views(bs * q, bs)``: the device views that a step padded to ``bs`` requests
of ``q`` queries fills with its one input copy (and, on a stage after the first, rows ``[:bs * q]``
of ``intermediate``). Cost: one graph and one output buffer per shape (``[bs * q, vocab]`` logits,
or ``[bs * q, hidden]`` on a stage before the last), in one shared memory pool, plus one
``[largest graph's tokens, hidden]`` input buffer on a stage after the first.
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
from pagedllm.distributed import PipelineParallelGroup, get_pp_group
from pagedllm.worker.device_inputs import LONGEST_FIRST_FROM

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's default shape)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


# Verify graphs are captured up to this many tokens (vLLM's default largest capture size): their
# logits buffers grow with bs * (1 + k), and large verify batches are not launch-bound.
MAX_VERIFY_GRAPH_TOKENS = 512


def verify_capture_sizes(decode_sizes: list[int], query_len: int, max_num_tokens: int) -> list[int]:
    """The decode sizes whose verify batch (``query_len`` tokens per request) fits
    ``min(max_num_tokens, MAX_VERIFY_GRAPH_TOKENS)`` tokens; none for ``query_len`` 1."""
    if query_len <= 1:
        return []
    limit = min(max_num_tokens, MAX_VERIFY_GRAPH_TOKENS)
    return [s for s in decode_sizes if s * query_len <= limit]


class CUDAGraphRunner:
    """The decode (and verify) graphs of one model (see the module doc): ``capture_all`` at start-up,
    then ``replay(padded_size(n))`` for every pure decode step of ``n <= max_size`` requests, and
    ``replay(padded_size(n, q), q)`` (``q = verify_query_len``) for a step of ``n <= max_verify_size``
    requests of at most ``q`` tokens each; a pipeline stage replays through ``replay_stage``.
    ``pp`` is the stage (default: this process's); ``dtype`` the activations' (needed by a stage
    after the first, for its input buffer)."""

    def __init__(self, model, backend: AttentionBackend, inputs, max_num_seqs: int, device: torch.device,
                 allow_pdl: bool = True, verify_query_len: int = 1, max_num_tokens: int = 0,
                 pp: PipelineParallelGroup | None = None, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.allow_pdl = allow_pdl  # KernelConfig.pdl
        self.backend = backend
        self.inputs = inputs  # DeviceInputs
        self.device = device
        self.pp = pp if pp is not None else get_pp_group()
        self.sizes = capture_sizes(max_num_seqs)
        self.verify_query_len = verify_query_len
        self.verify_sizes = verify_capture_sizes(self.sizes, verify_query_len, max_num_tokens)
        if self.verify_sizes and self.pp.size > 1:
            raise ValueError("verify_query_len: no verify graphs under pipeline parallel (a stage exchanges "
                             "the first rows of its graph: a decode step's tokens)")
        inputs.recurring_shapes.update((bs * verify_query_len, bs) for bs in self.verify_sizes)
        # A stage after the first: the previous stage's residual stream, received before each replay.
        self.intermediate: torch.Tensor | None = None
        if not self.pp.is_first:
            if dtype is None:
                raise ValueError("dtype: a pipeline stage after the first needs the activations' dtype")
            self.intermediate = torch.zeros(max(self.token_counts), model.config.hidden_size, dtype=dtype,
                                            device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with the LoRA delta (capture_lora)
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def max_verify_size(self) -> int:
        """The largest verify batch a graph serves (0 without verify graphs)."""
        return self.verify_sizes[-1] if self.verify_sizes else 0

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every captured ``(batch size, queries per request)``, most tokens first (capture order)."""
        shapes = [(bs, 1) for bs in self.sizes] + [(bs, self.verify_query_len) for bs in self.verify_sizes]
        return sorted(shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True)

    @property
    def token_counts(self) -> list[int]:
        """The token counts (GEMM rows) the graphs run, ascending."""
        return sorted({bs * q for bs, q in self.shapes})

    def padded_size(self, num_reqs: int, query_len: int = 1) -> int | None:
        for s in (self.sizes if query_len == 1 else self.verify_sizes):
            if s >= num_reqs:
                return s
        return None

    def metadata(self, bs: int, q: int = 1) -> AttentionMetadata:
        """What every replay of shape ``(bs, q)`` attends with (built once, at capture)."""
        dev = self.inputs.device_views(bs * q, bs)
        longest_first = self.backend.uses_longest_first_order and bs >= LONGEST_FIRST_FROM and q == 1
        return self.backend.metadata_builder.build(CommonAttentionInputs(
            num_actual_tokens=bs * q, max_query_len=q, query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"], block_tables=self.inputs.block_tables[:bs], slot_mapping=dev["slot_mapping"],
            longest_first=dev["decode_order"] if longest_first else None,
        ))

    def _safe_inputs(self, bs: int, q: int = 1) -> dict[str, torch.Tensor]:
        """What warm-up and capture of shape ``(bs, q)`` run on (written into that shape's device
        views, which the graph will read): token 0, no KV writes; a decode attends to an empty
        context, a verify request's ``q`` queries sit at positions ``0 .. q - 1`` (its context never
        starts before position 0: ``input_prep.stage_uniform_batch``)."""
        dev = self.inputs.device_views(bs * q, bs)
        dev["input_ids"].zero_()
        dev["positions"].copy_(torch.arange(q).repeat(bs) if q > 1 else torch.zeros(bs, dtype=torch.int64))
        dev["slot_mapping"].fill_(-1)
        dev["seq_lens"].fill_(q if q > 1 else 0)
        dev["query_start_loc"].copy_(torch.arange(0, (bs + 1) * q, q, dtype=torch.int32))
        dev["decode_order"].copy_(torch.arange(bs, dtype=torch.int32))
        return dev

    @torch.inference_mode()
    def run_all_sizes(self) -> None:
        """One eager forward per captured shape (no capture): the launches a capture will make."""
        for bs, q in self.shapes:
            dev = self._safe_inputs(bs, q)
            with forward_context(self.metadata(bs, q), self.backend), pdl.for_graph(bs * q, self.allow_pdl):
                self._forward(dev["input_ids"], dev["positions"])

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """What a graph runs: this stage's layers (on a stage after the first from the first rows of
        ``intermediate``) and, on the last stage, the LM head (logits in the model dtype, as the
        sampler takes them); a stage before the last ends with its residual stream."""
        if self.intermediate is None:
            hidden = self.model(ids, pos)
        else:
            hidden = self.model(ids, pos, self.intermediate[: ids.shape[0]])
        return self.model.compute_logits(hidden, upcast=False) if self.pp.is_last else hidden

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every shape, largest first (so smaller graphs reuse the pool). Returns seconds."""
        t0 = time.perf_counter()
        for bs, q in self.shapes:
            dev = self._safe_inputs(bs, q)
            meta = self.metadata(bs, q)
            ids, pos = dev["input_ids"], dev["positions"]
            with forward_context(meta, self.backend), pdl.for_graph(bs * q, self.allow_pdl):
                self._forward(ids, pos)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(ids, pos)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs, q], self.outputs[bs, q] = graph, out
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (decode batch sizes 1..%d, verify batch sizes up to %d of %d "
                    "tokens) in %.1f s", len(self.graphs), self.max_size, self.max_verify_size,
                    self.verify_query_len, elapsed)
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

    def replay(self, bs: int, q: int = 1) -> torch.Tensor:
        """Run the graph of shape ``(bs, q)``; returns its logits ``[bs * q, vocab]`` (on a stage before
        the last its residual stream ``[bs * q, hidden]``), valid until the next replay."""
        self.graphs[bs, q].replay()
        return self.outputs[bs, q]

    def replay_stage(self, bs: int, q: int, num_tokens: int) -> torch.Tensor | None:
        """``replay(bs, q)`` as this pipeline stage's part of a step whose ``num_tokens`` tokens are
        the graph's first rows: a stage after the first receives the previous stage's residual
        stream into those rows of ``intermediate`` first (and zeroes the padding rows, which would
        otherwise carry a stale stream that each replay adds to); a stage before the last then
        sends those rows of its output and returns None. The last stage returns the logits. At
        pipeline size 1 this is ``replay``."""
        if self.intermediate is not None:
            self.pp.recv_prev_into(self.intermediate[:num_tokens])
            if num_tokens < bs * q:
                self.intermediate[num_tokens : bs * q].zero_()
        out = self.replay(bs, q)
        if self.pp.is_last:
            return out
        self.pp.send_next(out[:num_tokens])
        return None
