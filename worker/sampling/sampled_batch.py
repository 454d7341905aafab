"""One step's samples between the device and the host: the ids stay on the device (a step
launched ahead reads its inputs there, worker/scheduling/async_scheduler.py) and their copies to pinned
host memory are queued behind the sampling, so that `result` is the step's one sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.api import TokenLogprob
from worker.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None when that request did not ask



class SampledBatch:
    """One step's samples: `token_ids` on the device, and their host copies (with the
    logprobs), queued behind the sampling when it was launched, so that work queued later
    (a step launched ahead) does not delay reading them. `result` is the one host sync."""

    def __init__(self, token_ids: torch.Tensor, ids: torch.Tensor, values: torch.Tensor | None,
                 seqs: list[Sequence], logprob_rows: list[int]) -> None:
        self.token_ids = token_ids
        self._seqs, self._rows = seqs, logprob_rows
        self._ids = _copy_to_host(ids)
        self._values = _copy_to_host(values) if values is not None else None
        self._done: torch.cuda.Event | None = None
        if token_ids.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> SamplerOutput:
        if self._done is not None:
            self._done.synchronize()
        seqs, rows = self._seqs, self._rows
        num_rows = len(seqs)
        ids_host = self._ids.tolist()
        token_ids = ids_host[:num_rows]
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if self._values is None:
            return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
        values_host = self._values.tolist()
        top_ids_host = ids_host[num_rows:]
        width = len(values_host[0]) - 1
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            row_values = values_host[j]
            row_ids = top_ids_host[j * width : j * width + n]
            logprobs[i] = TokenLogprob(
                token_id=token_ids[i],
                logprob=row_values[0],
                top=tuple(zip(row_ids, row_values[1 : 1 + n])),
            )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into pinned host memory, queued on the stream (no sync)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
