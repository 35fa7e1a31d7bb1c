"""The config.json fast path (loader/plain_config.py) against transformers' AutoConfig.

For every config it covers, each attribute pagedllm reads must be what AutoConfig gives (present
or absent alike), and so must everything derived from them (RoPE parameters, the engine's dtype and
context length, ModelConfig's shape, the model built); for anything else it must step aside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.config_builder import _resolve_dtype, _resolve_max_model_len, create_engine_config
from pagedllm.layers.rotary import get_rope_parameters
from pagedllm.loader import ModelSource, gguf_cache_folder, load_hf_config, resolve_model
from pagedllm.loader.hf import _transformers_tag
from pagedllm.loader.plain_config import READ_ATTRIBUTES, PlainConfig, read_plain_config
from pagedllm.models import build_model

ROOT = Path(__file__).resolve().parents[2]
BENCH_CONFIGS = sorted(p.parent for p in (ROOT / "benchmarks" / "configs").glob("*/config.json"))
BENCH_FALLBACKS = {"llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "bge-small-en-v1.5"}  # llama3 RoPE, MoE, BERT
MISSING = object()

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000,
             max_position_embeddings=512, rms_norm_eps=1e-5)
# (name, transformers config class, kwargs): tied/untied, explicit vs absent head_dim and kv heads,
# sliding window on/off, bf16/fp16/none dtype, rope theta set or not.
TF_CONFIGS = [
    ("llama-tied-bf16", "LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=2, dtype="bfloat16")),
    ("llama-untied-headdim-fp16", "LlamaConfig",
     dict(head_dim=32, dtype="float16", rope_theta=500000.0, attention_bias=True, mlp_bias=True)),
    ("llama-no-kv-heads", "LlamaConfig", dict(bos_token_id=5, eos_token_id=[6, 7], pad_token_id=0)),
    ("mistral-window", "MistralConfig", dict(num_key_value_heads=2, sliding_window=256, dtype="bfloat16")),
    ("mistral-no-window-headdim", "MistralConfig", dict(sliding_window=None, head_dim=8, tie_word_embeddings=True)),
    ("mistral-kv-heads-default", "MistralConfig", dict(num_attention_heads=8)),
    ("qwen2-window-off", "Qwen2Config", dict(num_key_value_heads=2, sliding_window=128, dtype="bfloat16")),
    ("qwen2-window-on", "Qwen2Config",
     dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=128, max_window_layers=1, dtype="float16")),
    ("qwen2-no-kv-heads-tied", "Qwen2Config", dict(num_key_value_heads=None, tie_word_embeddings=True)),
    ("qwen3-headdim", "Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, dtype="bfloat16")),
    ("qwen3-default-headdim", "Qwen3Config", dict(num_key_value_heads=2, rope_theta=1e6, attention_bias=True)),
    ("qwen3-window-on", "Qwen3Config", dict(use_sliding_window=True, sliding_window=100, max_window_layers=2)),
]
# Hand-written config.json files: keys absent (so the defaults table is what answers) and older
# spellings (``torch_dtype``, top-level ``rope_theta``, ``rope_scaling`` null or of type "default").
RAW_CONFIGS = {
    **{f"{t}-bare": {"model_type": t} for t in ("llama", "mistral", "qwen2", "qwen3")},
    "llama-old-style": dict(_TINY, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=100000.0,
                            rope_scaling=None, torch_dtype="float16", head_dim=None, num_key_value_heads=None),
    "llama-rope-type-key": dict(_TINY, model_type="llama", rope_scaling={"type": "default"}, rope_theta=5e5),
    "llama-both-dtypes": dict(_TINY, model_type="llama", dtype="bfloat16", torch_dtype="float16"),
    "mistral-defaults": dict(_TINY, model_type="mistral", torch_dtype="bfloat16"),
    "qwen2-window-default-size": dict(_TINY, model_type="qwen2", use_sliding_window=True, max_window_layers=3),
    "llama-fp8-quantized": dict(_TINY, model_type="llama", quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}),
    "qwen3-rope-parameters": dict(_TINY, model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                  sliding_window=None, use_sliding_window=False, n_positions=300),
}


def _save_tf_config(cls_name: str, kwargs: dict, folder: Path) -> Path:
    import transformers

    getattr(transformers, cls_name)(**{**_TINY, **kwargs}).save_pretrained(folder)
    return folder


def _write_config(values: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def _auto_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


@pytest.fixture(params=[p.name for p in BENCH_CONFIGS if p.name not in BENCH_FALLBACKS]  # see test_bench_fallbacks
                + [n for n, _, _ in TF_CONFIGS] + list(RAW_CONFIGS))
def covered_folder(request, tmp_path) -> Path:
    """A config folder the fast path must take."""
    name = request.param
    for p in BENCH_CONFIGS:
        if p.name == name:
            return p
    for n, cls_name, kwargs in TF_CONFIGS:
        if n == name:
            return _save_tf_config(cls_name, kwargs, tmp_path / name)
    return _write_config(RAW_CONFIGS[name], tmp_path / name)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def test_covered_configs_read_like_autoconfig(covered_folder):
    plain = read_plain_config(covered_folder)
    assert isinstance(plain, PlainConfig)
    auto = _auto_config(covered_folder)
    for name in READ_ATTRIBUTES + ("rope_scaling",):
        ours, theirs = getattr(plain, name, MISSING), getattr(auto, name, MISSING)
        assert _same(ours, theirs), f"{name}: plain {ours!r} != AutoConfig {theirs!r}"
    assert get_rope_parameters(plain) == get_rope_parameters(auto)
    assert plain.rope_theta == plain.rope_parameters["rope_theta"]
    assert _resolve_dtype("auto", plain, "cuda") == _resolve_dtype("auto", auto, "cuda")
    assert _resolve_max_model_len(None, plain) == _resolve_max_model_len(None, auto)
    json.dumps(plain.to_dict())  # serialisable


def test_engine_config_is_the_same(covered_folder, monkeypatch):
    """load_hf_config takes the fast path, and create_engine_config resolves the same model config."""
    args = EngineArgs(model=str(covered_folder), device="cpu")
    fast = create_engine_config(args).model_config
    assert isinstance(fast.hf_config, PlainConfig)
    monkeypatch.setenv("PAGEDLLM_PLAIN_CONFIG", "0")
    slow = create_engine_config(args).model_config
    assert not isinstance(slow.hf_config, PlainConfig)
    for name in ("dtype", "max_model_len", "num_kv_heads", "head_dim", "num_layers", "vocab_size"):
        assert _same(getattr(fast, name), getattr(slow, name)), name


@pytest.mark.parametrize("name", ["mistral-window", "qwen3-headdim", "llama-untied-headdim-fp16"])
def test_models_built_from_both_configs_match(name, tmp_path):
    _, cls_name, kwargs = next(c for c in TF_CONFIGS if c[0] == name)
    folder = _save_tf_config(cls_name, kwargs, tmp_path)
    plain, auto = read_plain_config(folder), _auto_config(folder)
    assert isinstance(plain, PlainConfig)
    ours, ref = build_model(plain, torch.float32, "cpu"), build_model(auto, torch.float32, "cpu")
    shapes = [(n, tuple(p.shape)) for n, p in ours.named_parameters()]
    assert shapes == [(n, tuple(p.shape)) for n, p in ref.named_parameters()]
    assert torch.equal(ours.model.rotary_emb.cos_cache, ref.model.rotary_emb.cos_cache)
    assert ours.max_supported_len == ref.max_supported_len
    assert ours.lm_head.tied == ref.lm_head.tied


# ---- fallbacks ----------------------------------------------------------------------------------

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 256}
FALLBACKS = {
    "llama3-rope": dict(_TINY, model_type="llama", rope_scaling=_LLAMA3),
    "yarn-rope": dict(_TINY, model_type="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 128}),
    "linear-rope-parameters": dict(_TINY, model_type="qwen3", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                                "rope_theta": 1e6}),
    "rope-extra-key": dict(_TINY, model_type="llama", rope_scaling={"rope_type": "default", "factor": 1.0}),
    "partial-rotary": dict(_TINY, model_type="llama", partial_rotary_factor=0.5),
    "unknown-type": dict(_TINY, model_type="gpt2"),
    "auto-map": dict(_TINY, model_type="llama", auto_map={"AutoConfig": "configuration_x.XConfig"}),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallbacks_go_to_autoconfig(name, tmp_path):
    folder = _write_config(FALLBACKS[name], tmp_path / name)
    assert read_plain_config(folder) is None
    from transformers import PretrainedConfig

    assert isinstance(load_hf_config(resolve_model(str(folder))), PretrainedConfig)


@pytest.mark.parametrize("values", [
    dict(_TINY, model_type="qwen3", head_dim=None),
    dict(_TINY, model_type="mistral", num_key_value_heads=None),
    dict(_TINY, model_type="llama", vocab_size=1000.0),
    dict(_TINY, model_type="llama", rms_norm_eps=1),
    dict(_TINY, model_type="llama", tie_word_embeddings=None),
    dict(_TINY, model_type="qwen2", use_sliding_window=1),
    dict(_TINY, model_type="llama", num_attention_heads=5),
    dict(_TINY, model_type="llama", torch_dtype="auto"),
    dict(_TINY, model_type="qwen2", layer_types=["full_attention"]),  # not one per layer
], ids=["qwen3-null-head-dim", "mistral-null-kv-heads", "float-size", "int-eps", "null-tie", "int-bool",
        "heads-not-dividing", "dtype-auto", "short-layer-types"])
def test_values_transformers_would_judge_are_left_to_it(values, tmp_path):
    """Values transformers' strict config classes refuse (or we cannot reproduce): not ours to accept."""
    assert read_plain_config(_write_config(values, tmp_path)) is None


def test_missing_or_broken_config_json(tmp_path):
    assert read_plain_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert read_plain_config(tmp_path) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert read_plain_config(tmp_path) is None


def test_bench_fallbacks():
    for folder in BENCH_CONFIGS:
        assert (read_plain_config(folder) is None) == (folder.name in BENCH_FALLBACKS), folder.name


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_env_switch_forces_autoconfig(value, monkeypatch):
    folder = str(ROOT / "benchmarks" / "configs" / "qwen3-0.6b")
    assert isinstance(load_hf_config(resolve_model(folder)), PlainConfig)
    monkeypatch.setenv("PAGEDLLM_PLAIN_CONFIG", value)
    assert not isinstance(load_hf_config(resolve_model(folder)), PlainConfig)


def test_gguf_cached_config_takes_the_fast_path(tmp_path, monkeypatch):
    """A GGUF file's converted config, once in the cache, is read without transformers too."""
    import transformers

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert _transformers_tag() == f"tf{transformers.__version__}"
    cached = gguf_cache_folder(gguf) / f"config-{_transformers_tag()}"
    _save_tf_config("LlamaConfig", dict(tie_word_embeddings=True), cached)
    config = load_hf_config(ModelSource("gguf", str(gguf), "m"))
    assert isinstance(config, PlainConfig) and config.tie_word_embeddings and config.head_dim == 16


def test_plain_config_attribute_errors():
    config = PlainConfig({"model_type": "llama", "hidden_size": 8})
    assert getattr(config, "sliding_window", "absent") == "absent"
    with pytest.raises(AttributeError, match="sliding_window"):
        _ = config.sliding_window


def test_fast_path_does_not_import_transformers_config_classes():
    code = (
        "import sys\n"
        "from pagedllm.loader import load_hf_config, resolve_model\n"
        "config = load_hf_config(resolve_model('benchmarks/configs/qwen3-0.6b'))\n"
        "print(type(config).__name__, 'transformers.configuration_utils' in sys.modules,\n"
        "      'transformers.models.auto.auto_factory' in sys.modules)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PAGEDLLM_PLAIN_CONFIG", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PlainConfig", "False", "False"], out.stdout + out.stderr
