"""Building an engine from its config: the model path and config resolved, the runner of
its device (one rank, tensor-parallel ranks, or a simulated device), the KV pool's cap on
the sequence length, then what the config turns on around the core (KV tiers, grammars,
LoRA adapters)."""
from __future__ import annotations

from dataclasses import replace

from kv.kv_geometry import KVGeometry
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.lora.engine_lora import EngineLoRA
from worker.scheduling.step_budget import profile_predictor
from worker.structured.compiler import GrammarCompiler
from worker.model_config import cap_to_kv_capacity, eos_token_ids_of, load_hf_config, max_model_len_for
from worker.model_path import resolve_model_path
from worker.sim.device import is_sim_device
from worker.sim.build import sim_engine_from_config


def build_engine(config: EngineConfig) -> Engine:
    check_speculative(config)
    if is_sim_device(config.model.device):  # a simulated device: no weights, no torch (worker/sim/)
        return sim_engine_from_config(config)
    from worker.runner.model_runner import ModelRunner  # torch: a simulated device builds without it

    path = resolve_model_path(config.model.model)
    hf_config = load_hf_config(path, config.model.trust_remote_code)
    max_model_len = max_model_len_for(config.scheduler.max_model_len, hf_config)
    config = replace(
        config, model=replace(config.model, model=str(path)),
        scheduler=replace(config.scheduler, max_model_len=max_model_len),
    )
    predictor = profile_predictor(config)  # before any weights load or rank spawns
    if config.model.tensor_parallel_size > 1:
        from worker.tp.runner import TPModelRunner  # torch, ray: only a TP group spawns actors

        runner = TPModelRunner(config, hf_config, max_model_len, config.model.tensor_parallel_size)
    else:
        runner = ModelRunner(config, hf_config, max_model_len)
    # The longest sequence the KV pool can hold bounds it too (known once the pool is sized);
    # with KV groups, in the blocks its every group holds (kv/kv_geometry.py).
    max_model_len = cap_to_kv_capacity(max_model_len, _sequence_blocks(runner, config.cache.block_size, max_model_len),
                                       config.cache.block_size)
    scheduler_config = replace(config.scheduler, max_model_len=max_model_len)
    engine = Engine(scheduler_config, config.cache, runner, hf_config.vocab_size, eos_token_ids_of(path, hf_config),
                    step_time_predictor=predictor, speculative=config.speculative)
    engine.model_path = path
    if config.cache.host_kv_cache_bytes:
        from worker.kvcache.tiers import TierManager  # torch: a simulated device builds without it

        device = getattr(runner, "device", None)
        pin = device is not None and device.type == "cuda"
        engine.use_tiers(TierManager.from_config(config.cache, runner, path, pin_memory=pin))
    engine.compiles.compiler = GrammarCompiler.for_model_path(path, hf_config.vocab_size, config.model.trust_remote_code)
    if getattr(runner, "lora", None) is not None:
        engine.enable_lora(EngineLoRA(config.lora, runner.lora_loader))
    return engine


def check_speculative(config: EngineConfig) -> None:
    """Refuse speculative decoding where it is not built: under tensor parallelism (the
    ranks' plan codec carries no drafts) and on a simulated device (its runner samples no
    logits to verify against; the cost model prices speculation instead, worker/costs/)."""
    if not config.speculative.enabled:
        return
    if config.model.tensor_parallel_size > 1:
        raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1")
    if is_sim_device(config.model.device):
        raise ValueError("speculative decoding is not supported on a simulated device (sim:...); "
                         "the simulator prices it from an acceptance rate instead")
    if config.speculative.draft_model is not None:
        check_draft_model(config.speculative.draft_model, config.model.model)


def check_draft_model(draft: str, target: str) -> None:
    """A draft model must share the target's vocabulary (its token ids are proposed as the
    target's): the same vocab_size in both config.json files."""
    draft_vocab = load_hf_config(resolve_model_path(draft)).vocab_size
    target_vocab = load_hf_config(resolve_model_path(target)).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
                         f"({target_vocab}): a draft model must share the target's tokenizer")


def _sequence_blocks(runner: object, block_size: int, max_model_len: int) -> int:
    """Blocks of a plain table that the longest sequence the pool holds would fill: the pool
    itself for one full-attention group; with KV groups, that sequence's length in blocks
    (every group's blocks counted, the null block reserved)."""
    num_blocks = runner.num_blocks  # type: ignore[attr-defined]
    layout = getattr(runner, "kv_layout", None)
    if layout is None or not layout.frees_blocks:
        return num_blocks
    geometry = KVGeometry.from_layout(layout, block_size)
    longest = geometry.max_sequence_tokens(num_blocks - 1, max(max_model_len, num_blocks * block_size))
    return -(-longest // block_size)
