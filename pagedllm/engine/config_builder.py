"""EngineArgs -> EngineConfig: resolve the model (loader), pick device and dtype, fill defaults.

Lives in engine/ (not config.py) because it needs the loader and torch, which core/ must not see.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pagedllm.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    moe_sizes,
)

# Who builds the engine (vLLM's UsageContext): the offline ``LLM`` class, the OpenAI server, or
# anything else that constructs an engine directly. Only the token budget default depends on it.
USAGE_CONTEXTS = ("LLM_CLASS", "OPENAI_API_SERVER", "ENGINE_CONTEXT")
_LARGE_GPU_BYTES = 70 * 2**30
logger = logging.getLogger("pagedllm")


def default_max_num_batched_tokens(device: str, usage_context: str) -> int:
    """The chunked-prefill token budget per step when none is given: 2048 on the CPU; 8192 on a
    GPU, and 16384 for the offline ``LLM`` class on a GPU of >= 70 GiB other than an A100 (vLLM's
    table for the LLM class on H100/H200-class GPUs). A larger budget halves the number of
    prefill steps of an offline batch; a server keeps 8192 so that a prompt burst delays the
    running streams' next tokens less."""
    import torch

    if not device.startswith("cuda"):
        return 2048
    if usage_context == "LLM_CLASS":
        props = torch.cuda.get_device_properties(torch.device(device))
        if props.total_memory >= _LARGE_GPU_BYTES and "a100" not in props.name.lower():
            return 16384
    return 8192


def create_engine_config(args: EngineArgs, usage_context: str = "ENGINE_CONTEXT") -> EngineConfig:
    """Resolve the model, pick device and dtype, and fill the defaults that depend on them."""
    import torch

    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}")

    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.loader.architectures import kv_sliding_window
    from pagedllm.quantization import get_quantization_config

    source = resolve_model(args.model)
    hf_config = load_hf_config(source)
    quant_config = get_quantization_config(args.quantization, hf_config, source.kind, args.load_format)
    if quant_config is not None:
        logger.info("quantization: %s", quant_config.describe())
    parallel_config = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend or (
            "mp" if args.tensor_parallel_size * args.pipeline_parallel_size > 1 else "uni"),
        enable_expert_parallel=args.enable_expert_parallel,
    )
    parallel_config.verify_model(hf_config)
    if args.enable_lora and moe_sizes(hf_config) is not None:
        raise ValueError("enable_lora is not supported for mixture-of-experts models yet (LoRA layers cover "
                         "the dense q/k/v/o/gate/up/down projections)")
    _check_quantization_under_tp(quant_config, parallel_config)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    num_gpus = parallel_config.world_size * parallel_config.data_parallel_size
    if (device.startswith("cuda") and parallel_config.distributed_executor_backend != "ray"
            and num_gpus > torch.cuda.device_count()):  # Ray counts its cluster's GPUs
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size ({num_gpus}) must "
                         f"not exceed the GPUs of this host ({torch.cuda.device_count()})")
    dtype = _resolve_dtype(args.dtype, hf_config, device)
    runner, is_encoder = _resolve_runner(args.runner, hf_config)
    pooling = _pooling_setup(args, source, hf_config, is_encoder) if runner == "pooling" else None
    if pooling is not None:
        pooler_config, st_max_len, args = pooling
        hf_config_len = _resolve_max_model_len(None, hf_config) if args.max_model_len is None else None
        if hf_config_len is not None and st_max_len is not None:  # sentence-transformers truncates there
            args = args.replace(max_model_len=min(hf_config_len, st_max_len))
    else:
        pooler_config = None
    max_model_len = _resolve_max_model_len(args.max_model_len, hf_config)
    on_gpu = device.startswith("cuda")
    max_num_seqs = args.max_num_seqs or 256
    if args.max_num_batched_tokens is not None:
        max_batched = args.max_num_batched_tokens
    elif args.enable_chunked_prefill:
        max_batched = default_max_num_batched_tokens(device, usage_context)
    elif pooling is not None:  # an encoder: whole prompts, with the budget chunked prefill would have
        max_batched = max(max_model_len, default_max_num_batched_tokens(device, usage_context))
    else:
        max_batched = max(max_model_len, 2048)
    if not args.enable_chunked_prefill and max_batched < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_batched}) must be >= max_model_len ({max_model_len}) "
            "when enable_chunked_prefill is False"
        )
    if max_batched < max_num_seqs and args.max_num_batched_tokens is not None and args.max_num_seqs is not None:
        raise ValueError(f"max_num_batched_tokens ({max_batched}) must be >= max_num_seqs ({max_num_seqs})")
    model_config = ModelConfig(
        model=args.model or source.path,
        source=source,
        hf_config=hf_config,
        dtype=dtype,
        max_model_len=max_model_len,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name or (args.model or source.name),
        seed=args.seed,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        quant_config=quant_config,
        runner=runner,
        pooler_config=pooler_config,
    )
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            num_blocks=0,
            enable_prefix_caching=args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cache_dtype="fp8_e4m3" if args.kv_cache_dtype == "fp8" else args.kv_cache_dtype,
            sliding_window=kv_sliding_window(hf_config),
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            preemption_mode=args.preemption_mode,
            timeout_s=args.timeout_s,
            max_loras=args.max_loras if args.enable_lora else None,
        ),
        device=device,
        enforce_eager=args.enforce_eager or not on_gpu,
        attention_backend=args.attention_backend,
        max_logprobs=args.max_logprobs,
        parallel_config=parallel_config,
        kernel_config=KernelConfig.from_env(),
        observability_config=_observability_config(args),
        structured_outputs_config=StructuredOutputsConfig(jump_forward=args.structured_outputs_jump_forward),
        async_scheduling=on_gpu if args.async_scheduling is None else args.async_scheduling,
        speculative_config=_speculative_config(args.speculative_config, model_config),
        lora_config=args.lora_config(),
    )


def _resolve_runner(runner: str, hf_config: Any) -> tuple[str, bool]:
    """("generate" | "pooling", whether the model is an encoder): "auto" is "pooling" for an
    encoder-only architecture (BERT) and, as vLLM, for a bare backbone (``architectures`` naming
    ``*Model``, e.g. the ``Qwen3Model`` of Qwen3-Embedding), else "generate"; the registry
    refuses a runner the architecture cannot serve, naming ``runner``."""
    from pagedllm.models.registry import architecture_of, model_class_of

    arch = architecture_of(hf_config)
    if runner == "auto":
        first = (getattr(hf_config, "architectures", None) or [""])[0]
        backbone = first.endswith("Model") and not first.endswith(("ChatModel", "LMHeadModel"))
        runner = "pooling" if arch.is_encoder or backbone else "generate"
    model_class_of(arch, runner)
    return runner, arch.is_encoder


def _pooling_setup(args: EngineArgs, source: Any, hf_config: Any, is_encoder: bool) -> tuple[Any, int | None, EngineArgs]:
    """A pooling model's ``PoolerConfig``, its sentence-transformers length cap, and ``args`` with
    what pooling needs: no prefix caching (a cached prefix's hidden states are not recomputed, and
    mean / CLS pooling needs them), and for an encoder no chunked prefill either (bidirectional
    attention needs the whole prompt in one step). Both are turned off whatever ``args`` say."""
    from pagedllm.loader.pooling_config import read_pooler_config, sentence_transformers_max_len

    folder = source.path if source.kind == "hf" else None
    if args.speculative_config is not None:
        raise ValueError("speculative_config is not supported with runner='pooling' (nothing is generated)")
    if args.pipeline_parallel_size > 1:
        raise ValueError("pipeline_parallel_size must be 1 with runner='pooling' (the pooler reads every layer's "
                         "output on one rank)")
    changes: dict[str, Any] = {"enable_prefix_caching": False}
    if is_encoder:
        if args.max_num_batched_tokens is not None and args.max_model_len is not None \
                and args.max_num_batched_tokens < args.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be >= max_model_len "
                             f"({args.max_model_len}) for an encoder: each prompt runs whole in one step")
        changes["enable_chunked_prefill"] = False
    args = dataclasses.replace(args, **changes)
    return read_pooler_config(folder, hf_config, is_encoder), sentence_transformers_max_len(folder), args


def _speculative_config(spec: dict | str | None, target: ModelConfig) -> SpeculativeConfig | None:
    """The validated config; a draft model must load and share the target's vocabulary (its
    drafts are verified id by id). It runs in the target's dtype, context length and load format."""
    if spec is None:
        return None
    config = SpeculativeConfig.from_dict(spec)
    if config.method != "draft_model":
        return config
    from pagedllm.loader import load_hf_config, resolve_model

    try:
        source = resolve_model(config.model)
        hf_config = load_hf_config(source)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"speculative_config.model {config.model!r} could not be loaded: {e}") from None
    if int(hf_config.vocab_size) != target.vocab_size:
        raise ValueError(f"speculative_config.model must share the target's vocabulary: its vocab_size is "
                         f"{hf_config.vocab_size}, the target's {target.vocab_size}")
    draft = ModelConfig(model=config.model, source=source, hf_config=hf_config, dtype=target.dtype,
                        max_model_len=target.max_model_len, seed=target.seed, load_format=target.load_format,
                        skip_tokenizer_init=True)
    return dataclasses.replace(config, draft_model_config=draft)


def _observability_config(args: EngineArgs) -> ObservabilityConfig:
    if args.otlp_traces_endpoint is not None:
        from pagedllm.tracing import check_tracing_available

        check_tracing_available()
    return ObservabilityConfig(log_stats=not args.disable_log_stats, otlp_traces_endpoint=args.otlp_traces_endpoint)


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"  # CPU: exact and, without AMX, not slower than half precision
    cfg = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    return "float16" if "float16" in cfg and "bfloat16" not in cfg else "bfloat16"


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    derived = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            derived = v
            break
    if requested is None:
        if derived is None:
            raise ValueError("max_model_len could not be derived from the model config: set max_model_len")
        return derived
    if derived is not None and requested > derived:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's maximum context ({derived})")
    return requested


# Schemes whose packed weights are not sharded across tensor-parallel ranks (fp8's and gguf's are).
_UNSHARDED_SCHEMES = ("gptq", "awq")


def _check_quantization_under_tp(quant_config, parallel_config: ParallelConfig) -> None:
    """Refuse, at start-up, a packed scheme that the tensor-parallel layers cannot shard."""
    name = getattr(quant_config, "name", None)
    if name in _UNSHARDED_SCHEMES and parallel_config.tensor_parallel_size > 1:
        raise ValueError(f"quantization={name!r} with tensor_parallel_size > 1 is not supported yet")
