"""Mixture-of-experts over the flat token batch: route every token of the step at once,
group the (token, expert) pairs by expert, one matmul per expert group, weighted combine.

    hidden (T, H) --router--> topk_ids, topk_weights (T, K)
    pairs j = t * K + k, sorted by expert id (stable)     -> counts per expert (bincount)
    expert e: rows [start_e, start_e + count_e) of the sorted pairs, gathered from hidden,
              h = act(x @ w13[e]^T + b13[e]);  y = h @ w2[e]^T + b2[e]
    out[t] += topk_weights[t, k] * y[j]                    (index_add over the pairs)

Weights: w13 (E, 2 * I, H) holds [gate; up] rows of every expert, w2 (E, H, I): the
checkpoint's layouts (per-expert tensors, or fused 3-D ones) are rewritten into these at
load time (`FusedExperts.load_checkpoint_tensor`).

Tensor parallelism shards within each expert, as the dense MLP is sharded
(worker/model/parallel.py): rank r holds gate/up rows [r*I/N, (r+1)*I/N) and the same
columns of down of EVERY expert; each rank computes its partial sum for all tokens and the
layer ends in one all-reduce. Every rank does the same share of every expert's work, so
the load is balanced whatever the routing, and no all-to-all is needed
(docs/architecture.md, "Mixture of experts").

On CUDA the grouped matmuls run as one Triton kernel launch each over all experts
(worker/model/moe_triton.py), without the host sync that the per-expert loop's counts need.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.checkpoint_names import ALL_PARTS
from worker.model.moe_activation import SILU, MoEActivation, apply_activation  # noqa: F401  (re-exported)
from worker.model.parallel import SINGLE, TPContext, all_reduce, shard_range


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts in fp32, the top k, optionally
    renormalised to sum to 1. Returns (ids (T, K) long, weights (T, K) in logits' dtype)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the top k logits, then a softmax over just those k."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(values, dim=-1, dtype=values.dtype)


def grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for every token t, from
    precomputed routing (any gate: softmax-top-k, top-k-softmax, DeepSeek's grouped one).
    hidden (T, H); w13 (E, 2I, H); w2 (E, H, I); topk_* (T, K); biases (E, 2I) / (E, H).
    Partial under TP (this rank's slice of I): the caller all-reduces."""
    if hidden.is_cuda:
        from worker.model import moe_triton  # triton: only a CUDA tensor loads the kernel module

        if moe_triton.available():
            return moe_triton.fused_experts(hidden, w13, w2, topk_ids, topk_weights, activation, w13_bias, w2_bias)
    return grouped_experts_torch(hidden, w13, w2, topk_ids, topk_weights, activation, w13_bias, w2_bias)


def grouped_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: MoEActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """grouped_experts with a torch matmul per expert group (its counts cost a host sync)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    flat_ids = topk_ids.reshape(-1)
    # Stable: inside an expert's group pairs stay in token order, so each token's sum adds
    # its experts in ascending id order (as transformers does).
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x = hidden.index_select(0, token_of_pair)
    y = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(x[start:end], w13[expert], None if w13_bias is None else w13_bias[expert])
        h = apply_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
        y[start:end] = F.linear(h, w2[expert], None if w2_bias is None else w2_bias[expert])
        start = end
    weighted = y * topk_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token_of_pair, weighted.to(hidden.dtype))


class Router(nn.Module):
    """The gate's logits, (T, E), replicated on every rank (it is tiny)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# Layouts a checkpoint stores fused experts in (ALL_PARTS tensors):
#   "concat":      gate_up_proj (E, 2I, H) = [gate; up] rows, down_proj (E, H, I)
#   "interleaved": gate_up_proj (E, H, 2I) with gate at even and up at odd columns,
#                  down_proj (E, I, H) (gpt-oss); biases (E, 2I) interleaved alike.
FUSED_LAYOUTS = ("concat", "interleaved")


class FusedExperts(nn.Module):
    """All experts of a layer as stacked weights, this rank's slice of each.
    Checkpoint parts: w13 / w13_bias part 2e + j = expert e's gate (j=0) or up (j=1);
    w2 / w2_bias part e; ALL_PARTS = a fused tensor holding every expert."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        tp: TPContext = SINGLE,
        fused_layout: str = "concat",
    ) -> None:
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} does not divide the model's expert intermediate size "
                f"{intermediate_size}"
            )
        if fused_layout not in FUSED_LAYOUTS:
            raise ValueError(f"unknown fused experts layout {fused_layout!r}")
        self.num_experts, self.tp, self.fused_layout = num_experts, tp, fused_layout
        self.shard = shard_range(intermediate_size, tp)
        local = self.shard[1] - self.shard[0]
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * local)) if bias else None
        # The down bias is added once: by rank 0, before the all-reduce sums the ranks.
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: MoEActivation
    ) -> torch.Tensor:
        """This rank's partial sum (T, H); the caller all-reduces."""
        w2_bias = self.w2_bias if self.tp.rank == 0 else None
        return grouped_experts(x, self.w13, self.w2, topk_ids, topk_weights, activation, self.w13_bias, w2_bias)

    def num_load_parts(self, kind: str) -> int:
        return 2 * self.num_experts if kind.startswith("w13") else self.num_experts

    def load_checkpoint_tensor(
        self, f: object, name: str, kind: str, part: int, dest: torch.Tensor
    ) -> torch.Tensor:
        """Copy this rank's piece of checkpoint tensor `name` into `dest` (the parameter
        `kind`); returns what was read."""
        lo, hi = self.shard
        local = hi - lo
        if part != ALL_PARTS:
            tensor = self._read_expert_part(f.get_slice(name), kind)
            if kind.startswith("w13"):
                expert, j = divmod(part, 2)
                dest[expert, j * local : (j + 1) * local].copy_(tensor)
            else:
                dest[part].copy_(tensor)
            return tensor
        piece = f.get_slice(name)
        if self.fused_layout == "concat":
            if kind in ("w13", "w13_bias"):  # gate rows then up rows, on dim 1
                gate, up = piece[:, lo:hi], piece[:, self.intermediate_size + lo : self.intermediate_size + hi]
                tensor = torch.cat([gate, up], dim=1)
            elif kind == "w2":
                tensor = piece[:, :, lo:hi]
            else:
                tensor = piece[:]
        else:  # interleaved, transposed (x @ W): columns 2i / 2i+1 are gate / up of unit i
            if kind == "w13":
                cols = piece[:, :, 2 * lo : 2 * hi]
                tensor = torch.cat([cols[..., ::2], cols[..., 1::2]], dim=2).transpose(1, 2)
            elif kind == "w13_bias":
                cols = piece[:, 2 * lo : 2 * hi]
                tensor = torch.cat([cols[..., ::2], cols[..., 1::2]], dim=1)
            elif kind == "w2":
                tensor = piece[:, lo:hi, :].transpose(1, 2)
            else:
                tensor = piece[:]
        dest.copy_(tensor)
        return tensor

    def _read_expert_part(self, piece: object, kind: str) -> torch.Tensor:
        """One expert's gate or up (I, H) rows / bias (I,), or its down (H, I) cols / bias (H,)."""
        lo, hi = self.shard
        if kind in ("w13", "w13_bias"):
            return piece[lo:hi]
        if kind == "w2":
            return piece[:, lo:hi]
        return piece[:]


class SparseMoE(nn.Module):
    """Router + experts + the one all-reduce of the layer. `routing`: "softmax_topk"
    (renormalised when `renormalize`) or "topk_softmax"."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        routing: str = "softmax_topk",
        renormalize: bool = True,
        activation: MoEActivation = SILU,
        bias: bool = False,
        tp: TPContext = SINGLE,
        fused_layout: str = "concat",
    ) -> None:
        super().__init__()
        if routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown MoE routing {routing!r}")
        self.gate = Router(hidden_size, num_experts, bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, bias, tp, fused_layout)
        self.top_k, self.routing, self.renormalize, self.activation, self.tp = (
            top_k, routing, renormalize, activation, tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.routing == "softmax_topk":
            ids, weights = softmax_topk(logits, self.top_k, self.renormalize)
        else:
            ids, weights = topk_softmax(logits, self.top_k)
        return all_reduce(self.experts(x, ids, weights, self.activation), self.tp)
