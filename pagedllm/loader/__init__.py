"""pagedllm.loader: resolve a ``model`` string, then read its HF config, tokenizer and weights.

    source = resolve_model("Qwen/Qwen3-0.6B")   # or a folder, a .gguf file, or None (SmolLM2)
    hf_config = load_hf_config(source)
    tokenizer = load_tokenizer(source)
    for name, tensor in iter_weights(source): ...   # HF parameter names
"""

from pagedllm.loader.cache import cache_root, gguf_cache_folder
from pagedllm.loader.hf import load_hf_config, load_tokenizer
from pagedllm.loader.source import ModelSource, default_model_path, iter_weights, resolve_model

__all__ = [
    "ModelSource",
    "cache_root",
    "default_model_path",
    "gguf_cache_folder",
    "iter_weights",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model",
]
