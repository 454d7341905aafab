"""The LM head of a step's sampling rows, and the greedy argmax the runner takes itself.

A batch whose rows all sample by plain argmax (worker/sampling/sampler.py argmax_only)
needs no sampler: its ids are the argmax of the logits in the model dtype (the fp32
upcast is exact, so the index is the same). The decode CUDA graphs capture this head
behind the model (worker/runner/cuda_graphs.py), so a greedy decode step is one replay
from input ids to sampled ids; eager steps run the same function.
"""
from __future__ import annotations

from typing import Callable

import torch

# (hidden rows, fp32) -> (rows, V') logits, V' >= vocab_size (a padded head)
ComputeLogits = Callable[..., torch.Tensor]


def head_logits(compute_logits: ComputeLogits, hidden: torch.Tensor, in_model_dtype: bool) -> torch.Tensor:
    """Logits of `hidden`'s rows: in the model dtype where the model offers it, else fp32."""
    return compute_logits(hidden, fp32=False) if in_model_dtype else compute_logits(hidden)


def greedy_ids(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows,) long: each row's argmax over the tokenizer's vocabulary (padded columns of
    the head are never tokens)."""
    return logits[:, :vocab_size].argmax(dim=-1)
