"""The grouped MoE (worker/model/moe.py) against a dense per-token reference: every token,
every one of its top-k experts, one at a time; and the routers against transformers'."""
from __future__ import annotations

import pytest
import torch

from worker.model.moe import (
    MoEActivation, apply_activation, grouped_experts, grouped_experts_torch, softmax_topk, topk_softmax,
)

SWIGLU_CLAMP = MoEActivation("swiglu_clamp", alpha=1.702, limit=7.0)


def _dense_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    activation: MoEActivation, b13: torch.Tensor | None, b2: torch.Tensor | None,
) -> torch.Tensor:
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e] @ x[t] + (b13[e] if b13 is not None else 0)
            h = apply_activation(gate_up[:inter], gate_up[inter:], activation)
            out[t] += weights[t, k] * (w2[e] @ h + (b2[e] if b2 is not None else 0))
    return out


def _weights(num_experts: int, hidden: int, inter: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    b13 = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) if bias else None
    return w13, w2, b13, b2


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 1), (7, 4, 2), (53, 8, 2), (40, 8, 4)])
@pytest.mark.parametrize("activation,bias", [(MoEActivation(), False), (SWIGLU_CLAMP, True)])
def test_grouped_matches_dense_per_token(
    num_tokens: int, num_experts: int, top_k: int, activation: MoEActivation, bias: bool
) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=g) * 3  # large enough for the clamp to bite
    w13, w2, b13, b2 = _weights(num_experts, 64, 32, bias)
    ids, weights = softmax_topk(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    want = _dense_reference(x, w13, w2, ids, weights, activation, b13, b2)
    got = grouped_experts(x, w13, w2, ids, weights, activation, b13, b2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_skewed_routing_and_idle_experts() -> None:
    """Every token to the same two experts; the others see no token at all."""
    x = torch.randn(20, 64)
    w13, w2, _, _ = _weights(8, 64, 32, False)
    ids = torch.tensor([[5, 2]] * 20)
    weights = torch.full((20, 2), 0.5)
    want = _dense_reference(x, w13, w2, ids, weights, MoEActivation(), None, None)
    torch.testing.assert_close(grouped_experts_torch(x, w13, w2, ids, weights), want, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_is_gpt_oss_arithmetic() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2)
    experts = GptOssExperts(config)
    gate_up = torch.randn(5, 32) * 10  # interleaved gate / up columns, as gpt-oss stores them
    want = experts._apply_gate(gate_up)
    got = apply_activation(gate_up[:, ::2], gate_up[:, 1::2], SWIGLU_CLAMP)
    assert torch.equal(got, want)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_topk_is_qwen3_moe_router(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16)
    _, want_weights, want_ids = router(x)
    ids, weights = softmax_topk(x @ router.weight.T, 3, norm_topk_prob)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


def test_topk_softmax_is_gpt_oss_router() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=4)
    router = GptOssTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(11, 16)
    _, want_weights, want_ids = router(x)
    ids, weights = topk_softmax(torch.nn.functional.linear(x, router.weight, router.bias), 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)
