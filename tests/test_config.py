"""EngineArgs validation that is not about one subsystem: aliases and the sizes of one rank."""

import pytest

from pagedllm.config import EngineArgs


@pytest.mark.parametrize("alias,policy", [("fifo", "fcfs"), ("fcfs", "fcfs"), ("priority", "priority")])
def test_scheduler_policy_is_the_seed_spec_alias_of_scheduling_policy(alias, policy):
    args = EngineArgs(scheduler_policy=alias)
    assert args.scheduling_policy == policy and args.scheduler_policy is None


def test_scheduler_policy_errors_name_the_field():
    with pytest.raises(ValueError, match="scheduler_policy"):
        EngineArgs(scheduler_policy="lifo")
    with pytest.raises(ValueError, match="scheduler_policy='priority' contradicts scheduling_policy='fcfs'"):
        EngineArgs(scheduling_policy="fcfs", scheduler_policy="priority")


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_parallel_sizes_above_one_are_refused_by_name(field):
    assert getattr(EngineArgs(**{field: 1}), field) == 1
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: 2})


def test_other_executor_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(distributed_executor_backend="ray")
