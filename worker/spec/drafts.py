"""The scheduler's side of speculative decoding: which decode rows carry draft tokens, how
many, and the KV blocks their lookahead needs (check, then act: a lookahead that does not
fit shrinks to what the table holds, or the row decodes plainly; lookahead never preempts).

A decode row of sequence s at num_computed_tokens = c with drafts d1..dk:

    inputs     token_ids[c]  d1    d2   ...  dk          (1 + k query tokens, positions c..c+k)
    logits at  c             c+1   c+2  ...  c+k         (k + 1 verify positions)
    blocks     enough for c + 1 + k tokens

Draft tokens live in the plan (`SchedulerOutput.draft_token_ids`), never in token_ids:
prefix-cache block hashes are computed from token_ids, so only verified tokens may enter.
"""
from __future__ import annotations

from typing import Protocol

from kv.cache_manager import KVCacheManager
from worker.config import SpeculativeConfig
from worker.sampling.thinking import DONE as THINKING_DONE
from worker.sequence import Sequence
from worker.spec.draft_model import DraftModelProposer
from worker.spec.ngram import NgramProposer
from worker.spec.stats import SpecCounters


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` ([] for none)."""
        ...


def eligible(seq: Sequence) -> bool:
    """Whether a decode of `seq` may speculate: its next tokens' distributions must not
    depend on the tokens before them beyond the model's logits (no penalties, no grammar,
    no min_tokens still banning EOS, no thinking budget still counting: it may force the
    end marker at any position) and it asked for no logprobs or logit bias."""
    p = seq.params
    return (seq.grammar is None and p.logprobs is None and not p.needs_penalties and not p.logit_bias
            and seq.num_output_tokens >= p.min_tokens
            and (seq.thinking is None or seq.thinking.phase == THINKING_DONE))


class Speculator:
    """Proposes drafts for the scheduler's decode rows and counts them."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = NgramProposer(config.num_tokens, config.ngram_min, config.ngram_max)
        self.draft_model: DraftModelProposer | None = None
        if config.method == "draft_model":
            assert config.draft_model is not None
            self.draft_model = DraftModelProposer(config.draft_model, config.num_tokens)
        self.counters = SpecCounters()

    def plan(self, seq: Sequence, budget: int, kv: KVCacheManager) -> tuple[list[int], list[int]] | None:
        """Drafts for the decode row of `seq` (one token left to compute) within `budget`
        tokens, and its block table grown to hold them; None: the row decodes plainly."""
        if not eligible(seq):
            return None
        num_tokens = len(seq.token_ids)
        # A row yields at most k + 1 tokens: never past max_tokens or the model's length.
        limit = min(budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - num_tokens - 1)
        if limit <= 0:
            return None
        if self.draft_model is not None:
            drafts = self.draft_model.propose_for(seq, limit)
        else:
            drafts = self.proposer.propose(seq.token_ids, limit)
        if not drafts:
            return None
        rid, computed = seq.request_id, seq.num_computed_tokens
        total = computed + 1 + len(drafts)
        block_ids = kv.held_block_ids(rid, total)
        if block_ids is None:
            if kv.can_allocate(rid, total):
                block_ids = kv.allocate(rid, total)
            else:  # only what the table holds already: lookahead never takes a free block it must fight for
                held = len(kv.block_ids(rid)) * kv.block_size - computed - 1
                if held <= 0:
                    return None
                drafts = drafts[:held]
                block_ids = kv.held_block_ids(rid, computed + 1 + len(drafts))
                assert block_ids is not None
        return drafts, block_ids
