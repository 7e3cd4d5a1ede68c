"""nano_quant's performance layers and the one mechanism they plug in by (`linear.REGISTRY`): what each layer
registers and when it applies, the paper path calling them (a CUDA tensor simulated by forcing the predicates;
the kernels run under the Triton interpreter), `performance_layers(False)` turning them all off, the
module-swap point, and (slow) the package running with any layer file deleted, with the same outputs as the
full tree's paper path."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from nano_flashattn.registry import performance_layers
from nano_quant import quantize_model, swap_modules
from nano_quant.layers import gemv, kernels, repacked
from nano_quant.linear import REGISTRY, W8A8Linear, WQLinear_GEMM
from nano_quant.quant import quantize_rowwise
from shared.config import ModelConfig
from shared.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER_FILES = ("kernels", "gemv", "repacked")


@pytest.fixture
def on_cuda(monkeypatch):
    """Every layer's predicate sees a CUDA tensor (the kernels run on CPU tensors under the interpreter)."""
    for module in (gemv, kernels, repacked):
        monkeypatch.setattr(module, "use_triton", lambda t: True)


def test_every_layer_loads_and_registers_in_the_registry_order():
    assert REGISTRY.modules == ("gemv", "kernels", "repacked") and not REGISTRY.missing
    assert [layer.impl for layer in REGISTRY.layers("awq_gemm")] == [gemv.awq_gemv_triton, kernels.awq_gemm]
    assert [layer.impl for layer in REGISTRY.layers("scaled_mm")] == [kernels.scaled_mm_triton]
    assert [layer.impl for layer in REGISTRY.layers("quantize_per_token")] == [kernels.quantize_per_token_triton]
    assert [layer.module for layer in REGISTRY.layers("module_swap")] == ["nano_quant.layers.repacked"]
    assert 1 <= gemv.AWQ_GEMV_MAX_M <= kernels.AWQ_LARGE_M


def test_cpu_tensors_take_the_references():
    qa, sa = quantize_rowwise(torch.randn(4, 32))
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16), 32)
    assert REGISTRY.select("scaled_mm", qa, qa, sa, sa, None, torch.float32) is None
    assert REGISTRY.select("awq_gemm", torch.randn(1, 64), layer.qweight, layer.qzeros, layer.scales, 32,
                           None) is None
    assert REGISTRY.active("module_swap", torch.nn.Sequential(layer)) == []


def test_dispatch_by_rows_and_the_switch(on_cuda):
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16), 32)
    w = (layer.qweight, layer.qzeros, layer.scales, 32, None)
    assert REGISTRY.select("awq_gemm", torch.randn(1, 64), *w) is gemv.awq_gemv_triton
    assert REGISTRY.select("awq_gemm", torch.randn(3, 64), *w) is kernels.awq_gemm
    with performance_layers(False):
        assert REGISTRY.select("awq_gemm", torch.randn(1, 64), *w) is None
        assert REGISTRY.select("quantize_per_token", torch.randn(1, 64), "int8") is None


@pytest.mark.parametrize("rows", [1, 3])
def test_the_paper_path_runs_the_layers(on_cuda, monkeypatch, rows):
    """W8A8Linear and WQLinear_GEMM run the kernels the registry selects (one row: the GEMV) and give the
    references' values to fp32 rounding; the INT8 quantization kernel is exact."""
    torch.manual_seed(rows)
    fc = torch.nn.Linear(128, 40)
    w8, w4 = W8A8Linear.from_linear(fc), WQLinear_GEMM.from_linear(fc, 64)
    x = torch.randn(rows, 128)
    with performance_layers(False):
        want8, want4 = w8(x), w4(x)
    selected = []
    select = REGISTRY.select
    monkeypatch.setattr(REGISTRY, "select", lambda *a, **k: selected.append(select(*a, **k)) or selected[-1])
    assert torch.allclose(w8(x), want8, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w4(x), want4, rtol=1e-5, atol=1e-5)
    assert selected == [kernels.quantize_per_token_triton, kernels.scaled_mm_triton,
                        gemv.awq_gemv_triton if rows == 1 else kernels.awq_gemm]
    q, scale = kernels.quantize_per_token_triton(x, "int8")
    assert torch.equal(q, quantize_rowwise(x)[0]) and torch.equal(scale, quantize_rowwise(x)[1])


def test_swap_modules(on_cuda):
    """The module-swap point: AWQ layers whose groups hold whole 32-value chunks become the repacked layer
    (serving_only frees AutoAWQ's tensors), nothing else changes, and nothing at all with the layers off."""
    model = torch.nn.Sequential(WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16), 32),
                                WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16), 16), torch.nn.Linear(4, 4))
    with performance_layers(False):
        swap_modules(model)
    assert type(model[0]) is WQLinear_GEMM
    assert swap_modules(model, serving_only=True) is model
    assert type(model[0]) is repacked.RepackedGemvWQLinear and not hasattr(model[0], "qweight")
    assert type(model[1]) is WQLinear_GEMM and type(model[2]) is torch.nn.Linear


def test_an_explicit_request_names_the_layer():
    REGISTRY.require("kernels", "kernels=true")  # present: no error
    with pytest.raises(ValueError, match="nano_quant has no performance layer 'marlin'"):
        REGISTRY.require("marlin", "marlin=true")


@pytest.mark.gpu
def test_fast_by_default_on_cuda():
    """On CUDA a plain quantized linear runs the kernels without any import or switch (one row: the GEMV,
    more: the tensor-core GEMM), performance_layers(False) runs the torch references, and the two agree;
    swap_modules gives the AWQ layer the repacked kernels, which agree too."""
    fc = torch.nn.Linear(4096, 1024, bias=True, device="cuda")
    w8, w4 = W8A8Linear.from_linear(fc), WQLinear_GEMM.from_linear(fc, 128)
    for rows in (1, 16):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w = (w4.qweight, w4.qzeros, w4.scales, 128, None)
        assert REGISTRY.select("awq_gemm", x, *w) is (gemv.awq_gemv_triton if rows == 1 else kernels.awq_gemm)
        fast8, fast4 = w8(x), w4(x)
        with performance_layers(False):
            assert REGISTRY.select("awq_gemm", x, *w) is None
            ref8, ref4 = w8(x), w4(x)
        torch.testing.assert_close(fast8, ref8, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fast4, ref4, rtol=2e-2, atol=2e-2)
        model = swap_modules(torch.nn.Sequential(WQLinear_GEMM.from_linear(fc, 128)))
        assert type(model[0]) is repacked.RepackedGemvWQLinear
        torch.testing.assert_close(model(x), ref4, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- deleting a layer file
def outputs() -> dict[str, torch.Tensor]:
    """A W8A8 and an AWQ W4A16 linear (several rows and one) and a tiny model quantized both ways (its
    modules swapped by whatever layer applies), on CPU tensors: no kernel's predicate takes them."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(128, 48)
    w8, w4 = W8A8Linear.from_linear(fc), WQLinear_GEMM.from_linear(fc, 64)
    x = torch.randn(5, 128)
    out = {"w8a8": w8(x), "w8a8 one row": w8(x[:1]), "w4a16": w4(x), "w4a16 one row": w4(x[:1])}
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    for method in ("rtn-w4", "naive-w8a8"):
        model = build_model(cfg, seed=0)
        quantize_model(model, method, progress=False)
        with torch.no_grad():
            out[method] = swap_modules(model, serving_only=True)(ids)
    return out


# Runs in a copy of nano_quant, shared and nano_flashattn with the named layer files deleted.
SCRIPT = """
import sys
import torch
from nano_quant import quantize_model, swap_modules
from nano_quant.linear import REGISTRY, W8A8Linear, WQLinear_GEMM
from shared.config import ModelConfig
from shared.model import build_model

torch.set_num_threads(1)
deleted = {DELETED}
REGISTRY.load()  # what the first lookup does
assert set(REGISTRY.missing) == deleted, (REGISTRY.missing, deleted)
for name in deleted:
    try:
        REGISTRY.require(name, name + "=true")
    except ValueError as e:
        assert "nano_quant.layers." + name in str(e), e
    else:
        raise AssertionError(name)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delete", [[name] for name in LAYER_FILES] + [list(LAYER_FILES)],
                         ids=[*LAYER_FILES, "all"])
def test_the_package_runs_with_layer_files_deleted(run_in_copy, tmp_path, delete):
    """With kernels.py, gemv.py or repacked.py deleted (and all three), `import nano_quant` works, the
    registry names what is missing (an explicit request is a ValueError naming the module), and the
    quantized linears and a tiny quantized model give exactly the full tree's paper-path outputs."""
    script = (SCRIPT.replace("{DELETED}", repr(set(delete))) + textwrap.dedent(inspect.getsource(outputs))
              + "\ntorch.save(outputs(), 'outputs.pt')\n")
    proc = run_in_copy(["nano_quant", "shared", "nano_flashattn"],
                       [f"nano_quant/layers/{name}.py" for name in delete], script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "outputs.pt")
    with performance_layers(False):
        want = outputs()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
