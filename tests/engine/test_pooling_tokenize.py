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


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from pagedllm import LLM
    from tests.embedding_helpers import make_tiny_bert

    llm = LLM(make_tiny_bert(tmp_path_factory.mktemp("pooling-tokenize"), "mean", normalize=True),
              kv_cache_memory=16 * 2**20, max_num_seqs=4)
    yield llm
    llm.llm_engine.shutdown()


def test_encode_tokenizes_ahead_in_chunks_and_keeps_the_input_order(llm, monkeypatch):
    import torch

    from pagedllm.entrypoints import llm as llm_module

    monkeypatch.setattr(llm_module, "_TOKENIZE_CHUNK", 2)  # 4 chunks of texts
    tokenizer = llm.get_tokenizer()
    prompts = [*SENTENCES, {"prompt_token_ids": tokenizer.encode("token ids in the middle")},
               {"prompt": "a dict with text only"}, *TEXTS[4:]]
    batched = llm.encode(prompts, use_tqdm=False)
    one_by_one = [llm.encode(p, use_tqdm=False)[0] for p in prompts]
    assert [o.prompt_token_ids for o in batched] == [o.prompt_token_ids for o in one_by_one]
    assert batched[5].prompt_token_ids == tokenizer.encode("a dict with text only")
    for a, b in zip(batched, one_by_one):
        torch.testing.assert_close(a.outputs.data, b.outputs.data)


def test_a_refused_prompt_in_a_later_chunk_leaves_nothing_behind(llm, monkeypatch):
    import threading

    from pagedllm.entrypoints import llm as llm_module

    monkeypatch.setattr(llm_module, "_TOKENIZE_CHUNK", 2)
    scheduler = llm.llm_engine.engine_core.scheduler
    free_before = scheduler.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError, match="^prompt"):
        llm.encode([*SENTENCES, "", *TEXTS[4:]], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert scheduler.block_pool.get_num_free_blocks() == free_before
    scheduler.check_integrity()
    for thread in threading.enumerate():
        if thread.name.startswith("pagedllm-tokenize"):
            thread.join(timeout=10)
            assert not thread.is_alive()
    assert len(llm.encode(SENTENCES, use_tqdm=False)) == len(SENTENCES)  # the LLM still serves


def test_the_engine_steps_while_a_later_chunk_is_tokenized(llm, monkeypatch):
    import threading

    from pagedllm.entrypoints import llm as llm_module

    monkeypatch.setattr(llm_module, "_TOKENIZE_CHUNK", 2)
    stepped = threading.Event()
    waits: list[bool] = []

    def slow_after_the_first_chunk(tokenizer, texts):
        if waits or not texts:
            waits.append(stepped.wait(timeout=10))  # released by a step of the first chunk's requests
        else:
            waits.append(True)
        return batch_token_ids(tokenizer, texts)

    step = llm.llm_engine.step

    def recording_step():
        stepped.set()
        return step()

    monkeypatch.setattr(llm_module, "batch_token_ids", slow_after_the_first_chunk)
    monkeypatch.setattr(llm.llm_engine, "step", recording_step)
    outputs = llm.encode(SENTENCES, use_tqdm=False)
    assert waits == [True, True]
    assert [o.prompt_token_ids for o in outputs] == [llm.get_tokenizer().encode(s) for s in SENTENCES]


def test_text_dict_prompts_are_tokenized_in_the_batch_not_one_by_one(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    expected = [tokenizer.encode(t) for t in SENTENCES[:2]]

    def refuse(*args, **kwargs):
        raise AssertionError("a prompt was tokenized on its own")

    monkeypatch.setattr(type(tokenizer), "encode", refuse)
    outputs = llm.encode([{"prompt": t} for t in SENTENCES[:2]], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == expected
