"""A checkpoint's `quantization_config` -> the one format kvserve loads it as, or a refusal.

Torch-free: `kvserve serve` checks the config before Ray starts (worker/model_config.py).
Formats (the publishers' own layouts; each has a module of its own in this package):

    fp8                 quant_method fp8, weight_block_size [bo, bi], weight_scale_inv
    ct_fp8              compressed-tensors float-quantized, 8-bit float weights, strategy
                        tensor or channel (weight_scale)
    ct_w4a16            compressed-tensors pack-quantized, 4-bit int symmetric weights,
                        strategy group (group_size) or channel
    awq                 quant_method awq, version gemm, 4 bits, zero_point true
    gptq                quant_method gptq, 4 or 8 bits, desc_act false or true (g_idx)
    mxfp4               quant_method mxfp4 (gpt-oss experts: *_blocks, *_scales)

Anything else, and any switch of these formats the dequantizer would not honour, raises
UnsupportedModelError naming what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.api import UnsupportedModelError

SUPPORTED_FORMATS = (
    "fp8 (block-scaled, weight_scale_inv)", "compressed-tensors float-quantized FP8 (tensor/channel)",
    "compressed-tensors pack-quantized W4A16 (group/channel, symmetric)", "awq (gemm, 4-bit)",
    "gptq (4/8-bit, desc_act off/on)", "mxfp4 (gpt-oss experts)",
)


@dataclass(frozen=True)
class QuantSpec:
    """The format and the switches its dequantizer needs."""

    method: str
    bits: int = 0
    group_size: int = 0  # int formats: input channels per scale (0: one group per row)
    block: tuple[int, int] = (0, 0)  # fp8: (rows, cols) per weight_scale_inv entry
    desc_act: bool = False
    ignore: tuple[str, ...] = ()  # module names kept unquantized (informational: checked per tensor)


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported quantized checkpoint: {what}; kvserve loads {'; '.join(SUPPORTED_FORMATS)}"
    )


def quant_spec(quant: Any) -> QuantSpec:
    """Parse `quantization_config` (a dict, or a transformers config object)."""
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    method = str(quant.get("quant_method", "?"))
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "awq":
        return _awq(quant)
    if method == "gptq":
        return _gptq(quant)
    if method == "mxfp4":
        return QuantSpec("mxfp4", bits=4, group_size=32, ignore=tuple(quant.get("modules_to_not_convert") or ()))
    raise _refuse(f"quant_method {method!r}")


def _fp8(quant: dict[str, Any]) -> QuantSpec:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt {fmt!r} (only e4m3)")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise _refuse("fp8 without weight_block_size [rows, cols] (per-tensor fp8 ships as compressed-tensors)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(f"fp8 activation_scheme {scheme!r} (only dynamic)")
    return QuantSpec("fp8", bits=8, block=(int(block[0]), int(block[1])),
                     ignore=tuple(quant.get("modules_to_not_convert") or ()))


def _compressed_tensors(quant: dict[str, Any]) -> QuantSpec:
    fmt = quant.get("format")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config_groups (exactly one)")
    (group,) = groups.values()
    w = group.get("weights") or {}
    ignore = tuple(quant.get("ignore") or ())
    strategy = w.get("strategy")
    if quant.get("kv_cache_scheme"):  # calibrated k_scale / v_scale tensors: not read
        raise _refuse("compressed-tensors kv_cache_scheme (use engine.kv_cache_dtype: fp8, per-tensor scale 1.0)")
    if not w.get("symmetric", True):
        raise _refuse("compressed-tensors asymmetric weights (weight_zero_point)")
    if w.get("actorder"):
        raise _refuse(f"compressed-tensors actorder {w.get('actorder')!r}")
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8:
        if strategy not in ("tensor", "channel"):
            raise _refuse(f"compressed-tensors FP8 strategy {strategy!r} (tensor or channel)")
        return QuantSpec("ct_fp8", bits=8, ignore=ignore)
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4:
        if strategy not in ("group", "channel"):
            raise _refuse(f"compressed-tensors W4A16 strategy {strategy!r} (group or channel)")
        if (group.get("input_activations") or None) is not None:
            raise _refuse("compressed-tensors int4 with quantized input activations (W4A16 only)")
        size = int(w.get("group_size") or 0) if strategy == "group" else 0
        return QuantSpec("ct_w4a16", bits=4, group_size=size, ignore=ignore)
    raise _refuse(
        f"compressed-tensors format {fmt!r} with {w.get('num_bits')}-bit {w.get('type')!r} weights"
    )


def _awq(quant: dict[str, Any]) -> QuantSpec:
    version = str(quant.get("version", "gemm")).lower()
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (only gemm)")
    if bits != 4 or not quant.get("zero_point", True):
        raise _refuse(f"awq with {bits} bits, zero_point={quant.get('zero_point')} (4 bits with zero points)")
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    return QuantSpec("awq", bits=4, group_size=group, ignore=tuple(quant.get("modules_to_not_convert") or ()))


def _gptq(quant: dict[str, Any]) -> QuantSpec:
    bits = int(quant.get("bits", 4))
    fmt = quant.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise _refuse(f"gptq with {bits} bits (4 or 8)")
    if fmt != "gptq":
        raise _refuse(f"gptq checkpoint_format {fmt!r} (only gptq)")
    group = int(quant.get("group_size", 128))
    return QuantSpec("gptq", bits=bits, group_size=max(group, 0), desc_act=bool(quant.get("desc_act", False)),
                     ignore=tuple(quant.get("modules_to_not_convert") or ()))


def check_quantization(family: str, quant: Any, gguf: bool = False) -> QuantSpec:
    """The config's format, refused where the family or file kind cannot carry it."""
    if gguf:
        raise _refuse("a quantization_config on a .gguf file (GGUF quantization is the file's own)")
    spec = quant_spec(quant)
    if spec.method == "mxfp4" and family != "gpt_oss":
        raise _refuse(f"mxfp4 on a {family} model (mxfp4 is gpt-oss's expert format)")
    return spec
