"""FP8 weights kept in FP8 (worker/model/quant/fp8_linear.py): the CUDA path of a
compressed-tensors W8A8-FP8 checkpoint, forced on CPU here (`keep_quantized=True`), where
`fp8_gemm` computes the product by dequantizing; on CUDA the same product is
torch._scaled_mm's, checked against it when a GPU is present."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file

from tests.support.quant_checkpoints import make_quantized
from worker.attention.torch_paged import TorchPagedAttention
from worker.model.loader import load_model
from worker.model.quant.fp8_linear import FP8, fp8_gemm, per_token_fp8
from worker.model_config import load_hf_config

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def _load(qdir: Path, keep_quantized: bool) -> torch.nn.Module:
    config = load_hf_config(qdir)
    return load_model(qdir, config, TorchPagedAttention(), 256, torch.float32, torch.device("cpu"), keep_quantized=keep_quantized)


@pytest.mark.parametrize("fmt", ["ct_fp8_tensor", "ct_fp8_channel"])
def test_projections_hold_the_checkpoint_fp8_bytes(fmt: str, tiny_model: TinyModels, tmp_path: Path) -> None:
    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, fmt)
    model = _load(qdir, keep_quantized=True)
    tensors = load_file(qdir / "model.safetensors")
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    want = torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), want.view(torch.uint8))
    scales = torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"].reshape(-1).expand(
        tensors[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0]) for p in "qkv"])
    assert torch.equal(qkv.weight_scale, scales.float())
    down = model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8 and torch.equal(
        down.weight.view(torch.uint8), tensors["model.layers.1.mlp.down_proj.weight"].view(torch.uint8))
    # The device holds a quarter of the fp32 projection bytes (one byte per weight).
    fp8_bytes = sum(p.numel() for p in model.parameters() if p.dtype == FP8)
    assert fp8_bytes == sum(t.numel() for n, t in tensors.items() if t.dtype == FP8)


def test_fp8_gemm_is_the_per_token_scaled_product() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 3.0, 0.2])[:, None]
    w = torch.randn(48, 64, generator=gen)
    scale = w.abs().amax(1) / 448
    wq = (w / scale[:, None]).to(FP8)
    xq, xs = per_token_fp8(x)
    assert xs.shape == (5, 1) and (xq.float().abs().amax(1) == 448).all()  # each token uses the whole range
    got = fp8_gemm(x, wq, scale)
    want = (xq.float() * xs) @ (wq.float() * scale[:, None]).t()
    torch.testing.assert_close(got, want)
    exact = x @ (wq.float() * scale[:, None]).t()
    assert ((got - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.05  # e4m3 activations' error


def test_a_kept_fp8_model_predicts_what_the_dequantized_one_does(tiny_model: TinyModels, tmp_path: Path) -> None:
    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, "ct_fp8_channel")
    kept, dequantized = _load(qdir, keep_quantized=True), _load(qdir, keep_quantized=False)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    for a, b in ((kept.layers[0].mlp.gate_up_proj, dequantized.layers[0].mlp.gate_up_proj),
                 (kept.layers[1].self_attn.o_proj, dequantized.layers[1].self_attn.o_proj)):
        ya, yb = a(hidden[:, : a.weight.shape[1]]), b(hidden[:, : b.weight.shape[1]])
        assert ((ya - yb).norm() / yb.norm()) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch._scaled_mm)")
def test_scaled_mm_matches_the_dequantized_product_on_cuda() -> None:
    x = torch.randn(33, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 128, device="cuda")
    scale = w.abs().amax(1) / 448
    wq = (w / scale[:, None]).to(FP8)
    got = fp8_gemm(x, wq, scale)
    want = fp8_gemm(x.cpu(), wq.cpu(), scale.cpu())
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2e-2, atol=2e-2)
