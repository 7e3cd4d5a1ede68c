"""Every performance layer of nano_flashattn can be deleted: in a copy of nano_flashattn and shared with
layers/pdl.py, hopper.py, hopper_ws.py or split_head.py deleted (one at a time, and all at once), both
packages import, the registry names what is missing (an explicit request for it is a ValueError naming
it), and the entry points under TRITON_INTERPRET=1 give the paper path's outputs of the full repository
(computed here under `performance_layers(False)`), bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import nano_flashattn as fa

# A deletion test: run from the repository, left out of a fork of the package.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels on CPU tensors (the interpreter)")]

LAYERS = ("pdl", "hopper", "hopper_ws", "split_head")

# The calls compared, in this process and in each copy: dense with autograd, varlen, decode over a paged
# cache, and shared's RMSNorm (a kernel that asks for PDL); tiny shapes, fp32 and fp16. Head_dim 80 is one
# the split_head layer takes, so where that layer is present it runs instead (compared loosely).
OUTPUTS = '''
import torch

import nano_flashattn as fa
from shared import kernels


def outputs() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype, d in ((torch.float32, 32), (torch.float16, 32), (torch.float16, 80)):
        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        q, k, v = rand(1, 19, 4, d).requires_grad_(), rand(1, 23, 2, d), rand(1, 23, 2, d)
        o = fa.flash_attn_func_triton(q, k, v, causal=True)
        out[f"func {dtype} {d}"] = o
        out[f"func dq {dtype} {d}"] = torch.autograd.grad(o.float().square().sum(), q)[0]
        cu = torch.tensor([0, 5, 19], dtype=torch.int32)
        out[f"varlen {dtype} {d}"] = fa.flash_attn_varlen_func_triton(q[0].detach(), k[0, :19], v[0, :19],
                                                                     cu, cu, 14, 14)
        cache_k, cache_v = rand(6, 16, 2, d), rand(6, 16, 2, d)
        table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
        seqlens = torch.tensor([40, 17], dtype=torch.int32)
        out[f"kvcache {dtype} {d}"] = fa.flash_attn_with_kvcache_triton(
            rand(2, 1, 4, d), cache_k, cache_v, seqlens, block_table=table)
    x = torch.randn(5, 64, generator=g)
    out["rms_norm"] = kernels.rms_norm_triton(x, torch.rand(64, generator=g) + 0.5, 1e-6)
    return {name: t.detach() for name, t in out.items()}
'''

SCRIPT = OUTPUTS + '''
import sys

import shared.model  # noqa: F401

deleted, expected_path = sys.argv[1].split(","), sys.argv[2]
assert sorted(fa.load_layers()) == sorted(deleted), fa.REGISTRY.missing
for name in deleted:
    try:
        fa.REGISTRY.require(name, "the test")
    except ValueError as e:
        assert f"nano_flashattn.layers.{name}, which is not present" in str(e), e
    else:
        raise AssertionError(f"require({name!r}) passed")
assert kernels.pdl_args(torch.device("cpu")) == {"PDL": False}
expected, got = torch.load(expected_path), outputs()
assert got.keys() == expected.keys()
for name, want in expected.items():
    if "80" in name and "split_head" not in deleted:  # the split kernels: other sums, same values
        torch.testing.assert_close(got[name], want, atol=2e-2, rtol=2e-2, msg=name)
    else:
        assert torch.equal(got[name], want), name
print("same outputs as the paper path")
'''


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> str:
    """The paper path's outputs in the full repository (no layer runs)."""
    namespace: dict = {}
    exec(OUTPUTS, namespace)
    with fa.performance_layers(False):
        outputs = namespace["outputs"]()
    path = tmp_path_factory.mktemp("paper_path") / "expected.pt"
    torch.save(outputs, path)
    return str(path)


@pytest.mark.parametrize("deleted", [(name,) for name in LAYERS] + [LAYERS],
                         ids=[*LAYERS, "all"])
def test_the_packages_run_with_layer_files_deleted(run_in_copy, expected, deleted):
    done = run_in_copy(["nano_flashattn", "shared"], [f"nano_flashattn/layers/{name}.py" for name in deleted],
                       f"import sys; sys.argv[1:] = [{','.join(deleted)!r}, {expected!r}]\n" + SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same outputs as the paper path" in done.stdout
