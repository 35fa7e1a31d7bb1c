"""How many threads torch's intra-op pool (and our OpenMP C kernels) may use on the CPU.

torch sizes its pool from the machine's cores, not from the CPUs this process may really use: a
container limited by a cgroup quota, or a process pinned by ``taskset``, oversubscribes its CPUs
and every step waits for the slowest thread. We count the CPUs of the affinity mask, cap them by
the cgroup quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``) and, in the server,
leave one for the event loop (HTTP, JSON, SSE) when more than two are usable.

Override: ``PAGEDLLM_CPU_THREADS=N`` (ours), else ``OMP_NUM_THREADS=N`` (which torch itself honours).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pagedllm import envs

_CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup_root: Path = _CGROUP) -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota (>= 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def cgroup_cpu_quota(root: Path = _CGROUP) -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None when unlimited or unknown."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.is_file():
            quota_us = int(v1.read_text())
            period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None


def intra_op_threads(for_server: bool, cgroup_root: Path = _CGROUP) -> int:
    """The thread count to use: the override if set, else the usable CPUs, less one for the
    server's event loop when more than two are usable (with two, one compute thread halves the
    throughput more than sharing a core with the mostly idle event loop costs)."""
    for name in ("PAGEDLLM_CPU_THREADS", "OMP_NUM_THREADS"):
        value = getattr(envs, name)
        if value is not None:
            if value < 1:
                raise ValueError(f"environment variable {name}={value}: expected a positive integer")
            return value
    cpus = usable_cpus(cgroup_root)
    return cpus - 1 if for_server and cpus > 2 else cpus


def configure_torch_threads(for_server: bool, num_processes: int = 1) -> int:
    """Set torch's intra-op thread count (before a model is loaded) and return it; with
    ``num_processes`` engine processes sharing the CPUs (data parallel), this one's share."""
    import torch  # here: the server's front end imports this module without needing torch

    threads = max(1, intra_op_threads(for_server) // num_processes)
    torch.set_num_threads(threads)
    return threads
