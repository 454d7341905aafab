"""How the grouped (non-varlen) attention backend batches decodes: torch-free, so that the
simulator's cost model prices exactly the groups the model runner builds.

The torch backend (worker/attention/torch_paged.py) attends decodes group by group, each
group padded to its longest context: a decode of context c in a group whose longest is m
costs m + 1 query-key pairs and m + 1 tokens of gathered KV, not c + 1. Varlen backends
(flash, triton) attend every sequence at its own length.
"""
from __future__ import annotations

from collections.abc import Sequence

MIN_GROUP = 8


def decode_group_bounds(sorted_contexts: Sequence[int], min_group: int = MIN_GROUP) -> list[tuple[int, int]]:
    """Split decodes (sorted by context length) into groups attended in one call each.
    A group pads every member to its longest context, so a new group starts when the
    context has doubled since the group's first member (padding waste < 2x), provided the
    group already has `min_group` members (each call has a fixed cost too)."""
    bounds = []
    lo = 0
    for i in range(1, len(sorted_contexts)):
        if i - lo >= min_group and sorted_contexts[i] + 1 > 2 * (sorted_contexts[lo] + 1):
            bounds.append((lo, i))
            lo = i
    if sorted_contexts:
        bounds.append((lo, len(sorted_contexts)))
    return bounds


def padded_decode_tokens(contexts: Sequence[int]) -> int:
    """Key positions the grouped backend attends for decodes of these contexts (each
    attends its group's longest context plus its own new token)."""
    ordered = sorted(contexts)
    return sum((hi - lo) * (ordered[hi - 1] + 1) for lo, hi in decode_group_bounds(ordered))
