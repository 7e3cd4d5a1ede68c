"""Compile nano_flashattn's kernels for a GPU on a machine without one: registers, spills, shared memory.

    python tools/flashattn_compile_check.py [--head-dims 64 96 128] [--dtype bf16] [--arch 90] [--ptx-dir DIR]

Runs each launcher (forward, backward, decode) on meta tensors with the configs of `configs.py`,
captures the kernel launches instead of running them, compiles every captured kernel with Triton's own
compiler for `sm_<arch>` (the NVIDIA backend ships with the Triton wheel) and assembles the PTX with its
ptxas to read the register count and spill bytes. Specialisation follows Triton's launcher (pointers 16-byte
aligned, integers divisible by 16 marked so, `do_not_specialize` honoured), so the code is the code a GPU
run would build with this Triton. `--ptx-dir` keeps each kernel's PTX, to diff two trees of the code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without an install

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nano_flashattn import backward, configs, decode, forward

KERNELS = {forward: ["_fwd_kernel"], backward: ["_bwd_preprocess", "_bwd_dkdv_kernel", "_bwd_dq_kernel"],
           decode: ["_decode_split_kernel", "_combine_kernel"]}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}
CUDA = torch.device("cuda")


class Capture:
    """Stands in for a kernel: `kernel[grid](**kwargs)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((self.kernel, kwargs))


def signature(kernel, kwargs: dict):
    """Triton's signature, constants and divisibility attributes for these launch arguments."""
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = kwargs[p.name]
        if p.is_constexpr or v is None or isinstance(v, (bool, str)):
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name], attrs[(i,)] = "*" + TYPES[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, int) and not p.do_not_specialize and v == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
        elif isinstance(v, int):
            sig[p.name] = "i32" if abs(v) < 2**31 else "i64"
            if not p.do_not_specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    return sig, consts, attrs


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) from the ptxas in Triton's NVIDIA backend (the newest one it ships)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
    regs, spill = re.search(r"Used (\d+) registers", info), re.search(r"(\d+) bytes spill stores", info)
    if regs is None:
        raise RuntimeError(info.strip()[:500])
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def launches(head_dim: int, dtype=torch.bfloat16) -> list:
    """The kernel launches of one forward, backward and decode (contiguous and paged) at bench shapes."""
    captured = []
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, Capture(getattr(module, name), captured))
    meta = torch.device("meta")
    heads, seqlen, batch = max(1, 2048 // head_dim), 1024, 2
    q = torch.empty(batch * seqlen, heads, head_dim, device=meta, dtype=dtype)
    lse = torch.empty(heads, batch * seqlen, device=meta)
    fwd, bwd = configs.fwd_config(head_dim, dtype, CUDA), configs.bwd_config(head_dim, dtype, CUDA)
    forward.attention_forward(q, q, q, batch, seqlen, seqlen, None, None, None, 0.1, 1 << 30, 0, config=fwd)
    backward.attention_backward(q, q, q, q, q, lse, batch, seqlen, seqlen, None, None, 0.1, 1 << 30, 0,
                                config=bwd)
    qd = torch.empty(64, 1, 32, head_dim, device=meta, dtype=dtype)
    lens = torch.empty(64, device=meta, dtype=torch.int32)
    for paged in (False, True):
        shape = (64 * 256, 16, 8, head_dim) if paged else (64, 4096, 8, head_dim)
        cache = torch.empty(shape, device=meta, dtype=dtype)
        table = torch.empty(64, 256, device=meta, dtype=torch.int32) if paged else None
        cfg = configs.decode_config(head_dim, dtype, CUDA, paged, 64 * 8)
        decode.decode_forward(qd, cache, cache, lens, table, 0.1, False, 0, config=cfg)
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, getattr(module, name).kernel)
    return captured


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--ptx-dir", help="write each kernel's PTX here")
    args = p.parse_args(argv)
    configs.num_sms = lambda device: 132  # an H100 / H200
    for head_dim in args.head_dims:
        dtype = {v: k for k, v in TYPES.items()}[args.dtype]
        for i, (kernel, kwargs) in enumerate(launches(head_dim, dtype)):
            kwargs = dict(kwargs)
            options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
            sig, consts, attrs = signature(kernel, kwargs)
            target = GPUTarget("cuda", args.arch, 64)
            compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target, options=options)
            regs, spill = ptxas_usage(compiled.asm["ptx"], args.arch)
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                Path(args.ptx_dir, f"hd{head_dim}_{i}_{kernel.__name__}.ptx").write_text(compiled.asm["ptx"])
            launch = f"warps {options['num_warps']}  stages {options['num_stages']}"
            print(f"hd{head_dim:<4} {kernel.__name__:<22} registers {regs:>3}  spill {spill:>5} B  shared "
                  f"{compiled.metadata.shared:>6} B  {launch}", flush=True)


if __name__ == "__main__":
    main()
