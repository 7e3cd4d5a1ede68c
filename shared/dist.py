"""Process groups under torchrun, a few helpers every parallel package needs, and a CPU test harness.

`init_distributed` reads the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and starts a torch.distributed group: NCCL with one GPU per process on CUDA, gloo on CPU.
Without torchrun it starts a 1-rank group, so code that calls collectives runs unchanged as one process.

`run_distributed` spawns N local processes that each look as if torchrun started them, runs a function
in all of them, and returns the per-rank results; a failing rank fails the call at once (the others,
possibly blocked in a collective waiting for it, are killed), so a broken test never hangs.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

# Long enough for one rank to compile kernels or load a checkpoint while the others wait in a
# collective; short enough that a dead peer turns into an error within minutes instead of a hang.
DEFAULT_TIMEOUT_S = 300.0

# torch 2.13 renamed these two (the old names warn FutureWarning); torch 2.11 has only the old names.
# They are the collectives of sequence parallelism and ZeRO, so every package uses these aliases.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class DistEnv:
    """Where this process sits: its global rank, the world size, its rank on this node, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Initialise the default process group from torchrun's environment and return this rank's `DistEnv`.

    backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo. With nccl the process
    uses GPU `local_rank` (set as the current device and bound to the group through `device_id`).
    timeout_s: how long a collective waits for its peers before raising.
    Without torchrun's variables this is a single process: a 1-rank group on an in-memory store (no port
    to pick or collide on), so all_reduce & co. work as identities. Idempotent: if a group already
    exists, its `DistEnv` is returned.
    """
    if dist.is_initialized():
        current = dist.get_backend()
        if backend is not None and backend != current:
            raise ValueError(f"process group already initialised with backend {current!r}, not {backend!r}")
        return _dist_env(current)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    env = _dist_env(backend)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        kwargs["device_id"] = env.device  # NCCL connects eagerly and knows its GPU for barrier()
    if "RANK" in os.environ:
        dist.init_process_group(**kwargs)  # init_method env:// reads MASTER_ADDR / MASTER_PORT
    else:
        dist.init_process_group(**kwargs, store=dist.HashStore(), rank=0, world_size=1)
    return env


def _dist_env(backend: str) -> DistEnv:
    rank, world_size = get_rank(), get_world_size()
    # torchrun always sets LOCAL_RANK; other launchers on one node have local rank == rank.
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = torch.device("cuda", local_rank) if "nccl" in backend else torch.device("cpu")
    return DistEnv(rank, world_size, local_rank, device, backend)


def destroy_distributed() -> None:
    """Destroy the default process group, if there is one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's global rank; before init, torchrun's RANK (0 without torchrun)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    """Number of processes; before init, torchrun's WORLD_SIZE (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """True on rank 0: the one rank that logs, writes checkpoints and prints tables."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for all ranks (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on rank 0 only, flushed, so N ranks do not print N interleaved copies."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


LOG = logging.getLogger("nano_infra")


def report(message: str, write: Callable[[str], Any] | None = None) -> None:
    """One line of a run's output: a logging record where logging is set up for INFO (a Hydra app: the
    console and the run directory's `<job>.log`), else `write(message)` (default: a flushed print)."""
    if LOG.isEnabledFor(logging.INFO) and LOG.hasHandlers():
        LOG.info(message)
    elif write is not None:
        write(message)
    else:
        print(message, flush=True)


def log0(message: str) -> None:
    """`report` on rank 0 only."""
    if is_main():
        report(message)


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average a floating-point tensor over the ranks of `group`, in place, and return it.

    Data parallelism's gradient average and every logged loss. Written as SUM then divide because
    gloo rejects ReduceOp.AVG in torch versions we still support (2.7 does; 2.11 and 2.13 accept it).
    """
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
    return tensor


def find_free_port() -> int:
    """A TCP port on localhost that is free now (the OS may hand it out again once we close it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# Test harness: N processes on one machine, as if launched by torchrun.


class DistributedError(RuntimeError):
    """A rank of `run_distributed` raised or died; `failures` maps rank -> traceback or exit reason."""

    def __init__(self, fn_name: str, failures: dict[int, str]) -> None:
        self.failures = failures
        self.rank = next(iter(failures))  # the first failure seen: usually the cause, the rest follow
        sections = "".join(f"\n--- rank {r} ---\n{text.rstrip()}\n" for r, text in failures.items())
        super().__init__(f"{fn_name} failed on rank {self.rank} (failed ranks: {list(failures)}){sections}")


def _worker(rank: int, world_size: int, port: int, backend: str, job: tuple, conn: Connection) -> None:
    env = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks each using every core would thrash a small CI machine
    fn, args, kwargs = job
    try:
        init_distributed(backend)
        message = ("ok", fn(*args, **kwargs))
        # Plain pickle copies tensor data into the bytes; conn.send() would share tensors through file
        # descriptors that vanish when this process exits, before the parent may have read them.
        conn.send_bytes(pickle.dumps(message))
    except BaseException:
        # Sent before destroying the group, so the parent can kill the peers while they still wait on us.
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        destroy_distributed()
        conn.close()


def _receive(conn: Connection) -> tuple[str, Any] | None:
    """The rank's message if one is waiting; None if nothing is (or the rank died before sending)."""
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except EOFError:
        return None


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"process killed by signal {signal.Signals(-exitcode).name} without a Python exception"
    return f"process exited with code {exitcode} without a Python exception (its stderr may say why)"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` new processes with a process group; return results by rank.

    Each process gets torchrun's variables (a fresh localhost port per call), calls `init_distributed`,
    runs `fn`, returns its result through a pipe and destroys the group. Processes are started with
    "spawn", not "fork": a forked child inherits the parent's CUDA context and threads (OpenMP, gloo),
    which deadlocks or crashes. Hence `fn`, args and results must be picklable, and `fn` must be a
    module-level function (the children import it by name): lambdas and local functions raise TypeError.
    If a rank raises or dies, the others are killed at once and DistributedError names the rank with its
    traceback or exit code. After `timeout_s` in total, all are killed and TimeoutError names the ranks
    that had not finished.
    """
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise TypeError(
            f"run_distributed needs a module-level function that spawned processes can import by name; "
            f"{fn!r} cannot be pickled ({e})"
        ) from e
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx, job = mp.get_context("spawn"), (fn, args, kwargs)
    port, fn_name = find_free_port(), getattr(fn, "__qualname__", repr(fn))
    procs, readers = [], []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}  # insertion order = order seen, so the cause comes first
    killed: set[int] = set()
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, backend, job, writer))
            proc.start()
            writer.close()  # keep only the child's end open, so its death reads as EOF here
            procs.append(proc)
            readers.append(reader)
        deadline = time.monotonic() + timeout_s
        while not failures and len(results) < world_size:
            waiting = [r for r in range(world_size) if r not in results]
            # Wake on a message or on a process exit, whichever comes first; no sleep-polling.
            objects = [readers[r] for r in waiting] + [procs[r].sentinel for r in waiting]
            ready = wait(objects, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(
                    f"{fn_name} did not finish within {timeout_s}s; ranks not finished: {waiting}"
                )
            for r in waiting:
                if readers[r] not in ready and procs[r].sentinel not in ready:
                    continue
                msg = _receive(readers[r])
                if msg is None:
                    procs[r].join(timeout=5.0)  # the pipe hit EOF or the process ended: it is exiting
                    failures[r] = _exit_reason(procs[r].exitcode)
                elif msg[0] == "ok":
                    results[r] = msg[1]
                else:
                    failures[r] = msg[1]
        if not failures:
            for proc in procs:  # every rank has answered; let them tear down their groups
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()  # SIGKILL: works on a rank stuck in a C++ collective, whatever fn installed
                killed.add(rank)
        for proc in procs:
            proc.join()
    if failures:
        # Ranks that failed at about the same time (e.g. a peer of an os._exit rank raising "connection
        # closed") are reported too, after the first.
        for r in range(world_size):
            if r in results or r in failures:
                continue
            msg = _receive(readers[r])
            if msg is not None and msg[0] == "error":
                failures[r] = msg[1]
            elif r not in killed and procs[r].exitcode:
                failures[r] = _exit_reason(procs[r].exitcode)
        raise DistributedError(fn_name, failures)
    for reader in readers:
        reader.close()
    return [results[r] for r in range(world_size)]
