"""The wire form of a ``SchedulerOutput`` for the multiprocess executor's broadcast.

Pickling a slotted dataclass goes through Python-level ``__getstate__`` per object, which makes a
step of a few hundred requests cost most of a millisecond to pickle. The wire form replaces each
per-request record with the tuple of its fields (read with one C-level ``attrgetter``), so only
lists, tuples, dicts and ints are pickled; the workers rebuild the records. Generic over the
dataclasses' fields, so a field added to them travels without a change here.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput

_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput)]
_RECORDS = {"scheduled_new_reqs": NewRequestData, "scheduled_cached_reqs": CachedRequestData}
_GETTERS = {name: operator.attrgetter(*[f.name for f in dataclasses.fields(cls)]) for name, cls in _RECORDS.items()}


def encode_scheduler_output(so: SchedulerOutput) -> tuple[Any, ...]:
    """``so`` as a tuple of plain containers (its fields in order, records as field tuples)."""
    return tuple([_GETTERS[name](r) for r in getattr(so, name)] if name in _GETTERS else getattr(so, name)
                 for name in _FIELDS)


def decode_scheduler_output(wire: tuple[Any, ...]) -> SchedulerOutput:
    """The ``SchedulerOutput`` that ``encode_scheduler_output`` encoded."""
    values = dict(zip(_FIELDS, wire))
    for name, cls in _RECORDS.items():
        values[name] = [cls(*fields) for fields in values[name]]
    return SchedulerOutput(**values)
