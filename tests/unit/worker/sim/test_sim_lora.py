"""LoRA adapters on a simulated device: `kvserve serve --device sim:h200 --lora-modules`
builds a worker that serves them; a step that writes an adapter into a device slot takes
its bytes over the profile's host link on top of its own time, and steps with adapter
rows take their shrink/expand work; the adapter byte count from adapter_config.json is
the real adapter's. No Ray: the replica class is built directly, as Serve would."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cluster import cli
from worker.api import GenerateRequest, LoRAAdapterError, SamplingParams
from worker.config import CacheConfig, LoRAConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.lora.cost import (
    TARGET_NAMES, adapter_num_bytes, config_num_bytes, config_targets, load_seconds, step_work,
)
from worker.serving.replica import WorkerReplica
from worker.sim.lora import shape_target_shapes
from worker.sim.build import build_sim_engine
from worker.costs.shapes import load_shape

if TYPE_CHECKING:
    from tests.conftest import TinyModels

SHAPE = "llama-3-8b"


def _adapter(root: Path, name: str, rank: int, targets: list[str] | str) -> Path:
    """A PEFT adapter directory as a simulated replica reads it (its config; no weights)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": targets, "bias": "none"}))
    return path


def _engine(modules: dict[str, Path], max_loras: int = 2) -> Engine:
    return build_sim_engine(SHAPE, "h200", SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
                            CacheConfig(num_blocks_override=512),
                            lora=LoRAConfig(max_loras=max_loras, max_lora_rank=16,
                                            modules=tuple((n, str(p)) for n, p in modules.items())))


def _step_times(engine: Engine) -> list[float]:
    times = []
    while engine.has_unfinished():
        outs = engine.step()
        assert all(o.error is None for o in outs), [o.error for o in outs]
        if engine.runner.num_steps > len(times):  # a step ran (not an adapter-load wait)
            times.append(engine.runner.last_step_s)
    return times


def test_load_over_the_host_link_and_adapter_rows_cost_their_work(tmp_path: Path) -> None:
    shape = load_shape(SHAPE)
    sql = _adapter(tmp_path, "sql", 16, "all-linear")
    prompt = list(range(10, 138))
    base = _engine({"sql": sql})
    base.add_request("b", prompt, SamplingParams(max_tokens=4))
    base_times = _step_times(base)

    engine = _engine({"sql": sql})
    engine.add_request("a", prompt, SamplingParams(max_tokens=4), lora_name="sql")
    times = _step_times(engine)
    num_bytes = adapter_num_bytes(16, config_targets({"target_modules": "all-linear"}), shape_target_shapes(shape),
                                  shape.num_layers, shape.dtype_bytes)
    assert engine.lora.registry.get("sql").num_bytes == num_bytes == 16 * 32 * 2 * (
        2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # r * layers * dtype * sum(in + out)
    link = engine.runner.cost.profile.host_link_bandwidth
    profile = engine.runner.cost.profile

    def rows_s(num_tokens: int) -> float:
        work = step_work(num_tokens, 1, 16, shape_target_shapes(shape), shape.num_layers, shape.dtype_bytes)
        return max(work.flops / profile.effective_flops, work.bytes / profile.effective_bandwidth)

    # The prefill step writes the slot (the copy) and runs 128 adapter rows; decodes run one.
    assert times[0] == pytest.approx(base_times[0] + load_seconds(num_bytes, link) + rows_s(128), rel=1e-9)
    for t, b in zip(times[1:], base_times[1:], strict=True):
        assert t == pytest.approx(b + rows_s(1), rel=1e-9)
    assert load_seconds(num_bytes, link) > 0.5e-3  # ~84 MB over 64 GB/s: visible next to a decode step
    # A second request under the resident adapter does not copy it again; a base-model
    # request on a LoRA engine costs what it costs without LoRA.
    engine.add_request("a2", [8] * 128, SamplingParams(max_tokens=1), lora_name="sql")
    engine.add_request("b2", [7] * 128, SamplingParams(max_tokens=1))
    assert _step_times(engine)[0] == pytest.approx(base.runner.cost.predict_rows([(128, 0, True)] * 2) + rows_s(256))
    assert engine.lora.slots.num_loads == 1


def test_adapter_bytes_from_config_are_the_real_adapters(tiny_model: TinyModels, tmp_path: Path) -> None:
    """The config-only count (what the simulators price) equals the bytes a real replica
    reads from the adapter's safetensors (fp32 here), for a subset of targets."""
    from tests.support.tiny_lora import make_tiny_adapter
    from worker.lora.adapter import TARGETS
    from worker.lora.model_lora import adapter_loader, target_shapes
    from worker.model.llama import LlamaArch
    from worker.model_config import load_hf_config

    base = tiny_model("llama")
    path = make_tiny_adapter(base, tmp_path / "a", 8, ("q_proj", "v_proj", "down_proj"))
    arch = LlamaArch.from_hf_config(load_hf_config(base))
    real = adapter_loader(arch, 16)("a", str(path))
    config = json.loads((path / "adapter_config.json").read_text())
    assert sorted(config_targets(config)) == ["down_proj", "q_proj", "v_proj"]
    assert tuple(TARGETS) == TARGET_NAMES == config_targets({"target_modules": r".*_proj"})
    assert config_num_bytes(config, target_shapes(arch), arch.num_layers, 4) == real.num_bytes


def test_refused_adapters_fail_their_request_and_base_requests_run(tmp_path: Path) -> None:
    engine = _engine({"big": _adapter(tmp_path, "big", 32, ["q_proj"]),
                      "none": _adapter(tmp_path, "none", 4, ["lm_head"])})
    params = SamplingParams(max_tokens=2)
    engine.add_request("big", [5, 6, 7], params, lora_name="big")
    engine.add_request("none", [5, 6, 7], params, lora_name="none")
    engine.add_request("base", [5, 6, 7], params)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "ranks 1..16" in finals["big"].error and "names none of the supported targets" in finals["none"].error
    assert finals["base"].error is None
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        engine.check_lora("gone", str(tmp_path / "gone"))


async def test_the_serve_command_builds_a_sim_worker_with_adapters(tmp_path: Path) -> None:
    sql = _adapter(tmp_path, "sql", 8, ["q_proj", "v_proj"])
    args = cli.build_parser().parse_args(["serve", "--device", "sim:h200", "--model-shape", SHAPE,
                                          "--lora-modules", f"sql={sql}"])
    replica = WorkerReplica(cli.config_from_args(args).engine_config())
    try:
        request = GenerateRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4, detokenize=False),
                                  lora_name="sql", lora_path=str(sql))
        outputs = [out async for out in replica.generate(request)]
        assert sum(len(out.new_token_ids) for out in outputs) == 4 and outputs[-1].finish_reason == "length"
        assert replica.record_routing_stats()["lora_resident"] == ("sql",)
    finally:
        replica.engine.shutdown()
