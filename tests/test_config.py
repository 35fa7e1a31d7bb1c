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


def test_data_parallel_is_refused_until_built():
    assert EngineArgs(data_parallel_size=1).data_parallel_size == 1
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported yet"):
        EngineArgs(data_parallel_size=2)


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
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        EngineArgs(distributed_executor_backend="threads")


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
