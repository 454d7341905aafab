"""Quantized checkpoints made in tests, in each publisher's real layout and config, from a
tiny random checkpoint written by transformers (tests/support/tiny_models.py, tiny_moe.py).

`make_quantized(src, out, fmt)` writes two directories:
    out/quant  the quantized checkpoint (safetensors + config.json's quantization_config)
    out/ref    the same model with every quantized weight replaced by its dequantized value
               (float32, no quantization_config): transformers' reference runs on this one
The packing here is written from the formats' specifications, independently of kvserve's
dequantizers (worker/model/quant/), so a layout mistake on either side shows as a mismatch.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

FP8_MAX = 448.0
GROUP = 32
DENSE_FORMATS = ("fp8_block", "ct_fp8_tensor", "ct_fp8_channel", "ct_w4a16", "awq", "gptq", "gptq_desc_act")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
Quantized = tuple[dict[str, torch.Tensor], torch.Tensor]  # (tensors under the base, dequantized)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[1] // group, group)


def fp8_block(w: torch.Tensor, block: tuple[int, int] = (16, 32)) -> Quantized:
    bo, bi = block
    tiles = w.reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def ct_fp8(w: torch.Tensor, per_channel: bool) -> Quantized:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    q = (w / (scale if per_channel else scale.reshape(1, 1))).to(torch.float8_e4m3fn)
    # A static input scale, as W8A8 files carry it (kvserve's CPU path computes in the model dtype).
    return {"weight": q, "weight_scale": scale, "input_scale": torch.ones(1)}, q.float() * scale


def _pack_along_last(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 word: nibble k holds column 8 w + order[k]."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for k, col in enumerate(order):
        word |= v[..., col] << (4 * k)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def ct_w4a16(w: torch.Tensor) -> Quantized:
    scale = _groups(w, GROUP).abs().amax(-1) / 7.0
    q = torch.clamp(torch.round(_groups(w, GROUP) / scale.unsqueeze(-1)), -8, 7).reshape(w.shape)
    deq = q * scale.repeat_interleave(GROUP, 1)
    shape = torch.tensor(list(w.shape), dtype=torch.int64)
    return {"weight_packed": _pack_along_last(q + 8), "weight_scale": scale, "weight_shape": shape}, deq


def awq(w: torch.Tensor) -> Quantized:
    wt = w.t()  # (in, out): AWQ quantizes groups of input rows
    g = wt.reshape(wt.shape[0] // GROUP, GROUP, wt.shape[1])
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo) / 15.0).to(torch.float16)
    s = scale.float()
    zero = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(g / s.unsqueeze(1)) + zero.unsqueeze(1), 0, 15).reshape(wt.shape)
    deq_t = (q - zero.repeat_interleave(GROUP, 0)) * s.repeat_interleave(GROUP, 0)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    tensors = {"qweight": _pack_along_last(q, order), "qzeros": _pack_along_last(zero, order), "scales": scale}
    return tensors, deq_t.t().contiguous()


def gptq(w: torch.Tensor, desc_act: bool, seed: int = 0) -> Quantized:
    cols_in = w.shape[1]
    wt = w.t()  # (in, out)
    if desc_act:  # groups follow a permuted (activation) order of the input rows
        perm = torch.randperm(cols_in, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(cols_in, dtype=torch.int32)
        g_idx[perm] = (torch.arange(cols_in) // GROUP).to(torch.int32)
    else:
        g_idx = (torch.arange(cols_in) // GROUP).to(torch.int32)
    groups = cols_in // GROUP
    amax = torch.stack([wt[g_idx == g].abs().amax(0) for g in range(groups)])  # (groups, out)
    scale = (2 * amax / 15.0).to(torch.float16)
    s = scale.float()[g_idx.long()]
    q = torch.clamp(torch.round(wt / s) + 8, 0, 15)
    deq_t = (q - 8) * s
    qweight = _pack_along_last(q.t().contiguous()).t().contiguous()  # packed along input rows
    qzeros = _pack_along_last(torch.full((groups, w.shape[0]), 7))  # stored as zero - 1
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scale, "g_idx": g_idx}
    return tensors, deq_t.t().contiguous()


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4(param: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An HF gpt-oss expert tensor (E, cols, rows) -> (_blocks, _scales) of its (E, rows, cols) transpose."""
    w = param.transpose(1, 2)
    g = w.reshape(*w.shape[:2], w.shape[2] // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    idx = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1)  # nearest e2m1 value
    deq = (FP4[idx] * torch.exp2(exp).unsqueeze(-1)).reshape(w.shape)
    nibbles = idx.to(torch.uint8).reshape(*g.shape[:3], 16, 2)
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = (exp + 127).to(torch.uint8)
    return {"_blocks": blocks, "_scales": scales}, deq.transpose(1, 2).contiguous()


def quantization_config(fmt: str) -> dict:
    ignore = ["lm_head"]
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
    if fmt.startswith("ct_"):
        if fmt == "ct_w4a16":
            weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
            group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
            return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"group_0": group}, "ignore": ignore}
        strategy = "channel" if fmt == "ct_fp8_channel" else "tensor"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": fmt == "gptq_desc_act",
                "sym": True, "checkpoint_format": "gptq"}
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    raise ValueError(fmt)


def _quantizer(fmt: str) -> Callable[[torch.Tensor], Quantized]:
    return {
        "fp8_block": fp8_block, "ct_fp8_tensor": lambda w: ct_fp8(w, False),
        "ct_fp8_channel": lambda w: ct_fp8(w, True), "ct_w4a16": ct_w4a16, "awq": awq,
        "gptq": lambda w: gptq(w, False), "gptq_desc_act": lambda w: gptq(w, True), "mxfp4": mxfp4,
    }[fmt]


def make_quantized(src: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """(quantized dir, dequantized reference dir) of the checkpoint in `src`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    quant, ref = dict(tensors), dict(tensors)
    pattern, quantize = (_EXPERTS if fmt == "mxfp4" else _LINEAR), _quantizer(fmt)
    for name, w in tensors.items():
        if not pattern.match(name):
            continue
        base = name if fmt == "mxfp4" else name.removesuffix(".weight")
        parts, deq = quantize(w.float())
        del quant[name]
        sep = "" if fmt == "mxfp4" else "."  # mxfp4's parts are suffixes: <base>_blocks
        quant.update({f"{base}{sep}{k}": v.contiguous() for k, v in parts.items()})
        ref[name] = deq.to(w.dtype)
    qdir, rdir = out / "quant", out / "ref"
    for d, content in ((qdir, quant), (rdir, ref)):
        shutil.copytree(src, d)
        save_file(content, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, rdir
