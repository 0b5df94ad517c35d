"""configure_cpu_threads (moelora/engine/cpu_threads.py): --cpu-threads, then MOELORA_CPU_THREADS, then
OMP_NUM_THREADS (torch left alone), then the cores this process may use minus one, split between the ranks of a
host, capped; nothing on a GPU; clear errors for counts below 1. torch's thread count is restored after each
test (set_num_threads is process-wide)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from moelora.engine import cpu_threads
from moelora.engine.cpu_threads import (MAX_DEFAULT_THREADS, available_cores, configure_cpu_threads,
                                        default_cpu_threads, host_processes)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    n = torch.get_num_threads()
    for var in ("MOELORA_CPU_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield
    torch.set_num_threads(n)


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: n)


@pytest.mark.parametrize("cores, processes, want", [
    (1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 1, 3), (8, 1, 7), (9, 1, 8), (64, 1, MAX_DEFAULT_THREADS),
    (2, 2, 1), (8, 2, 3), (17, 2, 8), (64, 4, MAX_DEFAULT_THREADS), (4, 8, 1),
])
def test_default_rule(monkeypatch, cores, processes, want):
    """Cores minus one (one left for the server's event loop, the tokenizer, the rest of the machine), split
    between the host's ranks, at least 1, at most the cap; set in torch and returned."""
    _cores(monkeypatch, cores)
    torch.set_num_threads(5)
    assert default_cpu_threads(processes) == want
    assert configure_cpu_threads(None, CPU, processes=processes) == want
    assert torch.get_num_threads() == want


def test_this_machine():
    n = available_cores()
    assert 1 <= n <= (os.cpu_count() or 1)
    assert configure_cpu_threads(None, CPU) == torch.get_num_threads() == max(1, min(MAX_DEFAULT_THREADS, n - 1))


def test_requested_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("MOELORA_CPU_THREADS", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert configure_cpu_threads(3, CPU, processes=2) == 3  # as given, whatever the ranks
    assert torch.get_num_threads() == 3


def test_moelora_cpu_threads_wins_over_omp_num_threads(monkeypatch):
    _cores(monkeypatch, 64)
    monkeypatch.setenv("MOELORA_CPU_THREADS", " 2 ")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert configure_cpu_threads(None, CPU) == 2
    assert torch.get_num_threads() == 2


def test_omp_num_threads_leaves_torch_alone(monkeypatch):
    _cores(monkeypatch, 64)
    monkeypatch.setenv("MOELORA_CPU_THREADS", "")  # empty: unset
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, CPU) is None
    assert torch.get_num_threads() == 2


def test_not_a_cpu_leaves_torch_alone(monkeypatch):
    monkeypatch.setenv("MOELORA_CPU_THREADS", "3")
    torch.set_num_threads(2)
    for device in (torch.device("cuda"), torch.device("cuda", 1), torch.device("meta")):
        assert configure_cpu_threads(None, device) is None
        assert configure_cpu_threads(4, device) is None
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_requested_below_one_is_an_error(bad, device):
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match=r"--cpu-threads") as e:
        configure_cpu_threads(bad, torch.device(device))
    assert "\n" not in str(e.value) and repr(bad) in str(e.value)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_bad_moelora_cpu_threads_is_an_error(monkeypatch, bad):
    monkeypatch.setenv("MOELORA_CPU_THREADS", bad)
    with pytest.raises(ValueError, match=r"MOELORA_CPU_THREADS") as e:
        configure_cpu_threads(None, CPU)
    assert "\n" not in str(e.value)
    assert configure_cpu_threads(1, CPU) == 1  # an explicit count does not read the variable


def test_available_cores_follows_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert available_cores() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(os.cpu_count() or 1)))
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: 1)
    assert available_cores() == 1


@pytest.mark.parametrize("content, want", [("150000 100000\n", 2), ("100000 100000", 1), ("max 100000\n", None),
                                           ("50000 100000", 1)])
def test_cgroup_v2_quota(tmp_path, content, want):
    (tmp_path / "cpu.max").write_text(content)
    assert cpu_threads._cgroup_quota(str(tmp_path)) == want


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads._cgroup_quota(str(tmp_path)) == 3
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads._cgroup_quota(str(tmp_path)) is None
    assert cpu_threads._cgroup_quota(str(tmp_path / "nothing")) is None


def test_host_processes(monkeypatch):
    args = SimpleNamespace(tensor_parallel_size=2, expert_parallel_size=2)
    assert host_processes(SimpleNamespace(tensor_parallel_size=1, expert_parallel_size=1)) == 1
    assert host_processes(args) == 4  # spawned on this host
    for k, v in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    assert host_processes(args) == 2  # torchrun over two nodes: two ranks here
