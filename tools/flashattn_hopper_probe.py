"""Probe Triton's Hopper features and time the `nano_flashattn.layers.hopper` forward variants against cuDNN.

    python tools/flashattn_hopper_probe.py --out hopper_probe.log      (an sm_90 GPU; about 3 minutes)

1. Features: small kernels, each compiled and run in its own process (a compiler crash costs one line):
   device-made tensor descriptors, host `TensorDescriptor`s, `tl.range(warp_specialize=True)` on a matmul,
   `disallow_acc_multi_buffer`, a persistent grid with `flatten`, warp specialisation of the persistent
   loop, and the older launch options `num_consumer_groups` / `num_buffers_warp_spec`. Each prints ok or
   the exception's type and first line. Then what the compiler made of each head_dim 128 variant for
   sm_90: registers and spill stack, shared memory, warps, whether warp specialisation was applied
   (`--compile-only` prints just these, on any machine: no GPU needed).
2. Correctness: every forward variant (compiled in parallel worker processes, which also fills Triton's
   cache for step 3) against torch SDPA in fp32 on the same bf16 inputs: ||out - ref|| / ||ref|| < 1e-2 and
   max |LSE - ref| < 1e-2, causal and not; the default config also on a packed variable-length batch.
3. Timing (median, triton.testing.do_bench) of the variants that passed, torch SDPA cuDNN and flash, and
   the paper path (`nano_flashattn.flash_attn_func`), in this process: head_dim 128 at seqlen 4k (batch 16)
   and 16k (batch 4), causal and not, head_dim 64 at 16k; 32 heads, bf16. TFLOP/s count
   4 * B * H * S^2 * D, halved when causal. A final table gives each variant's TFLOP/s / cuDNN's.
Everything printed goes to --out too, and the results to --out + ".json".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nano_flashattn.layers.hopper import HopperConfig  # noqa: E402

HC = HopperConfig
WS = dict(warp_specialize=True, two_phase=False, num_warps=4)  # Triton splits only a single loop, at 4 warps
# head_dim 128: tiles and stages around the default, then each Hopper knob. Dropped after compiling them for
# sm_90 with Triton 3.9: 4-warp 128 x 64 and split 128 x 128 tiles (register spills), warp specialisation
# of the two-phase loops or at 8 warps (silently not applied), 3 stages of 128 x 128 with it (shared memory).
VARIANTS_128: dict[str, HopperConfig] = {
    "default": HC(),
    "m128n64s3": HC(block_n=64, num_stages=3),
    "m128n128s3": HC(num_stages=3),
    "m64n64w4s3": HC(block_m=64, block_n=64, num_warps=4, num_stages=3),
    "m64n128w4s2": HC(block_m=64, num_warps=4),
    "one-loop": HC(two_phase=False),
    "split-n64": HC(split_m=True, block_n=64),
    "ws": HC(**WS),
    "ws-n64s3": HC(**WS, block_n=64, num_stages=3),
    "ws-no-acc-multibuf": HC(**WS, disallow_acc_multi_buffer=True),
    "ws-m64": HC(**WS, block_m=64),
    "pointer-loads": HC(use_tma=False),
}
VARIANTS_64: dict[str, HopperConfig] = {
    "default": HC(num_stages=3),
    "m128n64s3": HC(block_n=64, num_stages=3),
    "one-loop": HC(two_phase=False, num_stages=3),
    "ws": HC(**WS, num_stages=3),
}
SHAPES = [  # (head_dim, seqlen, batch, causal); 32 heads
    (128, 4096, 16, True), (128, 4096, 16, False), (128, 16384, 4, True), (128, 16384, 4, False),
    (64, 16384, 4, True), (64, 16384, 4, False),
]
HEADS, TOL = 32, 1e-2
CHECK_LENS = {False: [1000, 1000], True: [1000, 37, 513, 300]}  # sequence lengths of the correctness check
DEVICE, DTYPE = "cuda", torch.bfloat16  # the checks also run on CPU under TRITON_INTERPRET=1 with fp16


# ---------------------------------------------------------------------------------------------------------
# 1. feature kernels


@triton.jit
def _mm_kernel(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr,
               NO_ACC_MULTIBUF: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
               NUM_SMS: tl.constexpr):
    """C = A B^T through device-made descriptors, with the tl.range knobs under test."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    step = NUM_SMS if PERSISTENT else tiles
    for tile in tl.range(tl.program_id(0), tiles, step, flatten=FLATTEN, warp_specialize=WS and PERSISTENT):
        pm, pn = tile // tiles_n, tile % tiles_n
        acc = tl.zeros([BM, BN], tl.float32)
        for kk in tl.range(0, K, BK, warp_specialize=WS and not PERSISTENT,
                           disallow_acc_multi_buffer=NO_ACC_MULTIBUF):
            acc = tl.dot(a_desc.load([pm * BM, kk]), b_desc.load([pn * BN, kk]).T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(C.dtype.element_ty))


@triton.jit
def _host_desc_copy(x_desc, y_desc, BM: tl.constexpr):
    y_desc.store([tl.program_id(0) * BM, 0], x_desc.load([tl.program_id(0) * BM, 0]) * 2)


def feature(name: str) -> str:
    """Run one feature check on the GPU; returns 'ok ...' or raises."""
    from nano_flashattn.layers.hopper import _ensure_allocator

    _ensure_allocator()
    if name == "host_descriptor":
        from triton.tools.tensor_descriptor import TensorDescriptor

        x = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        _host_desc_copy[(8,)](TensorDescriptor.from_tensor(x, [128, 128]),
                              TensorDescriptor.from_tensor(y, [128, 128]), BM=128)
        assert torch.equal(y, x * 2), "wrong values"
        return "ok"
    m = n = k = 2048
    a, b = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flags = dict(WS=False, NO_ACC_MULTIBUF=False, PERSISTENT=False, FLATTEN=False)
    extra = {}
    flags.update({
        "device_descriptor": {}, "warp_specialize": {"WS": True},
        "disallow_acc_multi_buffer": {"NO_ACC_MULTIBUF": True},
        "persistent_flatten": {"PERSISTENT": True, "FLATTEN": True},
        "persistent_warp_specialize": {"PERSISTENT": True, "WS": True},
        "num_consumer_groups": {},
    }[name])
    if name == "num_consumer_groups":
        extra = {"num_consumer_groups": 2, "num_buffers_warp_spec": 3}
    grid = (sms,) if flags["PERSISTENT"] else (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
    _mm_kernel[grid](a, b, c, m, n, k, BM=128, BN=128, BK=64, NUM_SMS=sms, num_warps=8, num_stages=3,
                     **flags, **extra)
    ref = (a.float() @ b.float().T)
    err = ((c.float() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"relative error {err:.2e}"
    return f"ok (rel err {err:.1e})"


FEATURES = ["device_descriptor", "host_descriptor", "warp_specialize", "disallow_acc_multi_buffer",
            "persistent_flatten", "persistent_warp_specialize", "num_consumer_groups"]


# ---------------------------------------------------------------------------------------------------------
# 2. correctness of one variant (a worker process; compiling here fills Triton's cache for the timing)


def _reference(q, k, v, causal: bool):
    """fp32 SDPA output and natural-log LSE of (B, S, H, D) inputs."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    return out.transpose(1, 2), torch.logsumexp(s, -1)  # (B, S, H, D), (B, H, S)


def _errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    rel = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    return rel, (lse - ref_lse).abs().max().item()


def check_variant(head_dim: int, cfg: HopperConfig, causal: bool, varlen: bool) -> str:
    from nano_flashattn.checks import NO_WINDOW
    from nano_flashattn.layers.hopper import hopper_forward

    torch.manual_seed(0)
    right = 0 if causal else NO_WINDOW
    lens = CHECK_LENS[varlen]
    qs = [torch.randn(1, n, HEADS, head_dim, device=DEVICE, dtype=DTYPE) for n in lens]
    ks, vs = [torch.randn_like(t) for t in qs], [torch.randn_like(t) for t in qs]
    cat = [torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out, lse = hopper_forward(*cat, batch=len(lens), seqlen_q=max(lens), seqlen_k=max(lens),
                              cu_seqlens_q=cu if varlen else None, cu_seqlens_k=cu if varlen else None,
                              block_table=None, scale=head_dim**-0.5, window_left=NO_WINDOW,
                              window_right=right, config=cfg)
    worst = (0.0, 0.0)
    for i, n in enumerate(lens):
        ref_out, ref_lse = _reference(qs[i], ks[i], vs[i], causal)
        rows = slice(int(cu[i]), int(cu[i]) + n)
        e = _errors(out[rows][None], lse[:, rows][None], ref_out, ref_lse)
        worst = (max(worst[0], e[0]), max(worst[1], e[1]))
    if not (worst[0] < TOL and worst[1] < TOL):
        raise AssertionError(f"rel err {worst[0]:.2e}, LSE err {worst[1]:.2e} (limit {TOL})")
    return f"ok (rel err {worst[0]:.1e}, LSE err {worst[1]:.1e})"


def compile_report(head_dim: int, cfg: HopperConfig, causal: bool) -> str:
    """Compile the forward for sm_90 without launching it (no GPU needed) and read what the compiler made of
    the knobs: registers and spill stack per thread, shared memory, the warps it launches, whether warp
    specialisation was applied and TMA used."""
    import inspect
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nano_flashattn.layers.hopper import _hopper_fwd_kernel

    names = list(inspect.signature(_hopper_fwd_kernel.fn).parameters)
    ints = {"seqlen_q", "seqlen_k", "group", "window_left", "window_right", "stride_qt", "stride_qh",
            "stride_kt", "stride_kh", "stride_lse_h"}
    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "LSE": "*fp32", "cu_seqlens_q": "*i32",
             "cu_seqlens_k": "*i32", "qk_scale": "fp32", **dict.fromkeys(ints, "i32")}
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, VARLEN=False,
                     REVERSE=causal,
                     SPLIT_M=cfg.split_m, TWO_PHASE=cfg.two_phase, WARP_SPECIALIZE=cfg.warp_specialize,
                     DISALLOW_ACC_MULTI_BUFFER=cfg.disallow_acc_multi_buffer, USE_TMA=cfg.use_tma)
    aligned = {"Q", "K", "V", "Out", "LSE", "stride_qt", "stride_qh", "stride_kt", "stride_kh"}
    src = ASTSource(fn=_hopper_fwd_kernel, signature={n: types.get(n, "constexpr") for n in names},
                    constexprs={(names.index(n),): v for n, v in constants.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    usage = ""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                 text=True).stdout
        usage = " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()
                         if w.split(":")[0] in ("REG", "STACK"))
    return (f"ok {usage} smem {kernel.metadata.shared} warps {kernel.metadata.num_warps} "
            f"warp_specialized {'ttg.warp_specialize' in kernel.asm['ttgir']} "
            f"tma {'cp.async.bulk.tensor' in kernel.asm['ptx']}")


def worker(job: dict) -> None:
    """Entry of a worker process: run one job, print one JSON line."""
    try:
        if job["kind"] == "feature":
            result = {"ok": True, "msg": feature(job["name"])}
        elif job["kind"] == "compile":
            result = {"ok": True, "msg": compile_report(job["head_dim"], HopperConfig(**job["cfg"]),
                                                        job["causal"])}
        else:
            result = {"ok": True, "msg": check_variant(job["head_dim"], HopperConfig(**job["cfg"]),
                                                       job["causal"], job["varlen"])}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as e:  # reported, not fatal: this is what the probe is for
        result = {"ok": False, "msg": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"}
    print("RESULT " + json.dumps(result), flush=True)


def run_jobs(jobs: list[dict], deadline: float) -> list[dict]:
    """Each job in its own process (a compiler abort cannot take the probe down), up to 16 at a time; a job
    still running at `deadline` (perf_counter) is killed and reported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def one(job: dict) -> dict:
        t0 = time.perf_counter()
        timeout_s = max(5.0, deadline - t0)
        try:
            p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                               text=True, timeout=timeout_s, env=env)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                res = json.loads(lines[-1][7:])
            else:
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
                res = {"ok": False, "msg": f"worker died (rc {p.returncode}): {tail[:160]}"}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "msg": f"TimeoutExpired: no result in {timeout_s:.0f} s"}
        return {**job, **res, "seconds": round(time.perf_counter() - t0, 1)}

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1, len(jobs))) as pool:
        return list(pool.map(one, jobs))


# ---------------------------------------------------------------------------------------------------------
# 3. timing


def time_shape(head_dim, seqlen, batch, causal, variants: dict[str, HopperConfig], deadline: float) -> dict:
    import nano_flashattn as fa
    from nano_flashattn.bench import sdpa_backend, time_ms
    from nano_flashattn.checks import NO_WINDOW
    from nano_flashattn.layers.hopper import hopper_forward

    dev = torch.device("cuda")
    shape = (batch, seqlen, HEADS, head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * HEADS * seqlen * seqlen * head_dim / (2 if causal else 1)
    rows = [t.view(-1, HEADS, head_dim) for t in (q, k, v)]
    right = 0 if causal else NO_WINDOW
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    runs = {}
    for backend in ("cudnn", "flash"):
        def sdpa(backend=backend):
            with sdpa_backend(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        runs[f"sdpa-{backend}"] = sdpa
    def paper():
        with fa.performance_layers(False):
            return fa.flash_attn_func(q, k, v, causal=causal)

    runs["paper"] = paper
    for name, cfg in variants.items():
        runs[name] = (lambda cfg=cfg: hopper_forward(*rows, batch, seqlen, seqlen, None, None, None,
                                                     head_dim**-0.5, NO_WINDOW, right, config=cfg))
    tflops = {}
    with torch.no_grad():
        for name, fn in runs.items():
            if time.perf_counter() > deadline:
                tflops[name] = "skipped: time budget"
                continue
            try:
                tflops[name] = round(flops / time_ms(dev, fn) / 1e9, 1)
            except Exception as e:
                tflops[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
    return tflops


# ---------------------------------------------------------------------------------------------------------


def _line(r: dict) -> str:
    mask = ("causal" if r.get("causal") else "full") + (" varlen" if r.get("varlen") else "")
    what = r["name"] if r["kind"] == "feature" else f"hd{r['head_dim']} {r['name']} {mask}"
    return f"{r['kind']:8} {what:40} {'PASS' if r['ok'] else 'FAIL'}  {r['msg']}  [{r['seconds']} s]"


class Tee:
    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("hopper_probe.log"), help="log file (and <out>.json)")
    p.add_argument("--budget-s", type=float, default=220.0, help="stop timing after this many seconds")
    p.add_argument("--compile-budget-s", type=float, default=150.0,
                   help="kill feature / correctness jobs still running after this many seconds")
    p.add_argument("--compile-only", action="store_true",
                   help="only compile the head_dim 128 variants for sm_90 and report registers, spills, "
                        "shared memory, warps, warp specialisation (needs no GPU)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    t0 = time.perf_counter()
    compile_jobs = [{"kind": "compile", "name": n, "head_dim": 128, "causal": c, "varlen": False,
                     "cfg": dataclasses.asdict(cfg)}
                    for n, cfg in VARIANTS_128.items() for c in (True, False)]
    if args.compile_only:  # no GPU needed: what Triton on this machine compiles for sm_90
        log = Tee(args.out)
        log(f"# compile for sm_90 only, torch {torch.__version__}, triton {triton.__version__}")
        for r in run_jobs(compile_jobs, deadline=t0 + args.compile_budget_s):
            log(_line(r))
        return {}
    if not torch.cuda.is_available():
        p.error("the probe needs a CUDA GPU (sm_90 for the Hopper features); --compile-only needs none")
    log = Tee(args.out)
    props = torch.cuda.get_device_properties(0)
    log(f"# {props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, "
        f"triton {triton.__version__}")

    jobs = []  # the variants first: the timing needs them; the compile reports last
    for head_dim, variants in ((128, VARIANTS_128), (64, VARIANTS_64)):
        for name, cfg in variants.items():
            for causal in (True, False):
                jobs.append({"kind": "variant", "name": name, "head_dim": head_dim, "causal": causal,
                             "varlen": False, "cfg": dataclasses.asdict(cfg)})
    jobs.append({"kind": "variant", "name": "default", "head_dim": 128, "causal": True, "varlen": True,
                 "cfg": dataclasses.asdict(VARIANTS_128["default"])})
    jobs += [{"kind": "feature", "name": f} for f in FEATURES] + compile_jobs
    results = run_jobs(jobs, deadline=t0 + args.compile_budget_s)
    log(f"\n## features and correctness ({time.perf_counter() - t0:.0f} s, {len(jobs)} jobs in processes)")
    failed: set[tuple[int, str]] = set()
    for r in results:
        log(_line(r))
        if r["kind"] == "variant" and not r["ok"]:
            failed.add((r["head_dim"], r["name"]))

    log("\n## timing (TFLOP/s; bf16, 32 heads)")
    deadline = t0 + args.budget_s
    timing = {}
    for head_dim, seqlen, batch, causal in SHAPES:
        variants = {n: c for n, c in (VARIANTS_128 if head_dim == 128 else VARIANTS_64).items()
                    if (head_dim, n) not in failed}
        key = f"hd{head_dim} s{seqlen // 1024}k b{batch} {'causal' if causal else 'full'}"
        timing[key] = time_shape(head_dim, seqlen, batch, causal, variants, deadline)
        log(key, json.dumps(timing[key]))

    names = list(dict.fromkeys(n for t in timing.values() for n in t))
    log("\n## TFLOP/s (ratio to SDPA cuDNN)\n")
    log("| variant | " + " | ".join(timing) + " |")
    log("|---" * (len(timing) + 1) + "|")
    for n in names:
        cells = []
        for t in timing.values():
            x, ref = t.get(n), t.get("sdpa-cudnn")
            if isinstance(x, float) and isinstance(ref, float):
                cells.append(f"{x:.0f} ({x / ref:.2f})")
            else:
                cells.append("-" if x is None else str(x)[:24])
        log(f"| {n} | " + " | ".join(cells) + " |")
    log(f"\ntotal {time.perf_counter() - t0:.0f} s")
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "checks": results, "tflops": timing}
    Path(str(args.out) + ".json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
