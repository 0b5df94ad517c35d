"""Worker processes of a tensor/expert-parallel engine on one host.

The engine's own process is rank 0: it schedules, owns the slot pool and the KV block tables, and before each
eager step broadcasts the step's metadata (the flat batch's sequences and which rows want logits) over a gloo
group; ranks 1..N-1 run `worker_main`: they hold their shard of the model and of the KV cache, repeat rank 0's
slot writes (events `(slot, adapter name | None)` sent with the next message, so every rank makes the same
slot and eviction decisions: rank 0's) and run the same forward, whose collectives pair up with rank 0's.

Failure: a watchdog on rank 0 checks the worker processes before every message, and a collective that fails
because a peer went away (gloo sees the closed connection at once) is re-raised as WorkerFailed naming the
rank, its pid and exit code. Workers are daemons of rank 0, so they end with it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moelora.distributed import ParallelState, free_port, init_parallel, kv_cache_config, shard_model

log = logging.getLogger(__name__)

# rank 0's rendezvous and collective timeout (workers wait for the next step however long rank 0 is idle)
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MOELORA_COLLECTIVE_TIMEOUT_S", "600"))
_IDLE = timedelta(days=365)


class WorkerFailed(RuntimeError):
    pass


def engine_dtype(args, device: torch.device) -> str:
    return args.dtype or ("float32" if device.type == "cpu" else "auto")


def worker_device(args, rank: int) -> torch.device:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(device)


def build_sharded_model(cfg, args, dtype: str, device: torch.device, ps: ParallelState, show_progress: bool = False):
    """build_model + shard_model for one rank. Split over several ranks on a GPU, the whole model is loaded into
    host memory first and only this rank's shard moves to the device (a model that outgrows one GPU still
    loads); on the CPU, or unsplit, it is built in place."""
    from moelora.models.loader import build_model

    if ps.is_parallel and args.quantization is not None:
        raise NotImplementedError(f"quantization={args.quantization!r} with tensor/expert parallelism is not "
                                  "supported yet (quantized shards)")
    stage = torch.device("cpu") if ps.is_parallel else device
    model = build_model(cfg, args.model, dtype=dtype, device=stage, max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank, load_format=args.load_format, seed=args.seed,
                        show_progress=show_progress, quantization=args.quantization)
    shard_model(model, ps)
    if stage != device:
        model.to(device)
    model.set_overlap(args.lora_overlap and device.type == "cuda")
    return model


def _recv(ps: ParallelState) -> tuple[list, str, tuple]:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=ps.control_group)
    return box[0]


def worker_main(rank: int, world: int, port: int, args) -> None:
    """Rank `rank` of a parallel engine started by WorkerGroup: build and shard the model, then serve rank 0's
    messages until "stop"."""
    from moelora.adapters.registry import AdapterRegistry
    from moelora.adapters.slots import clear_slot, write_slot
    from moelora.config import ModelConfig
    from moelora.engine.kv_cache import KVCache
    from moelora.engine.model_runner import ModelRunner

    ps = init_parallel(args.tensor_parallel_size, args.expert_parallel_size, _backend(args),
                       f"tcp://127.0.0.1:{port}", rank, world, timeout=_IDLE)
    try:
        device = worker_device(args, rank)
        cfg = ModelConfig.from_pretrained(args.model)
        model = build_sharded_model(cfg, args, engine_dtype(args, device), device, ps)
        _, kind, (num_blocks,) = _recv(ps)
        if kind != "init":
            raise RuntimeError(f"rank {rank}: expected the 'init' message from rank 0, got {kind!r}")
        kv = KVCache(kv_cache_config(cfg, ps), num_blocks, args.block_size, model.dtype, device)
        targets = model.lora_targets() if args.max_loras else {}
        registry = AdapterRegistry(targets, args.max_lora_rank, args.max_cpu_loras) if targets else None
        runner = ModelRunner(model, kv, args.max_loras)
        while True:
            events, kind, payload = _recv(ps)
            for slot, name in events:
                if name is None:
                    clear_slot(targets, slot)
                else:
                    write_slot(targets, registry.get(name), slot)
            if kind == "step":
                runner.forward_step(*payload)
            elif kind == "load":
                registry.load(*payload)
            elif kind == "unload":
                registry.unload(*payload)
            elif kind == "stop":
                break
            else:
                raise RuntimeError(f"rank {rank}: unknown message {kind!r} from rank 0")
    finally:
        dist.destroy_process_group()


def _backend(args) -> str:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.startswith("cuda") else "gloo"


class WorkerGroup:
    """Rank 0's side: starts ranks 1..N-1 (spawned processes, a free local port), joins the process group with
    them, and sends them each step."""

    def __init__(self, args) -> None:
        self.world = args.tensor_parallel_size * args.expert_parallel_size
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group (another parallel "
                               "engine still running? call its shutdown() first)")
        self._events: list[tuple[int, str | None]] = []
        self._stopped = False
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(r, self.world, port, args), daemon=True,
                                  name=f"moelora-rank{r}") for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        atexit.register(self.stop)
        box: dict = {}

        def join() -> None:  # in a thread, so that a worker dying before the rendezvous is seen at once
            try:
                box["ps"] = init_parallel(args.tensor_parallel_size, args.expert_parallel_size, _backend(args),
                                          f"tcp://127.0.0.1:{port}", 0, self.world,
                                          timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
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
        self.state: ParallelState = box["ps"]

    def check(self, grace_s: float = 0.0) -> None:
        """Raise WorkerFailed if a worker has exited (waiting up to grace_s for one to show its exit)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [(i + 1, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if dead and not self._stopped:
            r, p = dead[0]
            self._stopped = True
            self._terminate()
            _leave_group()
            raise WorkerFailed(
                f"tensor/expert-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}; the engine "
                "cannot continue (see the worker's traceback above, if any)"
            )

    def guard(self, what: str):
        """Context manager: an exception inside (a collective whose peer died) becomes WorkerFailed when a
        worker has exited."""
        group = self

        class _Guard:
            def __enter__(self):
                group.check()

            def __exit__(self, exc_type, exc, tb):
                if exc is not None and not isinstance(exc, WorkerFailed):
                    try:
                        group.check(grace_s=5.0)
                    except WorkerFailed as failed:
                        raise failed from exc
                return False

        return _Guard()

    def slot_changed(self, slot: int, name: str | None) -> None:
        """SlotPool.on_change: the write travels with the next message."""
        self._events.append((slot, name))

    def send(self, kind: str, *payload) -> None:
        if self._stopped:
            raise WorkerFailed("the engine's worker processes have stopped")
        msg, self._events = [(list(self._events), kind, payload)], []
        with self.guard(kind):
            dist.broadcast_object_list(msg, src=0, group=self.state.control_group)

    def step(self, seqs, sample_idx, prompt_idx) -> None:
        """ModelRunner.broadcast."""
        self.send("step", seqs, sample_idx, prompt_idx)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to finish, wait for them, leave the process group."""
        if self._stopped:
            return
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self._stopped = True
        for p in self.procs:
            p.join(timeout_s)
        self._terminate()
        _leave_group()

    def _terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()


def _leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - a group with a dead peer: nothing more to release
            log.warning("leaving the process group: %s", e)
