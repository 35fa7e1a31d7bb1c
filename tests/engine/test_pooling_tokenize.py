"""``batch_token_ids``: the batched tokenization of ``LLM.encode`` / ``LLM.embed`` gives each text
the ids ``tokenizer.encode`` gives it, on its fast path (the Rust backend's ``encode_batch_fast``)
and where the backend's own settings send it to the tokenizer's ``__call__``."""

from __future__ import annotations

import pytest

from pagedllm.engine.input_processor import batch_token_ids
from tests.embedding_helpers import SENTENCES, _save_bert_tokenizer
from tests.helpers import default_tokenizer

TEXTS = [*SENTENCES, "  leading and trailing spaces  ", "Ünïcödé — naïve café 🚀", "[SEP] [CLS] <|endoftext|>",
         "line one\nline two\ttab", "x" * 300]


@pytest.fixture(scope="module", params=["smollm2", "bert"])
def tokenizer(request, tmp_path_factory):
    if request.param == "smollm2":
        return default_tokenizer()
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bert-tokenizer")
    _save_bert_tokenizer(folder, 30522)
    return AutoTokenizer.from_pretrained(folder)


def test_batched_ids_equal_one_by_one_encoding(tokenizer):
    assert batch_token_ids(tokenizer, TEXTS) == [tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]


def test_fast_path_does_not_go_through_the_tokenizer_call(tokenizer, monkeypatch):
    expected = [tokenizer.encode(t) for t in TEXTS]

    def refuse(*args, **kwargs):
        raise AssertionError("the batched __call__ ran")

    monkeypatch.setattr(type(tokenizer), "__call__", refuse)
    assert batch_token_ids(tokenizer, TEXTS) == expected


def test_a_backend_that_truncates_takes_the_tokenizer_call(tokenizer):
    expected = tokenizer(TEXTS, add_special_tokens=True)["input_ids"]
    tokenizer._tokenizer.enable_truncation(4)
    try:
        ids = batch_token_ids(tokenizer, TEXTS)
    finally:
        tokenizer._tokenizer.no_truncation()
    assert ids == expected and max(map(len, ids)) > 4  # as the engine's one-by-one path: no truncation
