"""EngineArgs (what the user sets, named as vLLM's) -> EngineConfig (frozen, validated).

This module imports neither torch nor transformers at import time: ``core/`` reads the scheduler
and cache configs from here. Validation errors are ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_RUNNERS = ("auto", "generate", "pooling")
_TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "priority"  # "priority" (larger value sooner, then arrival) | "fcfs"
    preemption_mode: str = "recompute"
    # A request not scheduled within this many seconds of its arrival is finished as aborted
    # (``QUEUE_TIMEOUT_REASON``); None: requests wait as long as it takes.
    timeout_s: float | None = None
    # With LoRA: the most distinct adapters one step may run (vLLM's rule); None: LoRA is off.
    max_loras: int | None = None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. ``num_blocks`` is 0 until the worker has sized the cache; the engine core
    then builds the final config with the number it allocated."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device memory the engine may take
    kv_cache_memory: int | None = None  # CPU: bytes for the KV cache (None: a default budget)
    num_gpu_blocks_override: int | None = None  # a fixed number of blocks (tests, benchmarks)
    cache_dtype: str = "auto"  # "auto" (the compute dtype) | "fp8_e4m3" | "fp8_e5m2" (attention/kv_dtype.py)
    # The window of a model whose every layer slides: a running request's blocks wholly outside it
    # are freed (core/kv_cache_manager.py). None: every block is kept (full or interleaved attention).
    sliding_window: int | None = None


def moe_sizes(hf_config: Any) -> tuple[int, int] | None:
    """``(routed experts, each expert's intermediate size)`` of a mixture-of-experts config (Mixtral's
    ``num_local_experts`` / ``intermediate_size``, Qwen-MoE's ``num_experts`` / ``moe_intermediate_size``),
    None for a dense model."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not experts:
        return None
    return int(experts), int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across devices and processes.

    World layout: ``world_size = tensor_parallel_size * pipeline_parallel_size`` ranks; rank
    ``pp_rank * tensor_parallel_size + tp_rank`` holds tensor-parallel slice ``tp_rank`` of pipeline
    stage ``pp_rank``. The engine core reads its step's output from ``output_rank`` (the last
    stage's first tensor-parallel rank). One engine core per data-parallel replica.
    ``enable_expert_parallel``: a mixture-of-experts layer gives each tensor-parallel rank
    ``experts / tensor_parallel_size`` whole experts instead of a slice of every expert.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # "uni" (one process) | "mp" (one process per rank) | "ray"
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def verify_model(self, hf_config: Any) -> None:
        """Refuse sizes that do not divide the model, with a ``ValueError`` naming the size and what
        it must divide (the layers would refuse too, but only inside a worker process)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        checks = [("num_attention_heads", heads), ("vocab_size", int(hf_config.vocab_size)),
                  ("intermediate_size", int(getattr(hf_config, "intermediate_size", tp)))]
        for name, total in checks:
            if total % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {name} ({total})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's num_key_value_heads "
                             f"({kv_heads}) or be a multiple of it")
        self._verify_experts(hf_config)
        layers = int(hf_config.num_hidden_layers)
        if layers % pp:
            raise ValueError(f"pipeline_parallel_size ({pp}) must divide the model's num_hidden_layers ({layers})")

    def _verify_experts(self, hf_config: Any) -> None:
        tp, sizes = self.tensor_parallel_size, moe_sizes(hf_config)
        if sizes is None:
            if self.enable_expert_parallel:
                raise ValueError(f"enable_expert_parallel: the model has no experts "
                                 f"(model_type={getattr(hf_config, 'model_type', None)!r})")
            return
        experts, expert_size = sizes
        if self.enable_expert_parallel and experts % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's number of experts ({experts}) "
                             "with enable_expert_parallel")
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", None) or 0)
        sliced = [("shared_expert_intermediate_size", shared)]
        if not self.enable_expert_parallel:
            sliced.append(("expert intermediate size", expert_size))
        for name, total in sliced:
            if total % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {name} ({total})")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel families the engine may use; read from the environment once, at config build
    (``envs.py``), and fixed for the engine's life. The per-device thresholds that choose among the
    allowed kernels live in ``layers/tuning.py``."""

    fused_ops: bool = True  # fused Triton norm / RoPE / activation / small-batch GEMV kernels (CUDA)
    pdl: bool = True  # programmatic dependent launch in batch-1 decode graphs (CUDA, sm90+)
    fold_norms: bool = True  # fold RMSNorm weights into the next projection (CUDA)
    gemm_tuning: bool = True  # time cuBLAS vs cuBLASLt per shape at start-up (CUDA)
    cpu_kernels: bool = True  # the C kernels of the CPU path

    @classmethod
    def from_env(cls) -> KernelConfig:
        from pagedllm import envs

        return cls(fused_ops=envs.PAGEDLLM_FUSED_OPS, pdl=envs.PAGEDLLM_PDL, fold_norms=envs.PAGEDLLM_FOLD_NORMS,
                   gemm_tuning=envs.PAGEDLLM_GEMM_TUNING, cpu_kernels=envs.PAGEDLLM_CPU_KERNELS)


_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
_SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): a proposer drafts up to
    ``num_speculative_tokens`` tokens per request and step, and the target model verifies them in
    one forward. ``ngram`` looks the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens up
    in the request's own prompt and output; ``draft_model`` runs ``model`` (same vocabulary)."""

    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    # The draft's resolved ModelConfig (method "draft_model"; set by engine/config_builder.py).
    draft_model_config: Any = None

    @classmethod
    def from_dict(cls, spec: dict | str) -> SpeculativeConfig:
        """Validate vLLM's dict (or its JSON text, as the CLI passes it); errors name the key."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; supported: {list(_SPEC_KEYS)}")
        model = spec.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model must be a path or hub id, got {model!r}")
        method = spec.get("method") or ("draft_model" if model is not None else None)
        if method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(_SPEC_METHODS)} (or give a draft "
                             f"'model'), got {method!r}")
        if method == "draft_model" and model is None:
            raise ValueError("speculative_config.model is required by method 'draft_model'")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model is not used by method 'ngram': remove it")
        k = spec.get("num_speculative_tokens")
        if not _is_positive_int(k):
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and not _is_positive_int(v):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
            if v is not None and method != "ngram":
                raise ValueError(f"speculative_config.{name} is only used by method 'ngram'")
        lo, hi = lo or hi or 5, hi or lo or 5  # vLLM: one given sets both; neither: 5
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi, model=model)


def _is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured output (xgrammar is the one backend). ``jump_forward``: append the tokens a
    grammar forces without sampling them one by one (structured_output/jump_forward.py)."""

    jump_forward: bool = False


# vLLM's accepted max_lora_rank values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (``enable_lora``): ``max_loras`` adapters in device slots at once (and at most that
    many distinct ones per step), ranks up to ``max_lora_rank``, ``max_cpu_loras`` kept on the CPU."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(frozen=True)
class ObservabilityConfig:
    log_stats: bool = False  # the periodic stats line (vLLM's ``disable_log_stats=False``)
    # Where finished requests' OpenTelemetry spans are exported (OTLP); None: no tracing at all.
    otlp_traces_endpoint: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The model as resolved: where it lives, its HF config, the compute dtype and context length."""

    model: str
    source: Any  # pagedllm.loader.ModelSource
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    tokenizer: str | None = None
    served_model_name: str = ""
    seed: int = 0
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights (benchmarks)
    skip_tokenizer_init: bool = False
    # The quantization scheme served (a ``pagedllm.quantization.QuantizationConfig``), or None.
    quant_config: Any = None
    runner: str = "generate"  # "generate" (LM head + sampler) | "pooling" (embeddings, no sampler)
    # runner "pooling": how the model pools (a ``pagedllm.pooling_params.PoolerConfig``); else None.
    pooler_config: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def kv_bytes_per_token(self, cache_dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * cache_dtype_bytes


def arg(default: Any, help: str) -> Any:
    """An EngineArgs field with its one-line meaning (the CLI's --help and docs/configuration.md)."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names and meanings (``model=None`` is the embedded SmolLM2).

    Every field is declared with ``arg(default, help)``: its help is the flag's --help line and the
    meaning column of docs/configuration.md.
    """

    model: str | None = arg(None, "HF folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = arg(None, "tokenizer folder or hub id (default: the model's)")
    served_model_name: str | None = arg(None, "the model name in the API (default: derived from the model)")
    dtype: str = arg("auto", "compute dtype: auto (float32 on the CPU, the model's half type on a GPU), "
                     "float32, bfloat16 or float16")
    seed: int = arg(0, "random seed of sampling without a per-request seed")
    max_model_len: int | None = arg(None, "context length, prompt plus output (default: the model's)")
    max_num_seqs: int | None = arg(None, "most sequences run in one step (default: 256)")
    max_num_batched_tokens: int | None = arg(None, "most tokens computed in one step, the chunked-prefill "
                                             "budget (default: 2048 on the CPU, 8192 on a GPU)")
    block_size: int = arg(16, "tokens per KV-cache block (a power of two up to 256)")
    gpu_memory_utilization: float = arg(0.9, "share of GPU memory the engine may take (weights, activations, "
                                        "KV cache)")
    kv_cache_memory: int | None = arg(None, "bytes of KV cache on the CPU (default: enough for max_num_seqs full-length requests, at most 2 GiB)")
    kv_cache_dtype: str = arg("auto", "KV cache storage: auto (the compute dtype), fp8 (= fp8_e4m3) or fp8_e5m2: "
                              "1 byte an element (twice the blocks of bf16), scales 1.0")
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of common prompt prefixes")
    enable_chunked_prefill: bool = arg(True, "split long prompts over steps so that running streams keep "
                                       "their pace")
    scheduling_policy: str = arg("priority", "priority (larger priority first, then arrival) or fcfs")
    # The seed spec's name for scheduling_policy ("fifo" means "fcfs"); resolved into it by validate().
    scheduler_policy: str | None = arg(None, "alias of scheduling_policy; fifo means fcfs")
    preemption_mode: str = arg("recompute", "what a preempted request loses: recompute (swap is not supported "
                               "yet)")
    enforce_eager: bool = arg(False, "no CUDA graphs (slower decode, faster start)")
    device: str = arg("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    attention_backend: str = arg("auto", "auto, cpu, torch_ref or triton")
    max_logprobs: int = arg(20, "most logprobs a request may ask for per token")
    # Off by default: outputs then match token-by-token sampling (vLLM has no jump-forward), and the
    # per-token jump check adds serial CPU work to the update of every constrained request.
    structured_outputs_jump_forward: bool = arg(False, "structured output: append the tokens a grammar "
                                                "forces (jump-forward) instead of sampling them one by one; "
                                                "requests with logprobs always sample every token")
    disable_log_stats: bool = arg(False, "no periodic stats log line (LLM(...) turns it on unless given, "
                                   "as vLLM)")
    num_gpu_blocks_override: int | None = arg(None, "a fixed number of KV-cache blocks (tests, benchmarks)")
    load_format: str = arg("auto", "auto (the checkpoint's weights; a GGUF file's stay packed, on a GPU only with "
                           "quantization='gguf' given, else dequantized into the model dtype there), dummy (random "
                           "weights, benchmarks), gguf, or gguf_dequantized (a GGUF file's weights as float)")
    skip_tokenizer_init: bool = arg(False, "no tokenizer: prompts must be token ids, outputs have no text")
    # Overlap the CPU side of a step with the GPU's previous step (default: on for CUDA).
    async_scheduling: bool | None = arg(None, "schedule the next step while the GPU runs this one "
                                        "(default: on for CUDA)")
    tensor_parallel_size: int = arg(1, "ranks (GPUs, or CPU processes) each layer is split over")
    pipeline_parallel_size: int = arg(1, "pipeline stages the decoder layers are split over (one process each)")
    data_parallel_size: int = arg(1, "engine cores (replicas, each with its own tensor x pipeline parallel "
                                  "workers) behind one server, requests balanced by their load; AsyncLLMEngine "
                                  "and pagedllm serve only")
    enable_expert_parallel: bool = arg(False, "mixture-of-experts models: split the experts over the "
                                       "tensor-parallel ranks (whole experts per rank) instead of "
                                       "slicing every expert")
    distributed_executor_backend: str | None = arg(None, "uni (one process), mp (one process per rank) or "
                                                   "ray (one Ray actor per rank, on the cluster of RAY_ADDRESS "
                                                   "or a local one); default: uni at one rank, mp above")
    quantization: str | None = arg(None, "quantize the weights: fp8 (float8 weights, per-output-channel scales, "
                                   "quantized at load; per-token dynamic FP8 activations); a checkpoint's own "
                                   "quantization_config (fp8, compressed-tensors FP8, gptq and awq int4) is "
                                   "served in its scheme")
    swap_space: float | None = arg(None, "CPU swap space for preempted KV blocks, GiB (vLLM's); only 0 / unset is "
                                   "accepted: preemption recomputes, the KV cache has no CPU tier yet")
    timeout_s: float | None = arg(None, "finish a request as aborted when it waits longer than this many seconds "
                                  "in the queue before it is first scheduled (the server answers 503); "
                                  "default: no limit")
    otlp_traces_endpoint: str | None = arg(None, "export one OpenTelemetry span per request (OTLP) to this "
                                           "endpoint; needs the 'tracing' extra")
    runner: str = arg("auto", "generate (an LM), pooling (an embedding model: LLM.embed, /v1/embeddings) or auto "
                      "(pooling for encoder-only models such as BERT, else generate)")
    task: str = arg("auto", "vLLM's older name for the runner: embed means runner pooling, generate means "
                    "runner generate")
    enable_lora: bool = arg(False, "serve LoRA adapters (a request's lora_request; the server's --lora-modules)")
    max_loras: int = arg(1, "LoRA: most adapters in one step (device slots)")
    max_lora_rank: int = arg(16, f"LoRA: the largest adapter rank, one of {list(LORA_RANKS)}")
    max_cpu_loras: int | None = arg(None, "LoRA: adapters kept in CPU memory (default: max_loras)")
    speculative_config: dict | str | None = arg(None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\" or "
                                          "\"draft_model\", \"num_speculative_tokens\": k, \"prompt_lookup_min\", "
                                          "\"prompt_lookup_max\" (ngram), \"model\" (the draft)}")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # noqa: C901 - flat list of checks
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                     "num_gpu_blocks_override"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.block_size, int) or self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not (0.0 < float(self.gpu_memory_utilization) <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.scheduler_policy is not None:
            alias = {"fifo": "fcfs"}.get(self.scheduler_policy, self.scheduler_policy)
            if alias not in ("priority", "fcfs"):
                raise ValueError(f"scheduler_policy must be 'priority', 'fcfs' or 'fifo', got {self.scheduler_policy!r}")
            if self.scheduling_policy not in ("priority", alias):  # "priority" is the default: not given
                raise ValueError(f"scheduler_policy={self.scheduler_policy!r} contradicts "
                                 f"scheduling_policy={self.scheduling_policy!r}: give one of them")
            self.scheduling_policy, self.scheduler_policy = alias, None
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling_policy must be 'priority' or 'fcfs', got {self.scheduling_policy!r}")
        if self.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode must be 'recompute' (swap is not supported yet), got {self.preemption_mode!r}")
        if self.swap_space not in (None, 0):
            raise ValueError(f"swap_space is not supported yet (got {self.swap_space!r}): preemption recomputes the "
                             "KV cache, which has no CPU tier; leave swap_space unset or 0")
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
            or not 0 < self.timeout_s < float("inf")
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.otlp_traces_endpoint is not None and (
            not isinstance(self.otlp_traces_endpoint, str) or not self.otlp_traces_endpoint.strip()
        ):
            raise ValueError(f"otlp_traces_endpoint must be a URL, got {self.otlp_traces_endpoint!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in ("auto", "cpu", "torch_ref", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'cpu', 'torch_ref' or 'triton', got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy", "gguf", "gguf_dequantized"):
            raise ValueError(f"load_format must be 'auto', 'dummy', 'gguf' or 'gguf_dequantized', got {self.load_format!r}")
        self._validate_parallel()
        self._validate_runner()
        self._validate_lora()
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a string or None, got {self.quantization!r}")
        if not isinstance(self.structured_outputs_jump_forward, bool):
            raise ValueError("structured_outputs_jump_forward must be a boolean, "
                             f"got {self.structured_outputs_jump_forward!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the key
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ValueError("speculative_config is not supported with tensor_parallel_size or "
                                 "pipeline_parallel_size above 1 yet (drafts run in one process)")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if (
            not self.enable_chunked_prefill
            and self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when enable_chunked_prefill is False "
                f"(got {self.max_num_batched_tokens} < {self.max_model_len}): a prompt could never be scheduled"
            )

    def _validate_runner(self) -> None:
        if self.runner not in _RUNNERS:
            raise ValueError(f"runner must be one of {_RUNNERS}, got {self.runner!r}")
        if self.task not in _TASKS:
            raise ValueError(f"task must be one of {_TASKS}, got {self.task!r}")
        implied = {"embed": "pooling", "generate": "generate"}.get(self.task)
        if implied is not None and self.runner not in ("auto", implied):
            raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}: give one of them")
        if implied is not None:
            self.runner, self.task = implied, "auto"

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a boolean, got {self.enable_expert_parallel!r}")
        backend = self.distributed_executor_backend
        if self.data_parallel_size > 1 and backend == "ray":
            raise ValueError("data_parallel_size > 1 with distributed_executor_backend='ray' is not supported yet: "
                             "the replicas' workers run as processes of this host ('mp' or 'uni')")
        if backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {backend!r}")
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'")
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if backend == "uni" and world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size x "
                             f"pipeline_parallel_size is {world_size}: use 'mp'")

    def _validate_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a boolean, got {self.enable_lora!r}")
        for name in ("max_loras", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and not _is_positive_int(v):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_loras is None:
            raise ValueError("max_loras must be a positive integer, got None")
        if self.max_lora_rank not in LORA_RANKS or isinstance(self.max_lora_rank, bool):
            raise ValueError(f"max_lora_rank must be one of {list(LORA_RANKS)}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size or pipeline_parallel_size "
                             "above 1 yet")

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA config (None without ``enable_lora``)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs with, resolved and validated (``engine/config_builder.py``)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str
    enforce_eager: bool
    attention_backend: str
    max_logprobs: int
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    async_scheduling: bool = False  # one step in flight while the next is scheduled (CUDA default)
    speculative_config: SpeculativeConfig | None = None  # None: no drafts (the plain decode path)
    lora_config: LoRAConfig | None = None  # None: LoRA is off (no adapter slot is allocated)

    @property
    def log_stats(self) -> bool:
        return self.observability_config.log_stats

