"""The routing-stats report (worker.api.RoutingStats) built from an engine: one builder for
the worker replica (worker/serving/replica.py, under Serve) and the discrete-event simulator's
replicas (cluster/sim/replica.py), so the router reads the same figures from both.

Besides the engine's stats it forecasts the KV its requests will still grow into, so the
router counts a replica's decode work from the moment it is known, not when the blocks are
taken (router/routing/scoring.py's capacity):

    expected(r)        = r's mean observed output length (worker/engine/step_meters.py), or
                         FALLBACK_OUTPUT_TOKENS while nothing has finished
    forecast(s)        = min(max_tokens(s), max(expected(r), num_output_tokens(s) + 1))
                         (a sequence already past the mean is expected to stop soon: one
                         more token, not another mean's worth)
    growth(s)          = blocks(min(prompt(s) + forecast(s), max_model_len)) - blocks held,
                         at least 0
    decode_growth_blocks = sum of growth over running AND waiting sequences
    with speculative decoding (k drafts a row), prompt(s) + forecast(s) is raised to at
                         least num_tokens(s) + k (within prompt + max_tokens): the
                         lookahead blocks its next verify step holds

Blocks are the replica's own (kv/kv_geometry.py): blocks(n) counts every KV group, a
sliding-window group's at most its window's, so a Gemma-like replica forecasts what its
pool will really hold. With one full-attention group blocks(n) = cdiv(n, block_size).
Running ones hold blocks(num_computed_tokens) between steps (a chunked
prefill's remaining prompt blocks count as growth too: nothing else reports them). Waiting
ones count only their decode here: their prompts are reserved_blocks already. They are
counted at all because the router's own reservation for a request counts its decode blocks
only until a report reflects the request; if the report then counted only its prompt, the
replica would look emptier right after reporting its longest queue, and draw a burst.

Computed once per report (every stats period, ~1 s), never per engine step. The worker's
report runs off the engine thread: it copies the running list and queue (atomic under the
GIL) and reads plain int fields; a figure a step old is as good as the rest of the report.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from kv.cache_manager import cdiv
from kv.kv_geometry import KVGeometry
from worker.api import RoutingStats
from worker.engine.core import Engine
from worker.engine.stats import EngineStats
from worker.sequence import Sequence

# Output tokens forecast per request before any has finished (the router's default
# RoutingParams.expected_output_tokens; worker/ does not import router/).
FALLBACK_OUTPUT_TOKENS = 256


def forecast_output_tokens(seq: Sequence, expected_output_tokens: float) -> int:
    """The sequence's forecast total output length (see the module docstring)."""
    expected = round(expected_output_tokens) if expected_output_tokens > 0 else FALLBACK_OUTPUT_TOKENS
    return min(seq.params.max_tokens, max(expected, seq.num_output_tokens + 1))


def growth_blocks(seq: Sequence, held_tokens: int, expected_output_tokens: float, block_size: int,
                  max_model_len: int, geometry: KVGeometry | None = None, lookahead_tokens: int = 0) -> int:
    """Blocks `seq` will still allocate beyond those covering `held_tokens` tokens; with
    speculative decoding, at least its next verify step's lookahead (its tokens plus
    `lookahead_tokens` drafts, within max_tokens), which that step holds."""
    total = seq.num_prompt_tokens + forecast_output_tokens(seq, expected_output_tokens)
    if lookahead_tokens:
        total = max(total, min(seq.num_tokens + lookahead_tokens, seq.num_prompt_tokens + seq.params.max_tokens))
    total = min(total, max_model_len)
    if geometry is not None:
        return max(geometry.blocks_for_tokens(total) - geometry.blocks_for_tokens(held_tokens), 0)
    return max(cdiv(total, block_size) - cdiv(held_tokens, block_size), 0)


def decode_growth_blocks(running: Iterable[Sequence], waiting: Iterable[Sequence], expected_output_tokens: float,
                         block_size: int, max_model_len: int, geometry: KVGeometry | None = None,
                         lookahead_tokens: int = 0) -> int:
    """KV blocks the running sequences (prompt rest + decode, and speculative lookahead)
    and the waiting ones (decode only: their prompts are reserved_blocks) will still
    allocate before they finish."""
    growth = 0
    for seq in running:
        growth += growth_blocks(seq, seq.num_computed_tokens, expected_output_tokens, block_size, max_model_len,
                                geometry, lookahead_tokens)
    for seq in waiting:
        growth += growth_blocks(seq, seq.num_tokens, expected_output_tokens, block_size, max_model_len, geometry,
                                lookahead_tokens)
    return growth


def engine_geometry(engine: Engine) -> KVGeometry | None:
    """The engine's KV geometry when it is not one full-attention group (else None: the
    plain arithmetic, one block per block_size tokens)."""
    layout = engine.kv.layout
    if layout is None or layout.num_groups == 1 and not layout.frees_blocks:
        return None
    bytes_per_block = int(getattr(engine.runner, "kv_bytes_per_block", 0) or 0)
    return KVGeometry.from_layout(layout, engine.kv.block_size, bytes_per_block)


def running_prompt_tokens(running: Iterable[Sequence]) -> int:
    """Prompt tokens the running sequences still have to prefill. Admission takes a long
    prompt whole into the running set and chunked prefill works through it over many steps:
    a replica admitting a 100k-token prompt has nothing waiting and seconds of prefill
    ahead, which every request sent there waits behind."""
    return sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in running)


def build_routing_stats(engine: Engine, stats: EngineStats, prefix_hashes: list[int], timestamp: float,
                        healthy: bool = True, capacity_weight: float = 1.0,
                        tier_hashes: tuple[list[int], list[int]] = ([], []),
                        kv_events: Mapping[str, object] | None = None) -> RoutingStats:
    """The report of a replica running `engine`. `stats`: its latest EngineStats (the async
    engine's snapshot under Serve); `timestamp`: time.time(), or the simulator's clock.
    `kv_events`: worker/kvcache/event_stream.py's report (its snapshot replaces the hash lists)."""
    block_size = stats.kv.block_size
    mean = engine.output_lengths.mean
    scheduler = engine.scheduler
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    geometry = engine_geometry(engine)
    lookahead = engine.speculative.num_tokens if engine.speculative is not None else 0
    growth = decode_growth_blocks(running, waiting, mean, block_size, engine.max_model_len, geometry, lookahead)
    if geometry is None:
        reserved = cdiv(stats.num_waiting_prompt_tokens, block_size)
        # The block's bytes are said on every replica: an FP8 pool's are half of bf16's.
        shape: dict[str, object] = {"kv_bytes_per_block": int(getattr(engine.runner, "kv_bytes_per_block", 0) or 0)}
    else:  # each waiting prompt's uncached blocks in every group (a sliding group's: its window)
        blocks = geometry.blocks_for_tokens
        reserved = sum(blocks(seq.num_tokens) - blocks(seq.num_tokens - seq.waiting_uncached_tokens)
                       for seq in waiting)
        shape = {"kv_full_groups": geometry.num_full_groups, "kv_sliding_windows": geometry.sliding_windows,
                 "kv_bytes_per_block": geometry.bytes_per_block}
    kv = dict(kv_events) if kv_events else {
        "prefix_hashes": prefix_hashes, "host_prefix_hashes": tier_hashes[0], "disk_prefix_hashes": tier_hashes[1]}
    return RoutingStats(
        free_blocks=stats.kv.free_blocks,
        retained_blocks=stats.kv.retained_blocks,
        total_blocks=stats.kv.total_blocks,
        block_size=block_size,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
        reserved_blocks=reserved,
        timestamp=timestamp,
        healthy=healthy,
        capacity_weight=capacity_weight,
        prefill_tokens_per_s=engine.prefill_meter.tokens_per_s,
        decode_growth_blocks=growth,
        mean_output_tokens=mean,
        max_num_seqs=scheduler.config.max_num_seqs,
        **_lora_residency(engine),
        num_running_prompt_tokens=running_prompt_tokens(running),
        **kv,  # type: ignore[arg-type]
        **shape,  # type: ignore[arg-type]
    )


def _lora_residency(engine: Engine) -> dict[str, tuple[str, ...] | int]:
    """The adapters in device slots, in held slots and in host memory, and the number of
    slots (copies: the engine thread moves them)."""
    if engine.lora is None:
        return {}
    slots = engine.lora.slots
    return {"lora_resident": tuple(slots.resident), "lora_loaded": tuple(engine.lora.registry.host_resident),
            "lora_active": tuple(slots.active), "max_loras": slots.num_slots}
