"""The n-gram (prompt lookup) proposer: a sequence's next tokens guessed from its own
tokens. The longest suffix of the sequence (between `min_n` and `max_n` tokens) that also
occurs earlier in it is its match; the tokens that followed the match's most recent
earlier occurrence are the draft.

    token_ids:  ... a b c X Y Z ... a b c        suffix "a b c" (n = 3) seen before
                        ^^^^^ ^^^^^                   -> draft "X Y Z ..." (up to k tokens)

The search is vectorised over the sequence: one comparison finds every earlier position
of the last token, then each further step back keeps the candidates whose preceding token
still agrees (at most `max_n` array passes, never a Python loop over the history).
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and num_tokens >= 1, got {min_n}, {max_n}, {num_tokens}")
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(num_tokens, max_tokens) draft tokens for the sequence `token_ids`, or
        [] when no suffix of at least `min_n` tokens occurred earlier."""
        limit = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        num = len(token_ids)
        if limit <= 0 or num <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # ends[c]: the index just past candidate c's occurrence of the last token; its
        # continuation starts there. The sequence's own last token is not a candidate.
        ends = np.flatnonzero(arr[: num - 1] == arr[num - 1]) + 1
        if ends.size == 0:
            return []
        lengths = np.ones(ends.size, dtype=np.int64)  # how far back each candidate agrees
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, num - 1)):
            before = ends - 1 - back  # the candidate's token `back` places before its last
            alive &= before >= 0
            alive[alive] = arr[before[alive]] == arr[num - 1 - back]
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        if best < self.min_n:
            return []
        # The most recent of the longest matches: its continuation is the freshest guess.
        end = int(ends[np.flatnonzero(lengths == best)[-1]])
        return arr[end : end + limit].tolist()
