"""`kvserve serve --device sim:h200 --model-shape llama-3-8b`: the worker it builds starts
and serves, with max_model_len unset (the shape's own context length, as a real model's
config gives it). No Ray: the replica class is built directly, as Serve would build it."""
from __future__ import annotations

from cluster import cli
from worker.api import GenerateRequest, SamplingParams
from worker.config import CacheConfig, SchedulerConfig
from worker.serving.replica import WorkerReplica
from worker.sim.build import build_sim_engine
from worker.costs.shapes import load_shape


async def test_the_serve_command_builds_a_sim_worker_that_serves() -> None:
    args = cli.build_parser().parse_args(["serve", "--device", "sim:h200", "--model-shape", "llama-3-8b"])
    engine_config = cli.config_from_args(args).engine_config()
    assert engine_config.model.device == "sim:h200" and engine_config.model.model_shape == "llama-3-8b"
    assert engine_config.scheduler.max_model_len is None  # unset: what used to crash the replica
    replica = WorkerReplica(engine_config)
    try:
        assert replica.engine.engine.max_model_len == load_shape("llama-3-8b").max_position_embeddings == 8192
        request = GenerateRequest("r1", [5, 6, 7], SamplingParams(max_tokens=8, detokenize=False))
        outputs = [out async for out in replica.generate(request)]
        assert sum(len(out.new_token_ids) for out in outputs) == 8
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    finally:
        replica.engine.shutdown()


def test_unset_max_model_len_is_the_shapes_context_capped_by_the_pool() -> None:
    assert build_sim_engine("llama-3-8b", "h200", SchedulerConfig()).max_model_len == 8192
    assert build_sim_engine("llama-3-8b", "h200", SchedulerConfig(max_model_len=1000)).max_model_len == 1000
    # No sequence can outgrow the KV pool (100 blocks of 16 tokens), as on a real device.
    small = build_sim_engine("llama-3-8b", "h200", SchedulerConfig(), CacheConfig(num_blocks_override=100))
    assert small.max_model_len == 1600
