"""How many intra-op threads torch uses on the CPU (EngineArgs.cpu_threads, --cpu-threads, MOELORA_CPU_THREADS)."""

from __future__ import annotations

import math
import os

import torch

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
      4. the default: the physical cores this process may run on (os.sched_getaffinity, SMT siblings counted once,
         no more than a cgroup CPU quota allows) minus one, split between `processes` (the tensor/expert-parallel
         ranks sharing the host), at least 1 and at most MAX_DEFAULT_THREADS (8): `default_cpu_threads`.

    Why cores minus one, not torch's default (every core): a decode step is hundreds of small ops, each a
    fork/join of the OpenMP team, and every thread of the team must get a core before the op ends. One core short
    (the server's event-loop thread beside the engine thread, the tokenizer, a benchmark client, another job on
    the machine) and each op waits for a scheduler time slice, so throughput collapses instead of dropping a bit.
    Measured on a 2-core Xeon VM shared with other jobs (float32, tokens/s, several runs of each, interleaved):
      - `moelora demo --device cpu` (the 7.1M-parameter demo model, 3 adapters): while the machine was busy (load
        average 3-4) torch's default (2 threads) 9-47, OMP_NUM_THREADS=2 11-37, OMP_NUM_THREADS=1 263-440; in
        quiet moments (load 1.5) default 458-470, 2 threads 541 and 17, 1 thread 500-570;
      - `moelora serve --device cpu` + `moelora bench serve` (16 clients, 64 requests; load 2.5-4): default
        160-368, 2 threads 172-248, 1 thread 238-454 (median 412);
      - engine decode at batch 16 over dummy Qwen3-MoE models, 1 thread vs 2: 9M parameters 874-1258 vs
        14-1305, 231M 117 vs 1.6, 1.3B 28-33 vs 3.7-34 (2 threads win by 4% at best, lose by up to 8x).
    Alone, a matmul does gain from a second core ([16, H] x [H, 4H]: 1.6x at H = 256, 1.9x at H = 4096 on a quiet
    machine), so threads do pay where cores are to spare: the default grows with the cores, keeping one for the
    rest of the process and of the machine. The cap of 8 is not measured (2 cores here): decode on the CPU is
    bound by memory bandwidth, which a few cores per socket already saturate, while every thread added lengthens
    each fork/join; ask for more with --cpu-threads / MOELORA_CPU_THREADS.

    torch.set_num_threads is process-wide: it changes the thread count of everything in this process (another
    engine, the caller's own torch code), and stays after the engine is gone.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--cpu-threads (cpu_threads) must be an integer >= 1, got {requested!r}")
    if device.type != "cpu":
        return None
    n = requested
    if n is None:
        n = _from_env()
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
    from moelora.distributed import torchrun_env

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
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                pkg = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            cores.add((pkg, core))
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
            with open(path) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
            if quota != "max" and int(period) > 0:
                return math.ceil(int(quota) / int(period))
            return None
        q = f"{root}/cpu/cpu.cfs_quota_us"
        if os.path.isfile(q):
            with open(q) as f:
                quota = int(f.read())
            with open(f"{root}/cpu/cpu.cfs_period_us") as f:
                period = int(f.read())
            if quota > 0 and period > 0:
                return math.ceil(quota / period)
    except (OSError, ValueError):
        pass
    return None
