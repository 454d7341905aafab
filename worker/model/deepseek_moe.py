"""DeepSeek-V3's feed-forward blocks: the dense MLP of the first layers and the MoE block
(routed experts chosen by a grouped top-k gate, plus always-on shared experts).

The gate (transformers' DeepseekV3TopkRouter, "noaux_tc"), over the whole flat batch:

    scores  = sigmoid(x @ gate.weight^T)                      fp32, (T, E)
    choice  = scores + e_score_correction_bias                the bias steers the choice only
    groups  : E experts in n_group groups; a group's score = sum of its 2 best `choice`;
              keep the topk_group best groups, mask the other groups' experts out
    top-k   = the num_experts_per_tok best `choice` among the kept experts
    weights = scores at those experts (no bias), / their sum if norm_topk_prob,
              * routed_scaling_factor

The routed experts run grouped over the flat batch (worker/model/moe.py); the block's
output is routed + shared_experts(x).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.moe import SILU, FusedExperts
from worker.model.parallel import SINGLE, MergedColumnParallelLinear, RowParallelLinear, TPContext, all_reduce


@dataclass(frozen=True)
class RoutingArch:
    num_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_intermediate_size: int
    num_shared_experts: int

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> RoutingArch:
        return cls(
            num_experts=hf_config.n_routed_experts,
            top_k=hf_config.num_experts_per_tok,
            num_groups=hf_config.n_group or 1,
            topk_groups=hf_config.topk_group or 1,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            moe_intermediate_size=hf_config.moe_intermediate_size,
            num_shared_experts=hf_config.n_shared_experts or 0,
        )


def grouped_topk(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, routing: RoutingArch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) fp32 router logits -> top-k weights (T, k) fp32 and expert ids (T, k) long."""
    num_tokens = router_logits.shape[0]
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    per_group = routing.num_experts // routing.num_groups
    group_scores = choice.view(num_tokens, routing.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=routing.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, routing.num_experts)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if routing.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routing.routed_scaling_factor, topk_ids


class DenseMLP(nn.Module):
    """SwiGLU MLP: gate_up_proj = [gate; up] rows (the checkpoint's gate_proj / up_proj
    as parts 0 / 1), down_proj; under TP split by the intermediate size."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, intermediate_size, 2, False, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial sum (the caller all-reduces it with others)."""
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.part_size, dim=-1)
        out = F.linear(F.silu(gate) * up, self.down_proj.weight)
        return all_reduce(out, self.tp) if reduce else out


class Gate(nn.Module):
    """The router's parameters, kept in fp32 whatever the model dtype (as transformers
    keeps `gate.weight` and `e_score_correction_bias`)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class DeepseekMoE(nn.Module):
    """Under TP the routed experts split within each expert (worker/model/moe.py) and the
    shared experts by their intermediate size; the gate is replicated; both partial sums
    leave in ONE all-reduce."""

    def __init__(self, hidden_size: int, routing: RoutingArch, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.routing = routing
        inter = routing.moe_intermediate_size
        self.gate = Gate(hidden_size, routing.num_experts)
        self.experts = FusedExperts(routing.num_experts, hidden_size, inter, bias=False, tp=tp)
        self.shared_experts = (
            DenseMLP(hidden_size, inter * routing.num_shared_experts, tp) if routing.num_shared_experts else None
        )
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.gate.e_score_correction_bias.float(), self.routing)
        out = self.experts(x, ids, weights, SILU)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, reduce=False)
        return all_reduce(out, self.tp)
