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
