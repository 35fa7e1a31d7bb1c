"""pagedllm/cpu_threads.py: torch's CPU thread count from the CPUs the process may really use."""

from __future__ import annotations

import os

import pytest

from pagedllm import cpu_threads


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_affinity_counts_and_the_server_leaves_one_for_its_event_loop(four_cpus, tmp_path):
    assert cpu_threads.usable_cpus(tmp_path) == 4  # no cgroup files: no quota
    assert cpu_threads.intra_op_threads(for_server=False, cgroup_root=tmp_path) == 4
    assert cpu_threads.intra_op_threads(for_server=True, cgroup_root=tmp_path) == 3


@pytest.mark.parametrize("files,expected", [
    ({"cpu.max": "150000 100000\n"}, 2),  # v2: 1.5 CPUs' worth of time -> 2 threads
    ({"cpu.max": "max 100000\n"}, 4),
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
])
def test_the_cgroup_quota_caps_the_count(four_cpus, tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_threads.usable_cpus(tmp_path) == expected


def test_two_cpus_are_both_used_by_the_server(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads.intra_op_threads(for_server=True, cgroup_root=tmp_path) == 2


def test_the_knobs_override(four_cpus, monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads.intra_op_threads(for_server=True, cgroup_root=tmp_path) == 1
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "3")  # ours wins
    assert cpu_threads.intra_op_threads(for_server=False, cgroup_root=tmp_path) == 3
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_THREADS"):
        cpu_threads.intra_op_threads(for_server=False, cgroup_root=tmp_path)
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "two")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_THREADS"):
        cpu_threads.intra_op_threads(for_server=False, cgroup_root=tmp_path)


def test_configure_sets_torch(four_cpus, monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "1")
    try:
        assert cpu_threads.configure_torch_threads(for_server=True) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_engine_processes_sharing_the_cpus_take_their_share(four_cpus, monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "6")
    try:
        assert cpu_threads.configure_torch_threads(for_server=True, num_processes=2) == 3
        assert cpu_threads.configure_torch_threads(for_server=True, num_processes=8) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
