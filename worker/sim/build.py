"""Building an engine on a simulated device (worker/sim/runner.py's SimRunner under the real
Engine), without Ray or config files (the discrete-event simulator, tests) or from an
engine config (`device: sim:<profile>`):

    from worker.sim.build import build_sim_engine
    engine = build_sim_engine("llama-3-8b", "h200", SchedulerConfig(...), CacheConfig(...))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=64))
    outputs = engine.step(); dt = engine.runner.last_step_s  # modelled seconds of that step
"""
from __future__ import annotations

from dataclasses import replace

from worker.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from worker.costs.cost_model import StepCostModel
from worker.costs.profiles import DeviceProfile, load_profile
from worker.costs.shapes import ModelShape, load_shape
from worker.engine.core import Engine
from worker.lora.engine_lora import EngineLoRA
from worker.model_config import cap_to_kv_capacity, eos_token_ids_of, max_model_len_for
from worker.model_path import resolve_model_path
from worker.sim.device import parse_sim_device
from worker.sim.lora import SimLoRA
from worker.sim.runner import SimRunner
from worker.sim.spec import SimDraftProposer


def build_sim_engine(
    shape: ModelShape | str,
    profile: DeviceProfile | str,
    scheduler: SchedulerConfig = SchedulerConfig(),
    cache: CacheConfig = CacheConfig(),
    *,
    sleep: bool = False,
    time_dilation: float = 1.0,
    token_vocab_size: int | None = None,
    eos_token_ids: frozenset[int] | None = None,
    lora: LoRAConfig = LoRAConfig(),
    speculative: SpeculativeConfig | None = None,
    spec_acceptance: float = 0.0,
) -> Engine:
    """The real Engine (scheduler, KV cache manager, step loop) on a SimRunner.

    KV blocks: cache.num_blocks_override when set, else the device memory *
    cache.gpu_memory_utilization minus the weights. max_model_len: the shape's
    max_position_embeddings when unset, never more than it, and never more than the KV
    pool holds. Tokens are drawn from [0, token_vocab_size) (default: the shape's
    vocabulary), never from eos_token_ids (default: the shape's). `lora`: adapters as on a
    real device, priced by worker/sim/lora.py. `speculative` (its num_tokens) with
    `spec_acceptance`: verify rows priced by the cost model, drafts accepted at that rate
    (worker/sim/spec.py); the engine then steps serially, as a real one does."""
    shape = load_shape(shape) if isinstance(shape, str) else shape
    if cache.kv_cache_dtype == "fp8":  # e4m3 KV: one byte per element (worker/attention/kv_quant.py)
        shape = replace(shape, kv_dtype_bytes=1)
    profile = load_profile(profile) if isinstance(profile, str) else profile
    cost = StepCostModel(shape, profile)
    num_blocks = cache.num_blocks_override or cost.num_kv_blocks(cache.block_size, cache.gpu_memory_utilization)
    # As build_engine does for a real model: unset means the model's own context
    # length (the shape's max_position_embeddings), a larger one is cut to it, and no
    # sequence may outgrow the KV pool.
    max_model_len = cap_to_kv_capacity(max_model_len_for(scheduler.max_model_len, shape), num_blocks, cache.block_size)
    scheduler = replace(scheduler, max_model_len=max_model_len)
    eos = frozenset(shape.eos_token_ids) if eos_token_ids is None else eos_token_ids
    runner = SimRunner(
        cost, num_blocks, cache.block_size, token_vocab_size or shape.vocab_size,
        time_dilation=time_dilation, sleep=sleep, avoid_token_ids=eos,
        lora=SimLoRA(shape, profile, lora.max_lora_rank) if lora.enabled else None,
        spec_acceptance=spec_acceptance,
    )
    engine = Engine(scheduler, cache, runner, shape.vocab_size, eos, speculative=speculative)
    use_sim_drafts(engine)
    if runner.lora_loader is not None:
        engine.enable_lora(EngineLoRA(lora, runner.lora_loader))
    return engine


def sim_engine_from_config(config: EngineConfig) -> Engine:
    """build_engine's branch for `device: sim:<profile>`. The model directory
    (`config.model.model`, the embedded default unless set) is only read for its
    tokenizer, which the replica detokenizes with, and its EOS ids; the shape is
    `model_shape` (default: that directory's config.json). No weights are read."""
    profile = parse_sim_device(config.model.device)
    assert profile is not None
    if config.cache.host_kv_cache_bytes:
        # Refused, never ignored: the simulated device holds no KV to move (docs/kv-tiers.md).
        raise ValueError("KV tiers (host_kv_cache_bytes) are not modelled by the simulated device yet; "
                         "set it to 0 for sim: devices")
    path = resolve_model_path(config.model.model)
    text_config = load_shape(str(path)) if (path / "config.json").is_file() else None
    shape = load_shape(config.model.model_shape) if config.model.model_shape else text_config
    if shape is None:
        raise FileNotFoundError(f"{path} has no config.json; give the sim device a model_shape")
    # Text ids must decode with that tokenizer: draw from its vocabulary, and never its EOS.
    text_eos = eos_token_ids_of(path, None)  # generation_config.json's
    if text_config is not None:
        text_eos |= frozenset(text_config.eos_token_ids)
    engine = build_sim_engine(
        shape, profile, config.scheduler, config.cache,
        sleep=True, time_dilation=config.model.time_dilation,
        token_vocab_size=min(shape.vocab_size, text_config.vocab_size) if text_config else None,
        eos_token_ids=frozenset(shape.eos_token_ids) | text_eos, lora=config.lora,
    )
    engine.model_path = path
    return engine


def use_sim_drafts(engine: Engine) -> None:
    """With speculation on, the engine's scheduler proposes placeholder drafts: on a
    simulated device acceptance is the runner's rate, not a match (worker/sim/spec.py)."""
    speculator = engine.scheduler.speculator
    if speculator is not None:
        speculator.proposer = SimDraftProposer(speculator.config.num_tokens)  # type: ignore[assignment]
