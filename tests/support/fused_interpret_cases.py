"""Runs the fused Triton kernels (worker/model/fused_kernels.py) under Triton's interpreter
on CPU next to the torch path, and the engine's greedy decoding with them on against
transformers', saving everything for tests/unit/worker/models/test_fused_kernels.py.

    TRITON_INTERPRET=1 python -m tests.support.fused_interpret_cases OUT.pt

A separate process: Triton decides interpret-or-compile when triton.language is first
imported (tests/support/triton_interpret_cases.py says more).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A few prompts around block boundaries, decoded long enough to cross more blocks.
PROMPTS = [[5, 9, 33, 7] * 4, list(range(3, 40)), [11] * 17, [400, 3, 77]]
MAX_TOKENS = [12, 8, 10, 6]


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def kernel_cases(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    from worker.model import fused_kernels as fk

    g = torch.Generator().manual_seed(seed)
    rows, hidden, inter, hq, hkv, d = 7, 96, 80, 4, 2, 32  # widths not powers of two: masks
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    res = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    out: dict[str, torch.Tensor] = {}
    out["norm"], out["norm_res_passthrough"] = fk.add_rms_norm(x, w, 1e-5)
    out["norm_torch"] = torch_rms_norm(x, w, 1e-5)
    out["addnorm"], out["addnorm_sum"] = fk.add_rms_norm(x, w, 1e-5, res)
    total = res + x
    out["addnorm_torch"], out["addnorm_sum_torch"] = torch_rms_norm(total, w, 1e-5), total
    out["x"] = x
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(device, dtype)
    out["silu"] = fk.silu_mul(gate_up)
    out["silu_torch"] = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    # q and k as the qkv projection's strided views; cos / sin rows of mixed positions.
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(rows, hq, d), k.view(rows, hkv, d)
    angles = torch.tensor([0, 1, 5, 17, 300, 901, 2047], dtype=torch.float)[:, None] * torch.linspace(1, 1e-3, d // 2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    out["rope_q_torch"], out["rope_k_torch"] = torch_rope(q, cos, sin), torch_rope(k, cos, sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    qkv_again = qkv.clone()
    fk.rope_qk_(q, k, cos, sin)
    out["rope_q"], out["rope_k"] = q.clone(), k.clone()
    out["v_untouched"] = torch.tensor([float(torch.equal(qkv[:, (hq + hkv) * d:], v_before))])
    # The same rotation writing the rotated key and the value into scattered cache slots.
    q2, k2, v2 = qkv_again.split([hq * d, hkv * d, hkv * d], dim=-1)
    q2, k2, v2 = q2.view(rows, hq, d), k2.view(rows, hkv, d), v2.view(rows, hkv, d)
    cache = torch.zeros(2, 6, 4, hkv, d, dtype=dtype, device=device)
    slots = torch.tensor([5, 0, 23, 9, 14, 2, 17], device=device)
    fk.rope_qk_(q2, k2, cos, sin, v2, cache, slots)
    out["write_q"], out["write_cache_k"] = q2.clone(), cache[0].view(-1, hkv, d)[slots]
    out["write_cache_v"], out["write_v"] = cache[1].view(-1, hkv, d)[slots], v_before.view(rows, hkv, d)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots.cpu()] = False
    out["write_elsewhere_zero"] = torch.tensor([float(cache.view(2, 24, -1)[:, untouched.to(device)].eq(0).all())])
    return out


def greedy_cases(root: Path) -> dict[str, torch.Tensor]:
    from tests.support.tiny_models import hf_greedy, make_tiny_model
    from worker.api import SamplingParams
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.build import build_engine
    from worker.model.fused import set_fused_kernels

    from worker.attention import triton_paged

    # The Triton attention backend on CPU too (the interpreter runs it): the path on which
    # RoPE writes the KV cache itself and the backend only attends.
    triton_paged.load_triton_backend = lambda device: (triton_paged.TritonPagedAttention(), "interpreter")
    from worker.model import fused_kernels

    writes = [0]
    rope = fused_kernels.rope_qk_

    def counted(*args: object, **kwargs: object) -> None:  # how many launches wrote the KV cache
        writes[0] += len(args) > 4 and args[5] is not None
        rope(*args, **kwargs)  # type: ignore[arg-type]

    fused_kernels.rope_qk_ = counted
    out: dict[str, torch.Tensor] = {}
    for family, backend in (("llama", "torch"), ("qwen3", "torch"), ("llama", "triton"), ("mistral_swa", "triton")):
        # qwen3: per-head q/k norms through the fused RMSNorm; mistral_swa: a sliding window.
        model_dir = make_tiny_model(family, root / f"{family}-{backend}")
        set_fused_kernels(True)
        writes[0] = 0
        engine = build_engine(EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
            CacheConfig(block_size=16, num_blocks_override=64),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        ))
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
        set_fused_kernels(None)
        hf = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
        out[f"{family}_{backend}_engine"] = torch.tensor([t for i in range(len(PROMPTS)) for t in tokens[str(i)]])
        out[f"{family}_{backend}_hf"] = torch.tensor([t for row in hf for t in row])
        out[f"{family}_{backend}_kv_writes"] = torch.tensor([writes[0]])
    return out


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    result: dict[str, dict[str, torch.Tensor]] = {name: kernel_cases(dtype) for name, dtype in DTYPES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        result["greedy"] = greedy_cases(Path(tmp))
    torch.save(result, sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
