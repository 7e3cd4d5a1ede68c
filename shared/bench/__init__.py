"""The project's one timing helper and the physical limits every bench states, and the entry point of
`python -m shared.bench` (the shared kernels against eager torch and against that eager code under
`torch.compile`, the model's training step against `transformers`: shared.bench_kernels).

Every bench in the repo times with `benchmark`, states its physical limits with
`measure_copy_bandwidth` / `measure_matmul_flops` (reported through `mbu` / `mfu`; MFU also against the
datasheet peak, `datasheet_bf16_flops`), prints with `print_table` and `format_rate` (three significant
digits and an SI prefix: a CPU's matmul reads "43 GFLOP/s", not "0.0 TFLOP/s") and records with
`write_json`, so numbers from different packages are comparable. On a CPU a bench calls
`report_oversubscription(device)` first: it prints `oversubscription_warning`'s line when torch's threads
outnumber the cores free to run them (defined in nano_flashattn/bench_host.py, so the kernel library's
own bench has it too).

    python -m shared.bench                  # GPU: 32768 tokens x 4096 hidden, bf16; CPU: a small smoke run
    python -m shared.bench --quick --json out.json
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from nano_flashattn.bench_host import oversubscription_warning
from shared.accounting import Ceilings, datasheet_for, format_rate  # noqa: F401  (the benches' formatter)


def _device_of(device: str | torch.device | None, args: tuple, kwargs: dict) -> torch.device:
    if device is not None:
        return torch.device(device)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 5,
    repeats: int = 20,
    device: str | torch.device | None = None,
    flush_l2: bool = True,
    graph: bool = False,
    **kwargs: Any,
) -> float:
    """Median seconds of `fn(*args, **kwargs)` over `repeats` calls, after `warmup` untimed calls.

    The device is `device`, else that of the first tensor argument, else the CPU. On CUDA each call
    is bracketed by CUDA events after a short GPU spin that hides the host's launch work (GPU time;
    host overhead is not counted: time it end to end if it matters), and with `flush_l2` a buffer of
    twice the L2 size is overwritten before each call so inputs come from HBM, as in a real model
    whose other layers evict them. With `graph` (CUDA) one call is captured in a CUDA graph and the
    graph replayed: what an engine that replays its steps sees, with no host work inside the events
    (the value checks that synchronize an eager call are skipped under capture). Elsewhere each call is timed with `time.perf_counter` (after a
    CUDA synchronize when CUDA is in use, so pass `device=` for GPU work to get event timing).
    """
    if repeats < 1:
        raise ValueError(f"benchmark: repeats must be >= 1, got {repeats}")
    dev = _device_of(device, args, kwargs)
    if dev.type != "cuda":
        # A CUDA callable timed without naming its device (a lambda has no tensor argument) is still
        # timed to completion, not to the end of its asynchronous launches.
        sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
        for _ in range(warmup):
            fn(*args, **kwargs)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn(*args, **kwargs)
        if graph:
            captured = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(dev)
            with torch.cuda.graph(captured):
                fn(*args, **kwargs)
            fn, args, kwargs = captured.replay, (), {}
        flush = None
        if flush_l2:
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20) or 64 << 20
            flush = torch.empty(2 * l2, dtype=torch.int8, device=dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        torch.cuda.synchronize(dev)
        for start, end in zip(starts, ends):
            if flush is not None:
                flush.zero_()
            # Keep the GPU busy (~0.5 ms spin) while the host enqueues fn, so the events time the
            # kernels, not Python/launch overhead the GPU would otherwise sit idle through.
            torch.cuda._sleep(1_000_000)
            start.record()
            fn(*args, **kwargs)
            end.record()
        torch.cuda.synchronize(dev)
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))


def report_oversubscription(device: str | torch.device) -> str | None:
    """On a CPU, print `oversubscription_warning` once per job and return it (None on a GPU or when the
    threads fit). In a process group rank 0 samples the cores while the others wait at a barrier, so their
    own work is not taken for another program's, and the job's ranks on this host count as its processes."""
    if torch.device(device).type != "cpu":
        return None
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    warning = None
    if not group or dist.get_rank() == 0:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or (dist.get_world_size() if group else 1))
        warning = oversubscription_warning(device, processes=ranks)
        if warning:
            print(warning, flush=True)
    if group:
        dist.barrier()
    return warning


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks: call after dropping one system (an engine, a model)
    and before building the next, which sizes its buffers (a KV cache) from the free memory it sees."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class KernelCompiles:
    """Context manager: the Triton kernel variants first built in this process while it is active.

    Triton compiles (or loads from its disk cache) one variant per new specialisation — argument dtypes,
    divisibility by 16, constexprs — the first time a kernel meets it. A bench wraps its timed region in
    this to show whether compilation leaked into it (`names`: one kernel name per variant; `reprs`: the
    full signature, to see which argument made it new). Uses `triton.knobs.runtime.jit_cache_hook`; off
    where Triton has no such hook (`available` False)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.reprs: list[str] = []
        self.available = False

    def __enter__(self) -> KernelCompiles:
        try:
            from triton import knobs
            self._runtime = knobs.runtime
            self._previous = knobs.runtime.jit_cache_hook
        except (ImportError, AttributeError):
            return self
        self.available = True
        self._runtime.jit_cache_hook = self._hook
        return self

    def _hook(self, *args: Any, **kwargs: Any) -> bool | None:
        fn = kwargs.get("fn")
        self.names.append(getattr(fn, "name", str(fn)))
        self.reprs.append(str(kwargs.get("repr", "")))
        previous = self._previous
        return previous(*args, **kwargs) if previous is not None else None  # None: compile as usual

    def __exit__(self, *exc: Any) -> None:
        if self.available:
            self._runtime.jit_cache_hook = self._previous

    def summary(self) -> str:
        if not self.available:
            return "kernel variants built: unknown (no Triton jit_cache_hook)"
        detail = ", ".join(f"{n} x{c}" for n, c in Counter(self.names).most_common())
        return f"Triton kernel variants first built here: {len(self.names)}" + (f" ({detail})" if detail else "")


# Dense bf16 tensor-core peak of the H100 / H200 SXM datasheets (no sparsity): what published MFUs are
# quoted against. `measure_matmul_flops` gives the rate this process actually reaches.
DATASHEET_BF16_TFLOPS = 989.0
_DATASHEET_GPUS = ("H100", "H200")


def datasheet_bf16_flops(device: str | torch.device) -> float | None:
    """The datasheet's dense bf16 FLOP/s of `device` (H100 / H200 SXM: 989e12), None for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return DATASHEET_BF16_TFLOPS * 1e12 if any(g in name for g in _DATASHEET_GPUS) else None


def mfu(flops_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s as a fraction of a peak (e.g. measured matmul FLOP/s)."""
    if peak_flops <= 0:
        raise ValueError(f"mfu: peak_flops must be > 0, got {peak_flops}")
    return flops_per_second / peak_flops


def mbu(bytes_per_second: float, peak_bandwidth: float) -> float:
    """Memory bandwidth utilisation: achieved bytes/s as a fraction of a peak (e.g. measured copy)."""
    if peak_bandwidth <= 0:
        raise ValueError(f"mbu: peak_bandwidth must be > 0, got {peak_bandwidth}")
    return bytes_per_second / peak_bandwidth


def measure_copy_bandwidth(device: str | torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written: the practical
    ceiling of any memory-bound kernel. Default size: 1 GiB on CUDA (far above L2), 64 MiB elsewhere."""
    dev = torch.device(device)
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 64 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = benchmark(dst.copy_, src, device=dev, flush_l2=False, warmup=3, repeats=10)
    return 2 * nbytes / seconds


def measure_read_bandwidth(device: str | torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a kernel that only reads (a stream of 32-bit words summed in registers, one word written
    per program), as a decode step reads its weights and K/V: the ceiling of read-bound work, which a
    copy (a write per read) understates. CUDA: a Triton kernel over 1 GiB; elsewhere `torch.sum` over
    64 MiB."""
    dev = torch.device(device)
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 64 << 20)
    if dev.type != "cuda":
        words = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        seconds = benchmark(torch.sum, words, device=dev, flush_l2=False, warmup=3, repeats=10)
        return words.numel() * 4 / seconds
    words = torch.ones(nbytes // 4, dtype=torch.int32, device=dev)
    from shared.kernels.read_stream import read_stream
    programs = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(programs, dtype=torch.int32, device=dev)
    seconds = benchmark(read_stream, words, out, device=dev, flush_l2=False, warmup=3, repeats=10)
    return words.numel() * 4 / seconds


def measure_matmul_flops(
    device: str | torch.device, n: int | None = None, dtype: torch.dtype | None = None
) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs): the practical compute ceiling.
    Defaults: n=8192 in bf16 on CUDA, n=512 in fp32 elsewhere."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = n or (8192 if cuda else 512)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = benchmark(torch.mm, a, b, out=c, device=dev, flush_l2=False, warmup=3, repeats=10)
    return 2 * n**3 / seconds


_CEILINGS: dict[str, Ceilings] = {}


def measure_ceilings(device: str | torch.device = "cuda", refresh: bool = False) -> Ceilings:
    """This process's `shared.accounting.Ceilings` for `device`: the copy and read-only bandwidths and the
    matmul peak,
    measured on the first call, the same object afterwards (every number of a run is a fraction of the same
    measurement) unless `refresh`. Call it at process start, before an engine takes the memory."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" are one device, measured once
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    if key not in _CEILINGS or refresh:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        sheet = datasheet_for(name) if dev.type == "cuda" else None
        _CEILINGS[key] = Ceilings(name, measure_copy_bandwidth(dev), measure_matmul_flops(dev),
                                  *(sheet or (None, None)), measure_read_bandwidth(dev))
    return _CEILINGS[key]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return "" if v is None else str(v)


def format_table(rows: list[dict], title: str | None = None) -> str:
    """Rows of dicts as an aligned text table: columns in first-seen key order, numbers right-aligned; keys
    starting with "_" are for the JSON record only."""
    cols = list(dict.fromkeys(k for r in rows for k in r if not k.startswith("_")))
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]

    def line(items: list[str]) -> str:
        return "  ".join(
            s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)
        ).rstrip()

    out = [title] if title else []
    out += [line(cols), "  ".join("-" * w for w in widths)] + [line(row) for row in cells]
    return "\n".join(out)


def print_table(rows: list[dict], title: str | None = None) -> None:
    """Print `format_table(rows, title)`."""
    print(format_table(rows, title), flush=True)


def command_line() -> str:
    """This process's command as a reader would type it: `python -m pkg.module args` for a module run with
    -m (sys.argv[0] is then the module's file path), else the interpreter and its arguments."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return " ".join(["python", "-m", module, *sys.argv[1:]])
    return " ".join([os.path.basename(sys.executable), *sys.argv])


def write_json(path: str | os.PathLike, record: dict) -> dict:
    """Write `record` as JSON, adding when and where it was measured (date, host, GPU, python,
    torch and triton versions, the command line); returns what was written."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": command_line(),
    }
    full = {**meta, **record}
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(full, f, indent=2, default=str)
        f.write("\n")
    return full
