"""pagedllm: a readable LLM inference and serving engine (paged KV cache, continuous batching)."""

from pagedllm.config import EngineArgs
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineArgs",
    "LoRARequest",
    "SamplingParams",
    "PoolingParams",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestMetrics",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "__version__",
]


def __getattr__(name: str):
    # Heavy classes (torch, transformers) load on first use so `import pagedllm` stays cheap.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from pagedllm.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    if name == "BeamSearchParams":
        from pagedllm.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
