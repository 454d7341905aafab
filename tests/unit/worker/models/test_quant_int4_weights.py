"""int4 weights kept packed (worker/model/quant/int4_linear.py): the CUDA path of AWQ, GPTQ
(desc_act off and on) and compressed-tensors W4A16, forced on CPU (`keep_quantized=True`),
where the product is int4_gemm_torch's (the Triton kernel's reference: test_int4_gemm.py).
Every projection computes what the dequantized model's does."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.support.quant_checkpoints import make_quantized
from worker.attention.torch_paged import TorchPagedAttention
from worker.model.loader import load_model
from worker.model.parallel import ColumnParallelLinear, RowParallelLinear
from worker.model_config import load_hf_config

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def _load(qdir: Path, keep: bool) -> torch.nn.Module:
    return load_model(qdir, load_hf_config(qdir), TorchPagedAttention(), 256, torch.float32, torch.device("cpu"),
                      keep_quantized=keep)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_desc_act", "ct_w4a16"])
def test_packed_projections_compute_the_dequantized_product(fmt: str, tiny_model: TinyModels, tmp_path: Path) -> None:
    qdir, _ = make_quantized(tiny_model("llama"), tmp_path, fmt)
    kept, dequantized = _load(qdir, True), _load(qdir, False)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    checked = 0
    for (name, a), (_, b) in zip(kept.named_modules(), dequantized.named_modules()):
        if not isinstance(b, (ColumnParallelLinear, RowParallelLinear)) or not name.startswith("layers."):
            continue
        assert a.weight.dtype == torch.int32 and a.weight.shape == (b.weight.shape[1] // 8, b.weight.shape[0])
        assert (a.perm is not None) == (fmt == "gptq_desc_act")
        xs = x[:, : b.weight.shape[1]]
        torch.testing.assert_close(a(xs), b(xs), rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 2 * 4  # qkv, o, gate_up, down in each of the two layers
    assert kept.kept_quantized == fmt.removesuffix("_desc_act") and dequantized.kept_quantized is None
    # One byte holds two weights: an eighth of fp32's projection bytes (plus group scales).
    packed = sum(m.weight.numel() * 4 for m in kept.modules() if getattr(m, "weight", None) is not None
                 and m.weight.dtype == torch.int32)
    dense = sum(m.weight.numel() * 4 for n, m in dequantized.named_modules()
                if n.startswith("layers.") and isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    assert packed * 8 == dense
