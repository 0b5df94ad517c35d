"""Worker processes of a tensor/expert-parallel engine on one host.

Rank 0 (the engine's process) schedules, owns the slot pool and the KV block tables, and broadcasts over a gloo group
each eager step's metadata (the flat batch's sequences, which rows want logits) or each CUDA-graph decode step's
inputs (every rank captured the same graphs at start-up). Ranks 1..N-1 run `worker_main`: they hold their shard of
the model and of the KV cache, repeat rank 0's slot writes (events `(slot, adapter name | None)` sent with the next
message) and run the same forward, whose collectives pair up with rank 0's.

Failure: rank 0 checks the worker processes before every message and every POLL_S while one is pending (gloo
usually fails a collective with a dead peer at once, but can leave a send pending until the collective timeout),
and a collective that fails because a peer went away is re-raised as WorkerFailed naming the rank, its pid and
exit code. Workers are daemons of rank 0, so they end with it.

Lifetime: `WorkerGroup.stop` (LLMEngine.shutdown, LLM.shutdown / its `with` block / its garbage collection) tells
the workers to finish, reaps them and leaves the process group, so a second parallel engine can start in the same
process; a group nobody stopped is stopped at interpreter exit (`_LIVE`).

Under torchrun (`check_launch`: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, WORLD_SIZE = tp x ep; one or many
nodes) nothing is spawned: every process joins the process group from the environment (env://), global rank 0
is the engine and ranks 1..N-1 call `run_worker`. There are no child processes to watch, so rank 0 pings the
workers when it has not heard from them for PING_INTERVAL_S (a broadcast and a gloo monitored barrier that names
the ranks that did not answer), and any collective failing with a communication error becomes WorkerFailed.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import pickle
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moelora.adapters.registry import AdapterRegistry
from moelora.adapters.slots import clear_slot, write_slot
from moelora.config import ModelConfig
from moelora.distributed import ParallelState, check_launch, free_port, init_parallel, kv_cache_config, shard_model
from moelora.engine.cpu_threads import configure_cpu_threads, host_processes
from moelora.engine.kv_cache import KVCache
from moelora.engine.memory import kv_blocks, memory_baseline
from moelora.engine.model_runner import ModelRunner, graph_settings
from moelora.engine.warmup import warm_up
from moelora.kernels._triton import DeviceError
from moelora.kernels.config import KernelConfig
from moelora.kernels.streams import make_side_stream
from moelora.models.loader import build_model

log = logging.getLogger(__name__)

# rank 0's rendezvous and collective timeout (workers wait for the next step however long rank 0 is idle)
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MOELORA_COLLECTIVE_TIMEOUT_S", "600"))
_IDLE = timedelta(days=365)
# torchrun: rank 0 pings the workers after this long without a completed step, and waits this long for answers
PING_INTERVAL_S = float(os.environ.get("MOELORA_PING_INTERVAL_S", "2"))
PING_TIMEOUT_S = float(os.environ.get("MOELORA_PING_TIMEOUT_S", "20"))
POLL_S = 0.5  # rank 0 checks its spawned workers this often while a control message is pending


class WorkerFailed(RuntimeError):
    pass


def engine_dtype(args, device: torch.device) -> str:
    return args.dtype or ("float32" if device.type == "cpu" else "auto")


def worker_device(args, local_rank: int) -> torch.device:
    """This rank's device: GPU `local_rank` of its host (made the current device), or the CPU."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise DeviceError(f"local rank {local_rank} needs GPU {local_rank}, but this host has "
                               f"{torch.cuda.device_count()}: start at most that many processes per node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def build_sharded_model(cfg, args, dtype: str, device: torch.device, ps: ParallelState, show_progress: bool = False):
    """build_model + shard_model for one rank. Split over several ranks on a GPU, the whole model is loaded into
    host memory first and only this rank's shard moves to the device (a model that outgrows one GPU still
    loads); dummy weights are drawn on the GPU (the unsharded model must fit there once); on the CPU, or
    unsplit, it is built in place."""
    if ps.is_parallel and args.quantization is not None:
        raise NotImplementedError(f"quantization={args.quantization!r} with tensor/expert parallelism is not "
                                  "supported yet (quantized shards)")
    # dummy weights (benchmarks) are drawn on the GPU itself: drawing 30B random parameters in host memory in
    # every rank took minutes; the whole unsharded model must then fit on one GPU once
    on_device = not ps.is_parallel or (device.type == "cuda" and args.load_format == "dummy")
    stage = device if on_device else torch.device("cpu")

    def build(where: torch.device):
        return build_model(cfg, args.model, dtype=dtype, device=where, max_loras=args.max_loras,
                           max_lora_rank=args.max_lora_rank, load_format=args.load_format, seed=args.seed,
                           show_progress=show_progress, quantization=args.quantization,
                           kernel_config=args.kernel_config)

    try:
        model = build(stage)
    except torch.cuda.OutOfMemoryError:
        if not ps.is_parallel:
            raise
        torch.cuda.empty_cache()  # the unsharded dummy model outgrows one GPU: draw it in host memory instead
        log.warning("rank %d: the unsharded dummy model does not fit on %s; drawing it in host memory (slower)",
                    ps.rank, device)
        stage = torch.device("cpu")
        model = build(stage)
    shard_model(model, ps)
    if stage != device:
        model.to(device)
    elif ps.is_parallel and device.type == "cuda":
        torch.cuda.empty_cache()  # the unsharded weights' blocks, back to the GPU before the memory plan
    model.set_overlap(args.lora_overlap and device.type == "cuda")
    return model


def _post(msg: tuple, group) -> list:
    """Rank 0: broadcast one message on the control group as two asynchronous broadcasts (its pickled size, then
    its bytes); returns the two works. `_recv` is the workers' side."""
    data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)  # (n,)
    size = torch.tensor([data.numel()], dtype=torch.int64)  # (1,)
    return [dist.broadcast(size, src=0, group=group, async_op=True),
            dist.broadcast(data, src=0, group=group, async_op=True)]


def _recv(ps: ParallelState) -> tuple[list, str, tuple]:
    """A worker: the next message of rank 0 (`_post`): (slot events, kind, payload)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=ps.control_group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=ps.control_group)
    return pickle.loads(data.numpy().tobytes())


def worker_main(rank: int, world: int, port: int, args) -> None:
    """Rank `rank` of a parallel engine started by WorkerGroup: build and shard the model, then serve rank 0's
    messages until "stop"."""
    ps = _join(args, f"tcp://127.0.0.1:{port}", rank, world, _IDLE)
    _worker_loop(ps, args, rank, rank)
    # stopped cleanly (group left, graphs freed): end here, without the interpreter's teardown, where gloo's
    # objects (still referenced past destroy_process_group) can be freed after Python is gone and the worker
    # then dies of SIGABRT (seen once on a loaded machine: exit code -6)
    del ps
    gc.collect()  # the process groups' objects (see run_worker)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: nothing to flush
            stream.flush()
    os._exit(0)


def run_worker(args) -> int:
    """A rank other than 0 of a torchrun launch (`moelora serve`/`generate` call this on ranks 1..N-1; a script
    using EngineArgs can too): join the process group from the environment, then repeat rank 0's steps until it
    says "stop" (returns 0) or goes away (raises)."""
    env = check_launch(args.tensor_parallel_size, args.expert_parallel_size)
    if env is None or env.rank == 0:
        raise RuntimeError("run_worker is for ranks 1..N-1 of a torchrun launch (RANK >= 1, WORLD_SIZE = tp x ep)")
    if _backend(args) == "nccl":
        worker_device(args, env.local_rank)  # before the NCCL group forms
    ps = _join(args, "env://", env.rank, env.world_size, _IDLE)
    beacon = _beacon()
    if beacon is not None:
        beacon.start(env.rank)
    _worker_loop(ps, args, env.rank, env.local_rank, beacon)
    del ps
    # the process groups' objects, which the model's hooks and the ParallelState held past destroy_process_group,
    # freed now, while the interpreter is whole, rather than in its teardown
    gc.collect()
    return 0


class _Beacon:
    """torchrun: what rank 0 can learn about the workers from outside the process group, through the launch's
    TCPStore (MASTER_ADDR:MASTER_PORT): each worker's host and pid, a heartbeat counter it bumps every
    BEAT_S, and its exception if it raised one. With it rank 0's error names the rank that went away."""

    BEAT_S = 0.5

    def __init__(self) -> None:
        run, restart = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"moelora/{run}/{restart}/"
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=30))
        self.host = socket.gethostname()

    # worker side
    def start(self, rank: int) -> None:
        self.store.set(f"{self.prefix}who/{rank}", f"host {self.host}, pid {os.getpid()}")
        self._stop = threading.Event()

        def beat() -> None:
            n = 0
            while not self._stop.wait(self.BEAT_S):
                n += 1
                try:
                    self.store.set(f"{self.prefix}beat/{rank}", str(n))
                except Exception:  # noqa: BLE001 - the store (rank 0's side) is gone: nothing to tell
                    return

        threading.Thread(target=beat, daemon=True, name="moelora-beacon").start()

    def error(self, rank: int, e: BaseException) -> None:
        with contextlib.suppress(Exception):  # the store (rank 0's side) is gone: nothing to tell
            self.store.set(f"{self.prefix}error/{rank}", _first_line(e))

    def stop(self) -> None:
        self._stop.set()

    # rank 0 side
    def _get(self, key: str) -> str | None:
        key = self.prefix + key
        return self.store.get(key).decode() if self.store.check([key]) else None

    def diagnose(self, world: int) -> str:
        """Which workers raised, or stopped beating over a few beats."""
        try:
            beats = {r: self._get(f"beat/{r}") for r in range(1, world)}
            time.sleep(self.BEAT_S * 5)
            out = []
            for r in range(1, world):
                who = self._get(f"who/{r}") or "not started"
                err = self._get(f"error/{r}")
                if err is not None:
                    out.append(f"worker rank {r} ({who}) failed: {err}")
                elif self._get(f"beat/{r}") == beats[r]:
                    out.append(f"worker rank {r} ({who}) stopped (no heartbeat)")
            return "; ".join(out) or "every worker still has a heartbeat"
        except Exception as e:  # noqa: BLE001 - the store itself may be gone (hosted by a failed node)
            return f"the workers' state is unknown ({_first_line(e)})"


def _beacon() -> _Beacon | None:
    try:
        return _Beacon()
    except Exception as e:  # noqa: BLE001 - without it only the names of the failed ranks are missing
        log.warning("moelora: no worker beacon through the launch's store: %s", e)
        return None


def _worker_loop(ps: ParallelState, args, rank: int, local_rank: int, beacon: _Beacon | None = None) -> None:
    runner = None
    try:
        device = worker_device(args, local_rank)
        # on the CPU the ranks of a host share its cores (rank 0 makes the same choice in LLMEngine)
        configure_cpu_threads(getattr(args, "cpu_threads", None), device, processes=host_processes(args))
        cfg = ModelConfig.from_pretrained(args.model)
        baseline = memory_baseline(args, device)
        model = build_sharded_model(cfg, args, engine_dtype(args, device), device, ps)
        if device.type == "cuda":  # before the graphs are captured, as rank 0's LLMEngine makes its own
            make_side_stream(device, (args.kernel_config or KernelConfig()).side_stream_priority)
        max_model_len = args.max_model_len or cfg.max_position_embeddings
        _, kind, payload = _recv(ps)
        if kind == "plan":  # GPU memory plan: profile with rank 0 (collectives pair up), agree on the fewest blocks
            mine, _ = kv_blocks(model, kv_cache_config(cfg, ps), args, max_model_len, device, baseline)
            dist.all_reduce(torch.tensor([mine]), op=dist.ReduceOp.MIN, group=ps.control_group)
            _, kind, payload = _recv(ps)
        if kind != "init":
            raise RuntimeError(f"rank {rank}: expected the 'init' message from rank 0, got {kind!r}")
        (num_blocks,) = payload
        kv = KVCache(kv_cache_config(cfg, ps), num_blocks, args.block_size, model.dtype, device)
        targets = model.lora_targets() if args.max_loras else {}
        registry = AdapterRegistry(targets, args.max_lora_rank, args.max_cpu_loras) if targets else None
        # the same CUDA graphs as rank 0, captured now (rank 0 captures right after sending "init")
        runner = ModelRunner(model, kv, args.max_loras, **graph_settings(args, model, device, max_model_len))
        warm_up(model, kv, args, max_model_len)  # as rank 0 does, right after its runner
        handlers = {"step": runner.forward_step, "graph": runner.replay,
                    "ping": lambda: dist.monitored_barrier(group=ps.control_group, timeout=_IDLE),
                    "load": lambda *a: registry.load(*a), "unload": lambda *a: registry.unload(*a)}
        while True:
            events, kind, payload = _recv(ps)
            for slot, name in events:
                if name is None:
                    clear_slot(targets, slot)
                else:
                    write_slot(targets, registry.get(name), slot)
            if kind == "stop":
                break
            if kind not in handlers:
                raise RuntimeError(f"rank {rank}: unknown message {kind!r} from rank 0")
            handlers[kind](*payload)
    except BaseException as e:
        if beacon is not None:
            beacon.error(rank, e)
        raise
    finally:
        if beacon is not None:
            beacon.stop()
        if runner is not None:
            try:
                runner.release_graphs()  # before the process group goes (see StepGraphs.release)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.warning("rank %d: freeing the CUDA graphs: %s", rank, e)
        _leave_group()


def _backend(args) -> str:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.startswith("cuda") else "gloo"


def _join(args, init_method: str, rank: int, world: int, timeout: timedelta | None = None) -> ParallelState:
    """init_parallel for EngineArgs `args` (its tp x ep grid; NCCL on a GPU, gloo on the CPU). timeout None: rank 0's,
    COLLECTIVE_TIMEOUT_S."""
    return init_parallel(args.tensor_parallel_size, args.expert_parallel_size, _backend(args), init_method, rank, world,
                         timeout=timeout or timedelta(seconds=COLLECTIVE_TIMEOUT_S))


class WorkerGroup:
    """Rank 0's side: starts ranks 1..N-1 (spawned processes, a free local port), joins the process group with
    them, and sends them each step. Under torchrun (external=True) the ranks are torchrun's processes: nothing is
    spawned and the group forms from the environment."""

    def __init__(self, args) -> None:
        self.world = args.tensor_parallel_size * args.expert_parallel_size
        if dist.is_initialized():
            gc.collect()  # an unreachable LLM (a reference cycle) still holding the group: its finalizer leaves it
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group (another parallel "
                               "engine still running? call its shutdown() first, or use `with LLM(...) as llm:`)")
        self._events: list[tuple[int, str | None]] = []
        self._stopped = False
        self._serving = False  # the workers have had "init": they are in their message loop and answer pings
        self.procs: list = []
        self.beacon = None
        # at interpreter exit, called before stop(): the owner's own release (LLM: the engine's shutdown, which
        # frees rank 0's CUDA graphs before the group is left); it must not reference this group strongly
        self.on_exit = None
        launch = check_launch(args.tensor_parallel_size, args.expert_parallel_size)
        self.external = launch is not None
        if self.external:
            if launch.rank != 0:
                raise RuntimeError(
                    f"under torchrun only rank 0 runs the engine; this is rank {launch.rank}: call "
                    "moelora.engine.workers.run_worker(EngineArgs(...)) on ranks 1..N-1 (moelora serve and "
                    "moelora generate do)")
            if _backend(args) == "nccl":
                worker_device(args, launch.local_rank)
            self.state: ParallelState = _join(args, "env://", 0, self.world)
            self._last_ok = time.monotonic()
            self.beacon = _beacon()
            _LIVE.add(self)
            return
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, self.world, port, args), daemon=True,
                                  name=f"moelora-rank{r}") for r in range(1, self.world)]
        _LIVE.add(self)
        try:
            for p in self.procs:
                p.start()
            self.state: ParallelState = self._rendezvous(args, port)
        except BaseException:
            self._abandon()  # nothing to tell the workers: end them, leave whatever group formed
            _LIVE.discard(self)
            raise

    def _rendezvous(self, args, port: int) -> ParallelState:
        box: dict = {}

        def join() -> None:  # in a thread, so that a worker dying before the rendezvous is seen at once
            try:
                box["ps"] = _join(args, f"tcp://127.0.0.1:{port}", 0, self.world)
            except Exception as e:  # noqa: BLE001 - re-raised below with the workers' state
                box["error"] = e

        t = threading.Thread(target=join, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            self.check()
        if "error" in box:
            self.check(grace_s=2.0)
            raise WorkerFailed(f"could not form the process group of {self.world} ranks: {box['error']}")
        return box["ps"]

    def check(self, grace_s: float = 0.0, ping: bool = False) -> None:
        """Raise WorkerFailed if a worker has exited (waiting up to grace_s for one to show its exit). Under
        torchrun: ping the workers if no step has completed for PING_INTERVAL_S (or now, with ping=True), once they
        have had "init" (before it they are building their models and expect "plan" or "init", not a ping)."""
        if self.external:
            if self._serving and not self._stopped and (ping or time.monotonic() - self._last_ok >= PING_INTERVAL_S):
                self._ping()
            return
        self._check_procs(grace_s)

    def _check_procs(self, grace_s: float) -> None:
        """Spawned workers: raise WorkerFailed if one has exited (waiting up to grace_s for one to)."""
        deadline = time.monotonic() + grace_s
        while not (dead := [(i + 1, p) for i, p in enumerate(self.procs) if p.exitcode is not None]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if dead and not self._stopped:
            r, p = dead[0]
            self._abandon()
            raise WorkerFailed(f"tensor/expert-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                               "the engine cannot continue (see the worker's traceback above, if any)")

    def _ping(self) -> None:
        """torchrun: every worker must answer a monitored barrier within PING_TIMEOUT_S."""
        msg, self._events = (list(self._events), "ping", ()), []
        try:
            self._wait(_post(msg, self.state.control_group))
            dist.monitored_barrier(group=self.state.control_group, timeout=timedelta(seconds=PING_TIMEOUT_S),
                                   wait_all_ranks=True)
        except Exception as e:  # noqa: BLE001 - re-raised as WorkerFailed
            raise self._failed(f"a worker did not answer rank 0's ping: {_first_line(e)}") from e
        self._last_ok = time.monotonic()

    def _failed(self, what: str) -> WorkerFailed:
        """torchrun: stop using the group (there are no processes of its own to end) and say so."""
        self._abandon()
        who = self.beacon.diagnose(self.world) if self.beacon is not None else "unknown"
        return WorkerFailed(
            f"tensor/expert-parallel worker failure under torchrun ({self.world} ranks): {who}. Rank 0 saw: {what}. "
            "The engine cannot continue (see the worker's traceback and torchrun's error summary, if any)")

    @contextlib.contextmanager
    def guard(self, what: str):
        """Context manager: an exception inside (a collective whose peer died) becomes WorkerFailed when a
        worker has exited."""
        self.check()
        try:
            yield
        except WorkerFailed:
            raise
        except BaseException as exc:
            if not self.external:
                try:
                    self.check(grace_s=5.0)
                except WorkerFailed as failed:
                    raise failed from exc
            elif _is_comm_error(exc):
                raise self._failed(f"a collective failed during {what!r}: {_first_line(exc)}") from exc
            raise
        if self.external and what == "step":  # a completed step had every rank in its collectives
            self._last_ok = time.monotonic()

    def slot_changed(self, slot: int, name: str | None) -> None:
        """SlotPool.on_change: the write travels with the next message."""
        self._events.append((slot, name))

    def send(self, kind: str, *payload) -> None:
        if self._stopped:
            raise WorkerFailed("the engine's worker processes have stopped")
        msg, self._events = (list(self._events), kind, payload), []
        with self.guard(kind):
            self._wait(_post(msg, self.state.control_group))
        self._serving = self._serving or kind == "init"

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the workers contribute theirs after a "plan" message)."""
        t = torch.tensor([int(value)])
        with self.guard("plan"):
            self._wait([dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.state.control_group, async_op=True)])
        return int(t.item())

    def _wait(self, works: list) -> None:
        """Wait for rank 0's asynchronous control-group collectives, checking the workers every POLL_S while one
        is pending: gloo can leave a send to a peer that died while the group was idle pending until the
        collective timeout instead of failing it, so a dead worker is found by its exit code (spawned workers;
        under torchrun, where there are none to watch, the wait is plain)."""
        for w in works:
            while True:
                try:
                    w.wait() if self.external else w.wait(timeout=timedelta(seconds=POLL_S))
                    break
                except RuntimeError:
                    if self.external or w.is_completed():  # the collective's own error, not the poll's timeout
                        raise
                    self._check_procs(0.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to finish, wait for them (terminated after timeout_s), leave the process group.
        Idempotent; after it this process can join a new process group (another parallel engine)."""
        _LIVE.discard(self)
        if self._stopped:  # stopped, or failed (which left the group): the process group now may be another engine's
            return
        with contextlib.suppress(Exception):  # stopping anyway
            self.send("stop")
        self._stopped = True  # from here on, workers exiting is the stop, not a failure
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._abandon()

    def _abandon(self) -> None:
        """Stop using the workers: end those still running, reap them all (no zombie processes left behind) and
        leave the process group."""
        self._stopped = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            if p.pid is not None:  # started
                p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
        _leave_group()


# the groups not stopped yet, for the interpreter's exit (a weak set: an engine garbage-collected away takes its
# group along, see LLM). Registered after torch.multiprocessing's import, so it runs before multiprocessing's
# own exit hook terminates the daemonic workers: they get "stop" and end cleanly.
_LIVE: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


@atexit.register
def _stop_live_groups() -> None:
    for group in list(_LIVE):
        try:
            if group.on_exit is not None:
                group.on_exit()
            group.stop()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("stopping the parallel engine's workers at exit: %s", e)


def _is_comm_error(e: BaseException) -> bool:
    """A collective that failed because a peer went away or timed out (not a bug in this rank's own step)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("gloo", "nccl", "connection", "peer", "timed out", "broken pipe", "socket"))


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


LEAVE_TIMEOUT_S = 10.0  # a dead peer must still let the server exit within 30 s


def _leave_group(timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """destroy_process_group, bounded: if it has not returned after timeout_s (a peer gone, a communicator still
    held), warn and abort the group instead, so that shutting down never hangs."""
    if not dist.is_initialized():
        return
    errors: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a group with a dead peer: nothing more to release
            errors.append(e)

    t = threading.Thread(target=destroy, name="moelora-leave-group", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("leaving the process group took over %.0f s (a peer gone or a collective pending): aborting it",
                    timeout_s)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
            except Exception as e:  # noqa: BLE001 - nothing more to do
                log.warning("aborting the process group: %s", e)
    elif errors:
        log.warning("leaving the process group: %s", errors[0])
