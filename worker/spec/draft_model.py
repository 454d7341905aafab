"""The draft-model proposer: a small causal LM sharing the target's tokenizer proposes k
tokens greedily, from a contiguous KV cache of its own per request (transformers'
DynamicCache), kept between steps and cut back to what was verified.

    cache holds:  t0 .. t(m-1)              (tokens it has seen, drafts included)
    sequence now: t0 .. t(n-1)              (verified: the target's tokens)
    keep the common prefix p of the two (drafts the target rejected differ from there),
    feed t(p) .. t(n-1), then draft greedily k times, one forward per draft

Greedy drafting makes the draft distribution q a point mass on each draft, so the
verifier's point-mass rule (accept x with p(x), else sample p without x) is the exact
rejection sampling for it (worker/spec/rejection.py). Caches are kept for the most
recently drafted requests only (a bound, not a leak): a request whose cache was dropped
re-feeds its tokens once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.sequence import Sequence


class DraftModelProposer:
    def __init__(self, path: str, num_tokens: int, max_cached: int = 256) -> None:
        import torch  # torch and transformers: only an engine with a draft model loads them
        from transformers import AutoModelForCausalLM  # (as torch, above)

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_tokens = num_tokens
        self.max_cached = max_cached
        # request id -> (its sequence, its DynamicCache, n, drafts fed): the cache holds the
        # sequence's first n tokens (verified when it drafted), then the drafts fed after them.
        # The sequence object tells a request id reused by a later request apart.
        self._caches: OrderedDict[str, tuple[Sequence, Any, int, list[int]]] = OrderedDict()

    def propose_for(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(num_tokens, max_tokens) greedy drafts after seq.token_ids."""
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0:
            return []
        with self.torch.inference_mode():
            cache, fed = self._catch_up(seq)
            logits = self._forward(fed, cache)
            drafts: list[int] = []
            while True:  # one forward per draft: drafting is autoregressive
                drafts.append(int(logits.argmax()))
                if len(drafts) == limit:
                    break
                logits = self._forward([drafts[-1]], cache)
        # The cache holds the sequence and every draft but the last (never fed).
        self._caches[seq.request_id] = (seq, cache, len(seq.token_ids), drafts[:-1])
        while len(self._caches) > self.max_cached:
            self._caches.popitem(last=False)
        return drafts

    def _catch_up(self, seq: Sequence) -> tuple[Any, list[int]]:
        """The request's cache cut back to the prefix it shares with the sequence (at most
        all but its last token), and the tokens still to feed."""
        from transformers import DynamicCache  # transformers: with the model, above

        tokens = seq.token_ids
        entry = self._caches.pop(seq.request_id, None)
        if entry is None or entry[0] is not seq:
            return DynamicCache(), list(tokens)
        _, cache, base, fed = entry
        # Tokens never change once verified: only the drafts fed after them can differ.
        common = base
        for draft, token in zip(fed, tokens[base:]):  # at most k - 1
            if draft != token:
                break
            common += 1
        common = min(common, len(tokens) - 1)
        surplus = cache.get_seq_length() - common
        if surplus > 0:  # transformers crops by a negative count: the tokens to drop
            cache.crop(-surplus)
        return cache, tokens[common:]

    def _forward(self, token_ids: list[int], cache: Any) -> Any:
        """The next-token logits after feeding `token_ids` into `cache`."""
        ids = self.torch.tensor([token_ids], dtype=self.torch.long)
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0, -1]
