"""EngineArgs validation that is not about one subsystem: aliases and the parallel sizes."""

from types import SimpleNamespace

import pytest

from pagedllm.config import EngineArgs, ParallelConfig


@pytest.mark.parametrize("alias,policy", [("fifo", "fcfs"), ("fcfs", "fcfs"), ("priority", "priority")])
def test_scheduler_policy_is_the_seed_spec_alias_of_scheduling_policy(alias, policy):
    args = EngineArgs(scheduler_policy=alias)
    assert args.scheduling_policy == policy and args.scheduler_policy is None


def test_scheduler_policy_errors_name_the_field():
    with pytest.raises(ValueError, match="scheduler_policy"):
        EngineArgs(scheduler_policy="lifo")
    with pytest.raises(ValueError, match="scheduler_policy='priority' contradicts scheduling_policy='fcfs'"):
        EngineArgs(scheduling_policy="fcfs", scheduler_policy="priority")


def test_data_parallel_is_accepted_but_not_with_ray():
    assert EngineArgs(data_parallel_size=2, tensor_parallel_size=2).data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size > 1 with distributed_executor_backend='ray'"):
        EngineArgs(data_parallel_size=2, distributed_executor_backend="ray")


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_parallel_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        EngineArgs(**{field: value})


def test_tensor_and_pipeline_parallel_run_on_the_multiprocess_executor():
    assert EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2).pipeline_parallel_size == 2
    assert EngineArgs(tensor_parallel_size=2, distributed_executor_backend="mp").distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one rank"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_other_executor_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        EngineArgs(distributed_executor_backend="threads")


def test_ray_backend_is_accepted_with_ray_and_refused_without(monkeypatch):
    import importlib.util

    assert EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").distributed_executor_backend == "ray"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray' needs Ray: pip install 'pagedllm\[ray\]'"):
        EngineArgs(distributed_executor_backend="ray")


SMOLLM2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, intermediate_size=1536,
                          num_hidden_layers=30)


@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 1), (1, 2), (1, 30), (3, 2)])
def test_sizes_that_divide_the_model_are_accepted(tp, pp):
    ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp).verify_model(SMOLLM2)


@pytest.mark.parametrize("tp,pp,message", [
    (2, 1, r"tensor_parallel_size \(2\) must divide the model's num_attention_heads \(9\)"),
    (9, 1, None),
    (1, 4, r"pipeline_parallel_size \(4\) must divide the model's num_hidden_layers \(30\)"),
])
def test_sizes_that_do_not_divide_the_model_are_refused_saying_what_must_divide_what(tp, pp, message):
    config = SimpleNamespace(**{**vars(SMOLLM2), "vocab_size": 49151}) if message is None else SMOLLM2
    message = message or r"tensor_parallel_size \(9\) must divide the model's vocab_size \(49151\)"
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp).verify_model(config)


def test_kv_heads_fewer_than_ranks_must_divide_the_tensor_parallel_size():
    config = SimpleNamespace(**{**vars(SMOLLM2), "num_attention_heads": 12, "num_key_value_heads": 4})
    ParallelConfig(tensor_parallel_size=12).verify_model(config)  # each KV head replicated on 3 ranks
    with pytest.raises(ValueError, match=r"num_key_value_heads \(4\) or be a multiple of it"):
        ParallelConfig(tensor_parallel_size=6).verify_model(config)


def test_swap_preemption_and_swap_space_stay_refused_by_name():
    with pytest.raises(ValueError, match="^preemption_mode"):
        EngineArgs(preemption_mode="swap")
    for value in (4, 0.5):
        with pytest.raises(ValueError, match="^swap_space"):
            EngineArgs(swap_space=value)
    assert EngineArgs(swap_space=0).swap_space == 0  # no swap: nothing to refuse


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "30"])
def test_timeout_s_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="^timeout_s"):
        EngineArgs(timeout_s=value)


def test_otlp_traces_endpoint_must_be_a_url():
    with pytest.raises(ValueError, match="^otlp_traces_endpoint"):
        EngineArgs(otlp_traces_endpoint="  ")


def test_new_engine_fields_are_server_flags():
    """--timeout-s and --otlp-traces-endpoint come from EngineArgs; --disable-log-stats is vLLM's
    server flag (stats on by default, as vLLM's engine; LLM(...) turns them off)."""
    import argparse

    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--timeout-s", "2.5", "--otlp-traces-endpoint", "http://h:4318/v1/traces"]))
    assert args.timeout_s == 2.5 and args.otlp_traces_endpoint == "http://h:4318/v1/traces"
    assert args.disable_log_stats is False
    assert engine_args_from(parser.parse_args(["--disable-log-stats"])).disable_log_stats is True
