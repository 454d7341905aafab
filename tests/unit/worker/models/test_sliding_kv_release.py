"""Sliding-window layers give their blocks back as the sequence advances, on every family
that has them (Mistral: one sliding group; Qwen2 with max_window_layers: a full and a
sliding group; Gemma 3: tests/unit/worker/models/test_gemma3_vs_hf.py), outputs staying
transformers' own; and what cannot carry such a layout refuses it clearly.""" 
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kv.cache_manager import cdiv
from tests.support.tiny_gemma import GEMMA_WINDOW, gemma3_config
from tests.support.tiny_models import SLIDING_WINDOW
from tests.unit.worker.models.test_engine_vs_hf import ALL, BLOCK, MAX_TOKENS, PROMPTS, _assert_free, _engine, _greedy
from worker.model_config import UnsupportedModelError, check_supported

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels
    from tests.unit.worker.models.conftest import TinyGemma


@pytest.mark.parametrize("family,num_groups", [("mistral_swa", 1), ("qwen2_swa", 2)])
def test_long_request_holds_the_window_in_its_sliding_group(
    family: str, num_groups: int, tiny_model: TinyModels, hf_reference: HFReference
) -> None:
    engine = _engine(tiny_model(family), max_num_batched_tokens=16)
    assert engine.kv.layout.num_groups == num_groups and engine.kv.null_block is not None
    sliding = [gi for gi, g in enumerate(engine.kv.groups) if g.sliding_window is not None]
    prompt, n = PROMPTS[8], MAX_TOKENS[8]  # 120 + 64 tokens: 12 blocks, the window is 24
    engine.add_request("long", prompt, _greedy(n))
    tokens: list[int] = []
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if "long" in engine.seqs and engine.kv.tables("long")[0]:
            held = engine.kv.num_held_blocks("long")
            most = max(most, *(held[g] for g in sliding))
    assert most <= cdiv(SLIDING_WINDOW - 1, BLOCK) + 2 < cdiv(len(prompt) + n, BLOCK)
    assert tokens == hf_reference(family, [prompt], [n])[0]
    _assert_free(engine)


def test_preempted_sliding_requests_resume_exactly(
    tiny_model: TinyModels, hf_reference: HFReference, run_engine: Callable
) -> None:
    """A pool that holds a few requests' windows (released blocks let far more run than
    whole sequences would): preemption and recompute on Mistral."""
    engine = _engine(tiny_model("mistral_swa"), num_blocks=14, max_num_batched_tokens=32)
    indices = ALL
    out = run_engine(engine, [PROMPTS[i] for i in indices], [_greedy(MAX_TOKENS[i]) for i in indices])
    refs = hf_reference("mistral_swa", PROMPTS, MAX_TOKENS)
    assert out == {str(j): refs[i] for j, i in enumerate(indices)}
    assert engine.stats().num_preemptions > 0
    _assert_free(engine)


def test_kv_tiers_keep_every_block_in_one_table(tiny_gemma: TinyGemma) -> None:
    """A tier block holds every layer's KV: with tiers on, the layout is one table and no
    sliding block is released (logged); without, a built engine refuses tiers."""
    from tests.unit.worker.kvcache import test_kv_tiers_vs_hf as tiers

    model_dir = tiny_gemma("gemma3")
    with_tiers = tiers._engine(model_dir, 16, host_bytes=1 << 20)
    assert with_tiers.kv.layout.num_groups == 1 and with_tiers.kv.null_block is None
    with_tiers.tiers.close()
    engine = _engine(model_dir)
    assert engine.kv.layout.num_groups == 3
    with pytest.raises(ValueError, match="host/disk KV tiers are not supported"):
        engine.use_tiers(object())  # type: ignore[arg-type]


def test_a_full_attention_engine_keeps_one_plain_table(tiny_model: TinyModels) -> None:
    engine = _engine(tiny_model("llama"))
    assert engine.kv.layout.num_groups == 1 and engine.kv.null_block is None
    assert engine.kv.num_total_blocks == 512


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal Gemma 3"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "unsupported activation"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_gemma3_refuses_what_it_does_not_build(change: dict, message: str) -> None:
    config = gemma3_config("gemma3")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(config)


def test_the_multimodal_model_type_is_refused_too() -> None:
    config = gemma3_config("gemma3")
    config.architectures = None
    config.model_type = "gemma3"
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM"):
        check_supported(config)


def test_gemma3_routing_report_carries_its_geometry(tiny_gemma: TinyGemma) -> None:
    """The router reads the replica's own geometry: one global group, two local windows,
    a pool block of two layers; reservations count every group's blocks."""
    from router.routing.types import ReplicaReport
    from worker.serving.routing_report import build_routing_stats

    engine = _engine(tiny_gemma("gemma3"), max_num_seqs=1)
    engine.add_request("a", PROMPTS[8], _greedy(4))
    engine.add_request("b", PROMPTS[9], _greedy(4))  # waits: one running slot
    engine.step()
    stats = build_routing_stats(engine, engine.stats(), [], timestamp=1.0)
    assert (stats.kv_full_groups, stats.kv_sliding_windows) == (1, (GEMMA_WINDOW, GEMMA_WINDOW))
    assert stats.kv_bytes_per_block == engine.runner.spec.bytes_per_block
    waiting = len(PROMPTS[9])
    assert stats.reserved_blocks == cdiv(waiting, BLOCK) + 2 * min(cdiv(waiting, BLOCK), cdiv(GEMMA_WINDOW - 1, BLOCK) + 2)
    report = ReplicaReport.from_stats(stats.to_dict())
    assert report is not None and report.geometry.num_full_groups == 1
