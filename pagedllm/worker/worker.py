"""Worker: one device's model, KV cache and start-up; the executor's only contact with tensors.

Start-up is a pipeline of named stages, each logged with its time:

- ``compile`` (CUDA): a dry pass over every forward start-up will run (the memory profile, the
  eager warm-up shapes, one decode per CUDA-graph size, the sampler) inside
  ``parallel_compile.compile_only()``, so Triton compiles all of their kernels in parallel and the
  real passes only launch;
- ``profile`` (CUDA): one forward of the largest batch the scheduler can produce, whose peak
  memory sizes the KV cache (on the CPU the cache gets a byte budget instead; see kv_cache.py);
- ``warm up`` (CUDA, after the KV cache exists): eager forwards of the query-length mixes the
  attention backend names (``AttentionBackend.warmup_query_lens``), logits, both sampling kernels;
- ``tune``: the GEMM library choice per weight shape and graph batch size;
- ``capture``: the decode CUDA graphs (unless ``enforce_eager`` or the backend has none), with
  speculative decoding also the verify graphs, and a draft model's own graphs.

Nothing compiles while serving. Dummy forwards never write the KV cache (their slots are -1).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from pagedllm.attention.backend import forward_context
from pagedllm.attention.kv_dtype import kv_cache_torch_dtype
from pagedllm.attention.registry import get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.layers.dispatch import prepare_model_kernels
from pagedllm.sample.bitmask import GrammarOutput
from pagedllm.sample.history import TokenHistory
from pagedllm.sample.sampler import build_sampling_metadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.worker import kv_cache as kvc
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.model_runner import ModelRunner, StepHandle
from pagedllm.worker.pipeline_stage import dummy_stage_forward
from pagedllm.worker.pooling_runner import PoolingModelRunner
from pagedllm.worker.proposer import build_proposer, draft_bytes_per_block, load_draft_model

logger = logging.getLogger("pagedllm")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def uses_decode_graphs(config: EngineConfig, device: torch.device, backend) -> bool:
    """Whether a worker captures decode CUDA graphs: on CUDA unless ``enforce_eager`` or the
    attention backend has none, at every pipeline stage (each over its own layers); never for
    pooling (its steps are prefills, the graphs are of decode steps)."""
    return (device.type == "cuda" and not config.enforce_eager and backend.supports_decode_graphs
            and config.model_config.runner != "pooling")


class Worker:
    """Owns the device, the loaded model, its KV cache and the ModelRunner that steps it.

    Invariant: after ``initialize_kv_cache`` every attention layer of the model is bound to its
    slice of ``model_runner.kv_caches``; dummy forwards of start-up only ever run before (with
    one-block dummy caches) or with slot -1 (nothing written). Cost: start-up only (model load,
    the stages of the module doc); per step it forwards to the runner.
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.models.registry import build_model, init_dummy_weights, load_model

        self.config = config
        mc = config.model_config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[mc.dtype]
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.startup_seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        self.pooling = mc.runner == "pooling"
        if mc.load_format == "dummy":
            self.model = init_dummy_weights(build_model(mc.hf_config, self.dtype, self.device, mc.quant_config,
                                                        mc.runner), seed=mc.seed)
        else:
            self.model = load_model(mc.source, mc.hf_config, self.dtype, self.device, mc.quant_config, mc.runner)
        self.model.eval()
        self.lora_manager = self._build_lora_manager()  # before the kernel plan folds the norms
        self._prepare_model_kernels()
        if self.lora_manager is not None:
            self.lora_manager.use_folded_norms(self.kernel_plan.norms_folded)
        self.draft_model = load_draft_model(config, self.device, self.dtype)  # speculative decoding
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        # This rank's KV heads (all of them at one tensor-parallel rank); an encoder has no cache.
        layers = self.model.attention_layers
        num_kv_heads = layers[0].num_kv_heads if layers else mc.num_kv_heads
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype, self.device)
        self.kv_cache_spec = self.backend.kv_cache_spec(num_kv_heads, mc.head_dim, self.kv_cache_dtype,
                                                        self.block_size)
        if self.pooling:
            self.model_runner = PoolingModelRunner(config, self.model, self.backend, self.device, self.dtype,
                                                   pooling_type=mc.pooler_config.pooling_type)
        else:
            self.model_runner = ModelRunner(config, self.model, self.backend, self.device, self.dtype)
        self.model_runner.lora_manager = self.lora_manager
        self._graphs: CUDAGraphRunner | None = None
        if uses_decode_graphs(config, self.device, self.backend):
            # A pipeline stage captures its own layers; its send / receive stay outside (cuda_graph.py).
            spec = config.speculative_config  # verify graphs: 1 + k queries per request
            self._graphs = CUDAGraphRunner(self.model, self.backend, self.model_runner.prep.inputs,
                                           config.scheduler_config.max_num_seqs, self.device,
                                           allow_pdl=config.kernel_config.pdl,
                                           verify_query_len=1 + (spec.num_speculative_tokens if spec else 0),
                                           max_num_tokens=config.scheduler_config.max_num_batched_tokens,
                                           pp=self.model_runner.pp, dtype=self.dtype)

    # -- kernel policy (layers/): the two calls the runner used to make on a loaded model ---------
    def _prepare_model_kernels(self) -> None:
        """Rewrite the loaded model for the device it serves on and let every op choose its
        implementation once (``layers/dispatch.py``: norm folding on CUDA, oneDNN prepacking on
        the CPU, the per-device tuning row)."""
        self.kernel_plan = prepare_model_kernels(self.model, self.device, self.config.kernel_config)

    def _build_lora_manager(self):
        """The adapters' slots on every LoRA-capable layer (``enable_lora``), or None: nothing is
        allocated and no layer changes."""
        lc = self.config.lora_config
        if lc is None:
            return None
        from pagedllm.lora.manager import LoRAModelManager

        return LoRAModelManager(self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, self.device,
                                self.dtype, self.config.model_config.hf_config)

    def _tune_gemms(self, batch_sizes: list[int]) -> None:
        """Pick cuBLAS or cuBLASLt per weight shape and CUDA-graph batch size (``KernelPlan.tune_gemms``),
        before the graphs capture the choice; off with ``kernel_config.gemm_tuning``."""
        if not self.config.kernel_config.gemm_tuning:
            return
        summary = self.kernel_plan.tune_gemms(self.model, batch_sizes)
        logger.info("GEMM library: cuBLASLt for %d of %d (weight shape, batch size) pairs, timed in %.1f s",
                    summary["cublaslt"], summary["measured"], summary["seconds"])

    # -- start-up stages -------------------------------------------------------------------
    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.startup_seconds[name] = seconds = time.perf_counter() - t0
        logger.info("start-up stage %r done in %.1f s", name, seconds)

    def bytes_per_block(self) -> int:
        return (self.kv_cache_spec.bytes_per_block * self.model.num_attention_layers
                + draft_bytes_per_block(self.draft_model, self.block_size, self.dtype))

    def determine_num_blocks(self) -> int:
        """How many KV blocks to allocate: the override, a byte budget on the CPU, or the memory
        left after the profiled peak on CUDA (stages ``compile`` and ``profile``)."""
        cfg = self.config
        sc = cfg.scheduler_config
        if cfg.cache_config.num_gpu_blocks_override:
            return cfg.cache_config.num_gpu_blocks_override
        if not self.model.num_attention_layers:  # an encoder: blocks are bookkeeping, enough for all
            return sc.max_num_seqs * self.model_runner.max_blocks_per_req + 1
        if self.device.type != "cuda":
            return kvc.cpu_num_blocks(cfg.cache_config.kv_cache_memory, self.bytes_per_block(), self.block_size,
                                      sc.max_num_seqs, self.max_model_len)
        peak = self._profile_peak_memory()
        logger.info("memory profile (one forward of %d tokens): peak %.2f GiB", sc.max_num_batched_tokens,
                    peak / 2**30)
        num_blocks = kvc.cuda_num_blocks(self.device, cfg.cache_config.gpu_memory_utilization, peak,
                                         self.bytes_per_block())
        return min(num_blocks, sc.max_num_seqs * self.model_runner.max_blocks_per_req + 1)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak bytes torch allocates for the largest batch (requests of up to max_model_len tokens
        filling max_num_batched_tokens), its logits and a sort of their probabilities."""
        sc = self.config.scheduler_config
        lens: list[int] = []
        while sum(lens) < sc.max_num_batched_tokens:
            lens.append(min(self.max_model_len, sc.max_num_batched_tokens - sum(lens)))
        dummy_cache = self.model.kv_cache_shape_per_layer(1, self.block_size)
        self.model.bind_kv_caches(kvc.allocate_kv_caches(self.model.num_attention_layers, dummy_cache,
                                                         self.kv_cache_dtype, self.device))
        with self._stage("compile"):
            self._compile_in_parallel(lens)
        with self._stage("profile"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            hidden = logits = self._dummy_forward(lens, num_cached=0)
            if hidden is not None and not self.pooling:  # None: a pipeline stage before the last
                logits = self.model.compute_logits(hidden[: sc.max_num_seqs])
                torch.softmax(logits, dim=-1).sort(dim=-1)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            del hidden, logits
        self.model.bind_kv_caches([])
        torch.cuda.empty_cache()
        return int(peak)

    def _compile_in_parallel(self, profile_lens: list[int]) -> None:
        """The dry pass of the ``compile`` stage (module doc); needs the (dummy) KV caches bound.
        Without Triton's asynchronous compile mode it does nothing (the real passes compile)."""
        from pagedllm.worker.parallel_compile import compile_only

        with compile_only() as active:
            if not active:
                return
            self._dummy_forward(profile_lens, num_cached=0)
            self._warm_up_eager_kernels()
            if self._graphs is not None:
                self._graphs.run_all_sizes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape_per_layer(num_blocks, self.block_size)
        assert shape == self.kv_cache_spec.shape(num_blocks), "the model's KV layout is not the backend's"
        caches = kvc.allocate_kv_caches(self.model.num_attention_layers, shape, self.kv_cache_dtype, self.device)
        kvc.log_kv_cache(num_blocks, self.block_size, self.kv_cache_dtype, self.bytes_per_block())
        self.model_runner.bind_kv_caches(caches)
        self.model_runner.proposer = build_proposer(self.config, self.draft_model, num_blocks, self.device, self.dtype)

    def warm_up(self) -> None:
        """The stages after the KV cache exists (CUDA only): ``warm up``, ``tune``, ``capture``. An
        encoder has no paged attention kernels to warm up (its warm-up shapes need a cache)."""
        if self.device.type != "cuda" or not self.model.num_attention_layers:
            return
        with self._stage("warm up"):
            self._warm_up_eager_kernels()
        if self._graphs is None:
            return
        with self._stage("tune"):
            self._tune_gemms(self._graphs.token_counts)
        with self._stage("capture"):
            self._graphs.capture_all()
            proposer = self.model_runner.proposer
            if isinstance(proposer, DraftModelProposer):  # the draft model's own graphs
                proposer.runner.capture_graphs(self.config.kernel_config.pdl)
        if self.lora_manager is not None:
            with self._stage("capture lora"):
                self._graphs.capture_lora(self.lora_manager)
        self.model_runner.graph_runner = self._graphs

    @torch.inference_mode()
    def _warm_up_eager_kernels(self) -> None:
        """Eager forwards of the backend's warm-up query-length mixes, each request over a context
        2 tokens longer than its query; then the LM head on two rows and both sampling kernels
        (greedy and the fused random draw), as an eager step runs them."""
        hidden = None
        for query_lens in self.backend.warmup_query_lens(self.max_model_len - 2):
            hidden = self._dummy_forward(query_lens, num_cached=2)
        if hidden is None or self.pooling:  # no warm-up shapes, a stage before the last, or no sampler
            return
        logits = self.model.compute_logits(hidden[[0, hidden.shape[0] - 1]], upcast=False)
        for temperature in (0.0, 1.0):
            params = [SamplingParams(temperature=temperature, max_tokens=1)] * 2
            history = TokenHistory(np.zeros((2, 1), dtype=np.int64), np.arange(2), np.ones(2, dtype=np.int64),
                                   np.ones(2, dtype=np.int64))
            self.model_runner.sampler(logits, build_sampling_metadata(params, history, self.device, logits.shape[-1]))
        torch.cuda.synchronize(self.device)

    def _dummy_forward(self, query_lens: list[int], num_cached: int) -> torch.Tensor | None:
        """One eager forward of requests with these query lengths, each after ``num_cached`` earlier
        positions (all in block 0); token 0 everywhere, nothing written to the KV cache, nothing
        sent or received (a stage before the last returns None: ``pipeline_stage.py``)."""
        meta = self.model_runner.dummy_metadata(query_lens, num_cached)
        positions = torch.cat([torch.arange(num_cached, num_cached + q) for q in query_lens]).to(self.device)
        with forward_context(meta, self.backend):
            return dummy_stage_forward(self.model, self.model_runner.pp, torch.zeros_like(positions), positions,
                                       self.dtype)

    # -- serving ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> StepHandle:
        return self.model_runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
