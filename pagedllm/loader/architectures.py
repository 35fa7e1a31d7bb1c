"""The supported architectures: everything pagedllm knows per model type, in one table.

One ``Architecture`` per HF ``model_type``: the HF ``architectures`` entry, the class that
implements it (named as ``"module:Class"``: ``models/registry.py`` imports it, the loader never
does), transformers' config defaults and field types for the plain config reader
(``loader/plain_config.py``), and how llama.cpp stores its GGUF tensors (``loader/gguf_file.py``).
Adding an architecture starts here. This module imports neither torch nor transformers (the
loader's start-up path reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# transformers' class defaults, per model type, for the attributes we read. A key a class does not
# define is absent here too (so ``getattr(c, key, default)`` sees the same thing through both).
# ``head_dim`` None / ``num_key_value_heads`` None are filled in by ``_post_process`` as
# transformers' ``__post_init__`` does.
_COMMON = dict(
    architectures=None,  # PreTrainedConfig's
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _COMMON, vocab_size=32000, intermediate_size=11008, num_key_value_heads=None, head_dim=None,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, attention_bias=False, mlp_bias=False,
    ),
    "mistral": dict(
        _COMMON, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8, head_dim=None,
        max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2, sliding_window=4096,
    ),
    "qwen2": dict(
        _COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, max_position_embeddings=32768,
        bos_token_id=None, eos_token_id=None, use_sliding_window=False, sliding_window=4096,
    ),
    "qwen3": dict(
        _COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
        max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, attention_bias=False,
        use_sliding_window=False, sliding_window=4096,
    ),
}


def _size(v: Any) -> bool:
    return type(v) is int and v > 0  # not bool (an int subclass): transformers says no too


def _optional_size(v: Any) -> bool:
    return v is None or _size(v)


def _optional_int(v: Any) -> bool:
    return v is None or type(v) is int


def _token_ids(v: Any) -> bool:
    return _optional_int(v) or (type(v) is list and all(type(x) is int for x in v))


def _of_type(kind: type) -> Any:
    return lambda v: type(v) is kind


# The type each class field we read must have. transformers' config classes are strict dataclasses
# that reject e.g. ``rms_norm_eps: 1`` (an int) or ``tie_word_embeddings: null``; a value failing
# these checks (which are at least as strict) goes to AutoConfig, to be judged there. Keys that are
# not fields of the class (e.g. ``head_dim`` in a qwen2 config) are kept as they are, as transformers does.
_COMMON_TYPES = dict(
    architectures=lambda v: v is None or (type(v) is list and all(type(x) is str for x in v)),
    vocab_size=_size, hidden_size=_size, intermediate_size=_size, num_hidden_layers=_size,
    num_attention_heads=_size, max_position_embeddings=_size, hidden_act=_of_type(str),
    initializer_range=lambda v: type(v) is float and 0.0 <= v <= 1.0,
    rms_norm_eps=_of_type(float), tie_word_embeddings=_of_type(bool),
    pad_token_id=_optional_int, bos_token_id=_optional_int, eos_token_id=_token_ids,
)
_QWEN_TYPES = dict(
    _COMMON_TYPES, num_key_value_heads=_optional_size, use_sliding_window=_of_type(bool), sliding_window=_optional_int,
)
_TYPES: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON_TYPES, num_key_value_heads=_optional_size, head_dim=_optional_size,
                  attention_bias=_of_type(bool), mlp_bias=_of_type(bool)),
    "mistral": dict(_COMMON_TYPES, num_key_value_heads=_size, head_dim=_optional_size, sliding_window=_optional_int),
    "qwen2": _QWEN_TYPES,
    "qwen3": dict(_QWEN_TYPES, head_dim=_size, attention_bias=_of_type(bool)),
}


@dataclass(frozen=True)
class Architecture:
    """One supported model type. Invariant: ``config_types`` covers every field of ``config_defaults``
    that pagedllm reads and that transformers' config class types strictly."""

    model_type: str  # HF ``config.model_type`` (and the GGUF ``general.architecture`` name)
    hf_class: str  # HF ``config.architectures`` entry
    implementation: str  # our model class, "module:Class"
    # transformers' class defaults for the attributes we read, and field -> predicate a value must
    # satisfy (else AutoConfig judges it); None: the plain config reader leaves the type to AutoConfig.
    config_defaults: dict[str, Any] | None
    config_types: dict[str, Any] | None
    gguf_permutes_qk: bool  # llama.cpp permutes Q/K rows for its rotary kernel (its "llama" arch)
    # The class serving it with runner="pooling" (embeddings), "module:Class"; None: no pooling.
    pooling_implementation: str | None = None
    # Encoder-only (bidirectional attention): served with runner="pooling" only, each prompt in one step.
    is_encoder: bool = False


_LLAMA_IMPL = "pagedllm.models.llama:LlamaForCausalLM"
_MOE_IMPL = "pagedllm.models.moe:MoeForCausalLM"
_DECODER_EMBEDDING = "pagedllm.models.decoder_embedding:DecoderForEmbedding"
_BERT_IMPL = "pagedllm.models.bert:BertModel"
ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", _LLAMA_IMPL, _DEFAULTS["llama"], _TYPES["llama"], True,
                     _DECODER_EMBEDDING),
        # Mistral checkpoints convert to GGUF under llama.cpp's "llama" architecture (permuted there).
        Architecture("mistral", "MistralForCausalLM", _LLAMA_IMPL, _DEFAULTS["mistral"], _TYPES["mistral"], False,
                     _DECODER_EMBEDDING),
        Architecture("qwen2", "Qwen2ForCausalLM", _LLAMA_IMPL, _DEFAULTS["qwen2"], _TYPES["qwen2"], False,
                     _DECODER_EMBEDDING),
        Architecture("qwen3", "Qwen3ForCausalLM", _LLAMA_IMPL, _DEFAULTS["qwen3"], _TYPES["qwen3"], False,
                     _DECODER_EMBEDDING),
        # Mixture of experts: configs read by AutoConfig (their expert fields vary across versions).
        Architecture("mixtral", "MixtralForCausalLM", _MOE_IMPL, None, None, False),
        Architecture("qwen2_moe", "Qwen2MoeForCausalLM", _MOE_IMPL, None, None, False),
        Architecture("qwen3_moe", "Qwen3MoeForCausalLM", _MOE_IMPL, None, None, False),
        # sentence-transformers' BERT-family encoders (all-MiniLM, BGE); BertForMaskedLM folders too.
        Architecture("bert", "BertModel", _BERT_IMPL, None, None, False, _BERT_IMPL, is_encoder=True),
    )
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def architecture_for(architectures: list[str] | None, model_type: str | None) -> Architecture | None:
    """The entry for an HF config: its first ``architectures`` entry we support, else its
    ``model_type`` (GGUF configs have no architectures); None if neither is supported."""
    for name in architectures or []:
        for arch in ARCHITECTURES.values():
            if arch.hf_class == name:
                return arch
    return ARCHITECTURES.get(model_type) if model_type is not None else None


def gguf_permutes_qk(gguf_architecture: str) -> bool:
    """Whether a GGUF of this ``general.architecture`` stores Q/K rows permuted (llama.cpp's "llama")."""
    arch = ARCHITECTURES.get(gguf_architecture)
    return arch is not None and arch.gguf_permutes_qk
