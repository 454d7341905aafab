"""Requests whose grammar is still compiling: they wait here, outside the scheduler, in
arrival order, until the compile is done or the compiler's timeout has passed (the
grammar's state decides which; a failed or late compile fails the request)."""
from __future__ import annotations

import time
from concurrent.futures import Future

from worker.sequence import Sequence
from worker.structured.compiler import GrammarCompiler
from worker.structured.state import GrammarState


class CompileWaits:
    def __init__(self) -> None:
        self.compiler: GrammarCompiler | None = None  # None: no tokenizer, no structured outputs
        self.seqs: list[Sequence] = []

    def submit(self, seq: Sequence) -> bool:
        """Start `seq`'s grammar compile and hold it here; False if it needs none."""
        if seq.params.structured is None or self.compiler is None:
            return False
        deadline = time.monotonic() + self.compiler.compile_timeout_s
        # Output the grammar has not seen yet: a resumed request's last prompt tokens (its
        # earlier output), and a disaggregated decode's first token (sampled by the prefill
        # replica, already in token_ids). The grammar replays them before the first mask.
        replay = tuple(seq.token_ids[seq.num_prompt_tokens - seq.num_resumed_tokens :])
        seq.grammar = GrammarState(self.compiler.submit(seq.params.structured), deadline, replay)
        self.seqs.append(seq)
        return True

    def take_compiled(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The sequences whose compile ended, in arrival order: those ready to run, and
        those failed with the reason; the rest keep waiting."""
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        still: list[Sequence] = []
        for seq in self.seqs:
            if not seq.grammar.ready:
                still.append(seq)
                continue
            error = seq.grammar.start()
            if error is None:
                ready.append(seq)
            else:
                failed.append((seq, error))
        self.seqs = still
        return ready, failed

    def remove(self, seq: Sequence) -> bool:
        """Drop a waiting sequence (aborted); False if it was not waiting here."""
        if seq not in self.seqs:
            return False
        self.seqs.remove(seq)
        return True

    def futures(self) -> list[Future]:
        return [seq.grammar.future for seq in self.seqs]
