"""Embeddings equal sentence-transformers' (cosine >= 0.9999) on the real all-MiniLM-L6-v2 and on
tiny random BERT (CLS pooling, no Normalize module) and Qwen3 (``Qwen3Model`` folder, last-token
and mean pooling) sentence-transformers folders, in float32 on the CPU: one request, batches,
chunked prefill (the decoder) and Matryoshka truncation."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams
from tests.embedding_helpers import (
    SENTENCES,
    assert_close_embeddings,
    make_tiny_bert,
    make_tiny_qwen3,
    minilm_folder,
    st_embeddings,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("embedding-models")


def _embed(folder: str, sentences: list[str], params: PoolingParams | None = None, **engine_args) -> list:
    llm = LLM(folder, kv_cache_memory=32 * 2**20, **engine_args)
    try:
        return [o.outputs.embedding for o in llm.embed(sentences, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def test_minilm_equals_sentence_transformers_one_by_one_and_batched(root):
    folder = minilm_folder(root)
    reference = st_embeddings(folder, SENTENCES)
    llm = LLM(folder, kv_cache_memory=32 * 2**20)
    config = llm.llm_engine.model_config
    assert (config.runner, config.pooler_config.pooling_type, config.pooler_config.normalize) == ("pooling", "MEAN", True)
    assert config.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    batched = llm.embed(SENTENCES, use_tqdm=False)
    assert_close_embeddings([o.outputs.embedding for o in batched], reference)
    single = [llm.embed(s, use_tqdm=False)[0].outputs.embedding for s in SENTENCES]
    assert_close_embeddings(single, reference)
    out = batched[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer.encode(SENTENCES[0])  # [CLS] ... [SEP], as sentence-transformers
    assert out.prompt_token_ids[0] == tokenizer.cls_token_id and out.prompt_token_ids[-1] == tokenizer.sep_token_id
    assert isinstance(out.request_id, str) and out.finished
    encoded = llm.encode(SENTENCES[:2], use_tqdm=False)
    assert isinstance(encoded[0].outputs.data, torch.Tensor) and encoded[0].outputs.data.dtype == torch.float32
    torch.testing.assert_close(encoded[0].outputs.data, torch.tensor(batched[0].outputs.embedding))
    llm.llm_engine.shutdown()


def test_tiny_bert_cls_without_normalize_equals_sentence_transformers(root):
    folder = make_tiny_bert(root, "cls", normalize=False)
    reference = st_embeddings(folder, SENTENCES)
    assert abs(reference[0].norm().item() - 1.0) > 1e-2  # really unnormalized
    assert_close_embeddings(_embed(folder, SENTENCES), reference)


def test_tiny_bert_mean_normalized_equals_sentence_transformers(root):
    folder = make_tiny_bert(root, "mean", normalize=True, seed=1)
    assert_close_embeddings(_embed(folder, SENTENCES), st_embeddings(folder, SENTENCES))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16])
def test_tiny_qwen3_last_token_equals_sentence_transformers(root, max_num_batched_tokens):
    """A ``Qwen3Model`` folder serves as an embedder (runner auto -> pooling); 16-token steps split
    the long prompts over chunks, pooled when the last one is computed."""
    folder = make_tiny_qwen3(root, "lasttoken", normalize=True)
    kwargs = {} if max_num_batched_tokens is None else dict(max_num_batched_tokens=16, max_num_seqs=4)
    assert_close_embeddings(_embed(folder, SENTENCES, **kwargs), st_embeddings(folder, SENTENCES))


def test_tiny_qwen3_mean_over_chunks_equals_sentence_transformers(root):
    folder = make_tiny_qwen3(root, "mean", normalize=True, seed=2)
    ours = _embed(folder, SENTENCES, max_num_batched_tokens=16, max_num_seqs=4)
    assert_close_embeddings(ours, st_embeddings(folder, SENTENCES))


def test_matryoshka_dimensions_truncate_then_normalize(root):
    """``dimensions`` keeps the first entries of the pooled vector, then normalizes (vLLM's order),
    for a model whose config.json says ``is_matryoshka``."""
    import json
    from pathlib import Path

    folder = make_tiny_qwen3(root, "lasttoken", normalize=True, seed=3)
    config_path = Path(folder) / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "is_matryoshka": True}))
    raw, short, short_raw = (torch.tensor(v) for v in _embed_each(folder, SENTENCES[0], [
        PoolingParams(normalize=False), PoolingParams(dimensions=16), PoolingParams(dimensions=16, normalize=False)]))
    assert raw.shape == (64,) and short.shape == (16,)
    torch.testing.assert_close(short, torch.nn.functional.normalize(raw[:16], dim=0))
    torch.testing.assert_close(short_raw, raw[:16])


def _embed_each(folder: str, sentence: str, params: list[PoolingParams]) -> list:
    llm = LLM(folder, kv_cache_memory=32 * 2**20)
    try:
        return [o.outputs.embedding for o in llm.embed([sentence] * len(params), params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def test_the_architecture_table_serves_encoders_for_pooling_only():
    from transformers import BertConfig

    from pagedllm.loader.architectures import ARCHITECTURES
    from pagedllm.models.bert import BertModel
    from pagedllm.models.decoder_embedding import DecoderForEmbedding
    from pagedllm.models.registry import get_model_class, model_class_of

    bert = BertConfig(architectures=["BertForMaskedLM"])
    assert get_model_class(bert, "pooling") is BertModel
    with pytest.raises(ValueError, match="^runner: BertModel is an encoder-only model"):
        get_model_class(bert)
    for arch in (a for a in ARCHITECTURES.values() if not a.is_encoder):
        if arch.pooling_implementation is None:  # e.g. the MoE models: no embedder of theirs
            with pytest.raises(ValueError, match="^runner: .* cannot be served as a pooling model"):
                model_class_of(arch, "pooling")
        else:
            assert model_class_of(arch, "pooling") is DecoderForEmbedding
    assert {a.model_type for a in ARCHITECTURES.values() if a.pooling_implementation} >= {"llama", "qwen3", "bert"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_bert_on_cuda_agrees_with_sentence_transformers(root, dtype):
    """The GPU path (varlen flash attention, cuBLAS / Triton linears) in half precision against
    sentence-transformers in float32 on the same weights."""
    folder = make_tiny_bert(root, "mean", normalize=True, seed=4)
    llm = LLM(folder, dtype=dtype, gpu_memory_utilization=0.3)
    try:
        ours = [o.outputs.embedding for o in llm.embed(SENTENCES * 8, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert_close_embeddings(ours, st_embeddings(folder, SENTENCES * 8), min_cosine=0.999)
