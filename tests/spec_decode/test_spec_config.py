"""speculative_config: vLLM's keys, validated at start-up with errors that name the key."""

from __future__ import annotations

import json

import pytest

from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from


def test_ngram_defaults_and_one_bound_sets_both():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,'
                                    ' "prompt_lookup_max": 6}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 6)


def test_a_model_without_method_means_a_draft_model():
    c = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 4})
    assert c.method == "draft_model" and c.model == "some/draft"


@pytest.mark.parametrize("spec, key", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "speculative_config"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_bad_configs_are_refused_at_engine_args_naming_the_key(spec, key):
    with pytest.raises(ValueError) as e:
        EngineArgs(speculative_config=spec)
    assert str(e.value).startswith(key)


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_speculation_with_several_ranks_is_refused_naming_the_key(sizes):
    with pytest.raises(ValueError, match=r"^speculative_config is not supported with tensor_parallel_size"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **sizes)


def test_cli_flag_takes_vllm_json():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    args = engine_args_from(ns)
    assert SpeculativeConfig.from_dict(args.speculative_config).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="^speculative_config"):
        engine_args_from(parser.parse_args(["--speculative-config", '{"method": "nope"}']))


def test_a_draft_model_with_another_vocabulary_is_refused_at_start_up(tmp_path):
    from pagedllm.engine.config_builder import create_engine_config
    from tests.helpers import make_tiny_model

    target = make_tiny_model("llama", tmp_path / "t")
    draft = make_tiny_model("qwen3", tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(config, vocab_size=1000)))
    with pytest.raises(ValueError, match="^speculative_config.model must share"):
        create_engine_config(EngineArgs(model=str(target), speculative_config={"model": str(draft),
                                                                               "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="^speculative_config.model"):
        create_engine_config(EngineArgs(model=str(target), speculative_config={"model": str(tmp_path / "none"),
                                                                               "num_speculative_tokens": 2}))
