"""The KV a long request holds on a model with sliding-window layers, against the same model
with every layer full attention: `sliding_kv_blocks_vs_full()` (benchmarks/models.py's
`sliding_kv_blocks_vs_full=` figure).

Method: the real scheduler and KV manager (kv/cache_manager.py) on a simulated device
(worker/sim/), the gpt-oss-class shape (worker/costs/shapes/gpt-oss-20b.json: 24 layers,
sliding window 128 on every other layer), one request of PROMPT_TOKENS + OUTPUT_TOKENS
tokens; at every step the pool blocks it holds, over all its KV groups, are read from the
manager. The same run on the shape with every layer global is the reference. Blocks of the
two layouts differ in bytes (a group covers 12 layers, the full layout 24), so both are
counted in full-layout blocks (bytes / the full layout's block bytes):

    measured = max over steps of held_blocks(sliding) * block_bytes(sliding)
               / (max over steps of held_blocks(full) * block_bytes(full))
    expected = (ceil(n / bs) + ceil((w - 1) / bs) + 1) * 12 / (ceil(n / bs) * 24)   (n = all tokens)

(the sliding group at most holds the window's blocks behind the decode and the block it
grows into: kv/kv_groups.py). `python -m benchmarks.models_kv` prints the figures.
"""
from __future__ import annotations

import json
from dataclasses import replace

from kv.cache_manager import cdiv
from worker.config import CacheConfig, SchedulerConfig
from worker.sim.build import build_sim_engine
from worker.costs.shapes import ModelShape, load_shape
from worker.api import SamplingParams

SHAPE = "gpt-oss-20b"
PROFILE = "h200"
BLOCK_SIZE = 16
PROMPT_TOKENS = 8192
OUTPUT_TOKENS = 256


def held_blocks(shape: ModelShape, prompt_tokens: int = PROMPT_TOKENS, output_tokens: int = OUTPUT_TOKENS,
                block_size: int = BLOCK_SIZE) -> tuple[int, list[int]]:
    """Most pool blocks one long request held at any step, and its per-group blocks then."""
    engine = build_sim_engine(
        shape, PROFILE, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=4),
        CacheConfig(block_size=block_size), sleep=False,
    )
    engine.add_request("long", [7] * prompt_tokens, SamplingParams(max_tokens=output_tokens, temperature=0.0,
                                                                   ignore_eos=True))
    most, at = 0, []
    while engine.has_unfinished():
        engine.step()
        held = engine.kv.num_held_blocks("long")
        if sum(held) > most:
            most, at = sum(held), held
    return most, at


def sliding_kv_blocks_vs_full(prompt_tokens: int = PROMPT_TOKENS, output_tokens: int = OUTPUT_TOKENS) -> dict[str, object]:
    """Measured and expected KV a long gpt-oss-class request holds against full attention,
    in full-layout blocks (see the module docstring)."""
    sliding = load_shape(SHAPE)
    full = replace(sliding, name=f"{SHAPE}-all-full", layer_windows=())
    bs = BLOCK_SIZE
    held_s, groups_s = held_blocks(sliding, prompt_tokens, output_tokens)
    held_f, _ = held_blocks(full, prompt_tokens, output_tokens)
    bytes_s, bytes_f = sliding.kv_block_bytes(bs), full.kv_block_bytes(bs)
    n = cdiv(prompt_tokens + output_tokens, bs)
    window = max(w for w in sliding.layer_windows if w is not None)
    layout = sliding.kv_layout()
    num_full = sum(1 for g in layout.groups if g.sliding_window is None)
    num_sliding = layout.num_groups - num_full
    expected_blocks = num_full * n + num_sliding * (cdiv(window - 1, bs) + 1)
    return {
        "shape": SHAPE,
        "tokens": prompt_tokens + output_tokens,
        "block_size": bs,
        "window": window,
        "held_blocks_sliding": held_s,
        "held_blocks_per_group": groups_s,
        "held_blocks_full": held_f,
        "measured": held_s * bytes_s / (held_f * bytes_f),
        "expected": expected_blocks * bytes_s / (n * bytes_f),
    }


if __name__ == "__main__":
    print(json.dumps(sliding_kv_blocks_vs_full(), indent=2))
