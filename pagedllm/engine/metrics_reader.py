"""The engine's metrics as plain objects: ``LLM.get_metrics()`` (vLLM's ``vllm.v1.metrics.reader``).

One object per metric and label set, read from the Prometheus registry that the server's
``/metrics`` renders, so both views show the same numbers under the same ``pagedllm:`` names.
Counters are named without Prometheus' ``_total`` suffix (the family name), as vLLM's reader does.
Cost: O(series in the registry) per snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    """A metric's name and one of its label sets (``{"model_name": ...}``)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of counters (vLLM's type for per-position counts: a counter family with a
    ``position`` label, such as ``spec_decode_num_accepted_tokens_per_pos``)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations per bucket: ``buckets`` maps each upper bound (the ``le`` label, "+Inf" last) to
    the cumulative count of observations up to it; ``count`` equals the "+Inf" bucket."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry, prefix: str = "pagedllm:") -> list[Metric]:
    """Every gauge, counter and histogram of ``registry`` whose name starts with ``prefix``."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples if s.name == family.name]
        elif family.type == "counter":
            total = [s for s in family.samples if s.name == family.name + "_total"]
            if any("position" in s.labels for s in total):
                collected += _vectors(family.name, total)
            else:
                collected += [Counter(family.name, dict(s.labels), int(s.value)) for s in total]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _vectors(name: str, samples: list) -> list[Vector]:
    """One Vector per label set (``position`` aside) of a per-position counter, in position order."""
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        labels = frozenset((k, v) for k, v in s.labels.items() if k != "position")
        by_labels.setdefault(labels, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, dict(labels), [counts.get(p, 0) for p in range(max(counts) + 1)])
            for labels, counts in by_labels.items()]


def _histograms(family) -> list[Histogram]:
    """One Histogram per label set of a histogram family (its ``_bucket``, ``_count``, ``_sum`` samples)."""
    by_labels: dict[frozenset, Histogram] = {}

    def histogram(labels: dict[str, str]) -> Histogram:
        key = frozenset(labels.items())
        if key not in by_labels:
            by_labels[key] = Histogram(family.name, labels, 0, 0.0, {})
        return by_labels[key]

    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        if s.name == family.name + "_bucket":
            histogram(labels).buckets[s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            histogram(labels).count = int(s.value)
        elif s.name == family.name + "_sum":
            histogram(labels).sum = s.value
    return list(by_labels.values())
