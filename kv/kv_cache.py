"""The KV tensors: allocated once at start-up from a memory budget.

Layout (the flash-attention paged layout, which the torch backend uses too):

    kv_cache[layer] : (2, num_blocks, block_size, num_kv_heads, head_dim)
                       ^ 0 = keys, 1 = values

so the K/V of token slot s = block_id * block_size + offset is
kv_cache[layer][:, block_id, offset]. One tensor for all layers: one allocation, no
fragmentation, and the block count follows from the bytes, never from a guess.

The latent kind (MLA, `latent=True`): one row per token per layer and no value plane,

    kv_cache[layer] : (1, num_blocks, block_size, 1, head_dim)   head_dim = kv_lora_rank + qk_rope_head_dim

the same six-axis layout with one plane and one "head", so block gathers, exports and
the host/disk tiers move latent blocks as they move K/V blocks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # heads held on this device (a TP rank holds its own share)
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # MLA's latent rows instead of per-head K and V (num_kv_heads 1, no value plane).
    latent: bool = False

    @property
    def num_planes(self) -> int:
        """Planes per layer: K and V, or the one latent row."""
        return 1 if self.latent else 2

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_planes * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The pool tensor's shape: (layers, planes, num_blocks, block_size, heads, head_dim)."""
        return (self.num_layers, self.num_planes, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a 1-byte float pool (an FP8 KV cache) its bytes as uint8:
    block copies move bytes, and torch has no index_copy_ for float8 on every device."""
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes} bytes holds no block "
            f"({spec.bytes_per_block} bytes each); raise it"
        )
    return int(num_blocks)


def gpu_kv_budget(device: torch.device, utilization: float, activation_peak_bytes: int = 0) -> int:
    """Bytes for the KV cache on a GPU (see kv_budget_from_memory): call it after loading
    the weights and after a profile forward whose memory has been returned (empty_cache)."""
    free, total = torch.cuda.mem_get_info(device)
    return kv_budget_from_memory(total, free, utilization, activation_peak_bytes)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape = spec.shape(num_blocks)
    logger.info(
        "KV cache: %d blocks x %d tokens, %.1f MiB on %s",
        num_blocks, spec.block_size, num_blocks * spec.bytes_per_block / 2**20, device,
    )
    # zeros, not empty: padded decode slots read block 0, and garbage there could be NaN
    # (masked, but NaN * 0 is still NaN in a matmul).
    return torch.zeros(shape, dtype=spec.dtype, device=device)


def kv_budget_from_memory(
    total_bytes: int, free_bytes: int, utilization: float, activation_peak_bytes: int = 0
) -> int:
    """The KV budget on a GPU, from its memory figures (pure arithmetic, unit-tested):

        budget = total * utilization - (total - free) - activation_peak

    measured AFTER the weights are loaded and a profile forward of the largest batch ran
    and its memory was released: `total - free` then counts the weights, the CUDA context
    and anything else on the device (other processes too), and `activation_peak` is the
    most the forward held on top of that, which it will need again at every big step."""
    used = total_bytes - free_bytes
    budget = int(total_bytes * utilization) - used - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache "
            f"({used / 2**30:.1f} GiB in use + {activation_peak_bytes / 2**30:.1f} GiB activation peak "
            f"of {total_bytes / 2**30:.1f} GiB)"
        )
    return budget
