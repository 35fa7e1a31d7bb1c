"""The broadcast's wire form of a SchedulerOutput decodes to an equal SchedulerOutput."""

import pickle

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.executor.step_codec import decode_scheduler_output, encode_scheduler_output
from pagedllm.sampling_params import SamplingParams


def test_wire_form_round_trips_every_field():
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [9], SamplingParams(temperature=0.5, seed=3), [4, 5], 1)],
        scheduled_cached_reqs=[CachedRequestData("b", [7], 30), CachedRequestData("c", [], 12)],
        num_scheduled_tokens={"a": 3, "b": 2, "c": 1},
        scheduled_spec_decode_tokens={"b": [11]},
        total_num_scheduled_tokens=6,
        finished_req_ids={"d"},
        preempted_req_ids={"e"},
    )
    wire = pickle.loads(pickle.dumps(encode_scheduler_output(so)))
    back = decode_scheduler_output(wire)
    assert back == so
    assert back.scheduled_new_reqs[0].sampling_params.seed == 3


def test_wire_form_holds_no_records():
    so = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("b", [7], 30)])
    wire = encode_scheduler_output(so)
    assert not any(isinstance(v, list) and v and isinstance(v[0], CachedRequestData) for v in wire)
