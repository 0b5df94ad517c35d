"""How many intra-op threads torch uses on the CPU (EngineArgs.cpu_threads, --cpu-threads, MOELORA_CPU_THREADS)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from moelora.distributed import torchrun_env

ENV = "MOELORA_CPU_THREADS"
MAX_DEFAULT_THREADS = 8  # the default's cap (see configure_cpu_threads)


def configure_cpu_threads(requested: int | None, device: torch.device, processes: int = 1) -> int | None:
    """Set torch's intra-op thread count for an engine on the CPU; returns the count set, or None when torch was
    left alone (OMP_NUM_THREADS decides) or the device is not a CPU (nothing is changed then).

    The rule, first that applies:
      1. `requested` (EngineArgs.cpu_threads, --cpu-threads), if given; it must be >= 1 (ValueError otherwise,
         whatever the device); every process of a parallel engine takes it as it is;
      2. MOELORA_CPU_THREADS, if set (an integer >= 1; ValueError otherwise; empty counts as unset), likewise;
      3. OMP_NUM_THREADS, if set: torch already read it at start-up, so it is left alone (returns None);
      4. the default, `default_cpu_threads`: the physical cores this process may run on (`available_cores`) minus
         one, split between `processes` (the parallel ranks sharing the host), in 1..MAX_DEFAULT_THREADS (8).

    Why cores minus one, not torch's default (every core): a decode step is hundreds of small ops, each a
    fork/join of the OpenMP team whose every thread must get a core; one core short (the server's event loop, the
    tokenizer, another job) and each op waits for a time slice, so throughput collapses (measured:
    docs/performance-history.md, "CPU engines"). The cap of 8 is not measured: CPU decode is bound by memory
    bandwidth, while every thread added lengthens each fork/join.

    torch.set_num_threads is process-wide: it changes the thread count of everything in this process (another
    engine, the caller's own torch code), and stays after the engine is gone."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--cpu-threads (cpu_threads) must be an integer >= 1, got {requested!r}")
    if device.type != "cpu":
        return None
    n = requested if requested is not None else _from_env()
    if n is None:
        if os.environ.get("OMP_NUM_THREADS", "").strip():
            return None
        n = default_cpu_threads(processes)
    torch.set_num_threads(n)
    return n


def host_processes(args) -> int:
    """The engine's processes on this host, which share its cores (configure_cpu_threads' `processes`), for
    EngineArgs `args`: tensor x expert parallel size (the workers spawned on this host); under torchrun its
    LOCAL_WORLD_SIZE (the ranks it started on this node)."""
    world = args.tensor_parallel_size * args.expert_parallel_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if world > 1 and torchrun_env() is not None and local.isdigit() and int(local) > 0:
        return int(local)
    return world


def _from_env() -> int | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={raw!r}: expected an integer >= 1 (the CPU thread count, as --cpu-threads)")
    return n


def default_cpu_threads(processes: int = 1) -> int:
    """Rule 4 of configure_cpu_threads: max(1, min(MAX_DEFAULT_THREADS, (available_cores() - 1) // processes))."""
    return max(1, min(MAX_DEFAULT_THREADS, (available_cores() - 1) // max(1, processes)))


def available_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask, SMT siblings counted once (from
    /sys topology; every CPU when it is not readable), no more than the cgroup's CPU quota (cgroup v2 cpu.max or
    v1 cfs quota, rounded up)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(c)))
    n = max(1, len(cores))
    quota = _cgroup_quota()
    return max(1, min(n, quota)) if quota is not None else n


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """CPUs the cgroup's quota allows (rounded up), or None without a quota."""
    try:
        path = f"{root}/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
        if os.path.isfile(path):
            quota, period = (Path(path).read_text().split() + ["100000"])[:2]
            if quota != "max" and int(period) > 0:
                return math.ceil(int(quota) / int(period))
            return None
        q = f"{root}/cpu/cpu.cfs_quota_us"
        if os.path.isfile(q):
            quota, period = int(Path(q).read_text()), int(Path(f"{root}/cpu/cpu.cfs_period_us").read_text())
            if quota > 0 and period > 0:
                return math.ceil(quota / period)
    except (OSError, ValueError):
        pass
    return None
