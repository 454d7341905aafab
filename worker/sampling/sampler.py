"""Turns one step's logits into next tokens for the whole batch at once.

Pipeline (each stage runs only when some row in the batch needs it):

    raw logits (B, V) ──────────────────────────────────────────────┐ (logprobs read these)
      │ repetition / presence / frequency penalties  (rows that ask) │
      │ logit_bias: one index_put_ for the batch      (rows that ask) │
      │ min_tokens: ban EOS + stop token ids          (rows that ask) │
      │ grammar bitmask                               (rows that ask) │
      │ thinking budget spent: only the forced token  (rows forced)   │
      ├─> greedy rows: argmax                                         │
      └─> random rows: / temperature → min_p → top_k / top_p          │
                       → exponential race (Gumbel-max) with noise     │
                         from the row's own generator if seeded       │
    sampled ids (+ logprobs) ── copied to pinned host memory, queued ─┘
    SampledBatch.result: wait for that copy (the one host<->device sync), read it

Sync discipline: control flow is decided from Python-side `SamplingParams`, never from
tensor values, and every index tensor is built on the host and copied with
`non_blocking=True` from pinned memory. So a step has exactly one sync, logprobs or not:
the event recorded after its copies to the host. The sampled ids also stay on the device,
where a step launched ahead (worker/scheduling/async_scheduler.py) takes its input tokens from them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as SequenceT

import numpy as np
import torch

from worker.api import SamplingParams
from worker.sequence import Sequence
from worker.sampling.sampled_batch import SampledBatch, SamplerOutput
from worker.structured.bitmask import apply_bitmask, compute_bitmask


def argmax_only(seqs: SequenceT[Sequence]) -> bool:
    """Whether sampling these rows is a plain argmax of their logits: greedy, no penalty,
    bias, token ban (min_tokens), grammar, logprobs or token forced by a spent thinking budget. Such a batch may take its logits in
    the model dtype: the fp32 upcast is exact, so its argmax is the same index."""
    for seq in seqs:
        p = seq.params
        if (not p.greedy or p.needs_penalties or p.logit_bias or p.logprobs is not None
                or seq.num_output_tokens < p.min_tokens or seq.grammar is not None
                or (seq.thinking is not None and seq.thinking.forced_token() is not None)):
            return False
    return True


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    # ------------------------------------------------------------------ entry point

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], bitmask: np.ndarray | None = None
    ) -> SamplerOutput:
        """`bitmask`: the constrained rows' token bitmask, when the runner computed it
        during the forward (worker/structured/bitmask.py); computed here otherwise."""
        return self.launch(logits, seqs, bitmask).result()

    def launch(
        self, logits: torch.Tensor, seqs: list[Sequence], bitmask: np.ndarray | None = None
    ) -> SampledBatch:
        """The sampling queued on the device, its copies to the host queued behind it; no
        host sync. A step launched ahead (worker/scheduling/async_scheduler.py) takes its inputs from
        the result's device tensor before the host reads it."""
        num_rows = len(seqs)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits must be ({num_rows}, V), got {tuple(logits.shape)}")
        # The lm_head may be padded past the tokenizer's vocabulary (TP-friendly sizes);
        # padded columns are never valid tokens.
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        if logits.dtype != torch.float32 and not (bitmask is None and argmax_only(seqs)):
            logits = logits.float()
        params = [seq.params for seq in seqs]

        # `raw` stays untouched for logprobs; every stage below writes a new tensor
        # before working in place, so the caller's buffer is never modified.
        raw = logits
        work = logits

        penalty_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalty_rows:
            work = self._apply_penalties(work, seqs, penalty_rows)

        if any(p.logit_bias for p in params):
            work = self._apply_logit_bias(work, raw, seqs)

        work = self._apply_min_tokens(work, raw, seqs)
        if bitmask is None and any(s.grammar is not None for s in seqs):
            bitmask = compute_bitmask(seqs, self.vocab_size, parallel=self.device.type != "cpu")
        if bitmask is not None:  # structured outputs: one masked_fill for the batch
            work = apply_bitmask(work, bitmask)
        if any(s.thinking is not None for s in seqs):
            work = self._apply_forced(work, raw, seqs)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            sampled = work.argmax(dim=-1)
        elif len(random_rows) == num_rows:
            sampled = self._sample_random(work, seqs)
        else:
            # Mixed batch: argmax everywhere (cheap), then overwrite the random rows.
            sampled = work.argmax(dim=-1)
            index = self._to_device(random_rows, torch.long)
            sub = work.index_select(0, index)
            sampled.index_copy_(0, index, self._sample_random(sub, [seqs[i] for i in random_rows]))

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not logprob_rows:
            return SampledBatch(sampled, sampled, None, seqs, logprob_rows)
        ids, values = self._logprob_tensors(raw, sampled, seqs, logprob_rows)
        return SampledBatch(sampled, ids, values, seqs, logprob_rows)

    # ------------------------------------------------------------------ helpers

    def _to_device(self, data: SequenceT, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor without a sync.

        A plain `torch.tensor(data, device=cuda)` copies from pageable memory with a
        blocking copy, which waits for the stream: a hidden sync. Pinned memory plus
        `non_blocking=True` queues the copy behind the work already on the stream.
        """
        cpu = torch.tensor(data, dtype=dtype)
        if self.device.type == "cpu":
            return cpu
        return cpu.pin_memory().to(self.device, non_blocking=True)

    def _pad(self, rows: list[list[int]], pad: int) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        # Width 0 still needs one column so that scatter has a valid (all-pad) index.
        width = max(width, 1)
        return self._to_device([r + [pad] * (width - len(r)) for r in rows], torch.long)

    # ------------------------------------------------------------------ penalties

    def _apply_penalties(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        """Repetition (HF), presence and frequency (OpenAI) penalties on `rows`.

        Counts are built on a (R, V + 1) tensor: padding points at the extra column V,
        so ragged token lists become one scatter_add, and the pad column is dropped.
        """
        vocab = logits.shape[1]
        sub_seqs = [seqs[i] for i in rows]
        num_sub = len(rows)
        # One copy for the three per-row scalars: columns repetition, frequency, presence.
        scalars = self._to_device(
            [
                [s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                for s in sub_seqs
            ],
            torch.float32,
        )
        rep, freq, pres = scalars[:, 0:1], scalars[:, 1:2], scalars[:, 2:3]

        # Ids outside [0, vocab) (a model whose tokenizer has more ids than the lm_head
        # keeps) go to the pad column instead of faulting the scatter on the device.
        out_ids = self._pad([s.output_token_ids for s in sub_seqs], vocab).clamp_(0, vocab)
        counts = torch.zeros((num_sub, vocab + 1), dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        generated = counts > 0

        index = self._to_device(rows, torch.long)
        sub = logits.index_select(0, index)  # a copy: the caller's logits stay intact

        if any(s.params.repetition_penalty != 1.0 for s in sub_seqs):
            prompt_ids = self._pad(
                [s.token_ids[: s.num_prompt_tokens] for s in sub_seqs], vocab
            ).clamp_(0, vocab)
            seen = torch.zeros((num_sub, vocab + 1), dtype=torch.bool, device=logits.device)
            seen.scatter_(1, prompt_ids, True)
            seen = seen[:, :vocab] | generated
            # HF semantics: a seen token's positive logit is divided by the penalty and a
            # negative one multiplied, so penalty > 1 always makes it less likely. Rows
            # with penalty 1 pass through unchanged.
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(s.params.frequency_penalty or s.params.presence_penalty for s in sub_seqs):
            # OpenAI semantics: only generated tokens count.
            sub = sub - counts * freq - generated.to(sub.dtype) * pres

        if num_sub == logits.shape[0]:
            return sub  # every row: `rows` is 0..B-1 in order
        out = logits.clone()
        out.index_copy_(0, index, sub)
        return out

    def _apply_logit_bias(
        self, logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence]
    ) -> torch.Tensor:
        """OpenAI's logit_bias: every (row, token, bias) of the batch added in one
        index_put_. Ids past the lm_head's vocabulary are skipped (the ingress rejects
        ids past the tokenizer's)."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            for token_id, bias in seq.params.logit_bias:
                if token_id < vocab:
                    rows.append(i)
                    cols.append(token_id)
                    values.append(float(bias))
        if not rows:
            return logits
        if logits is raw:
            logits = logits.clone()  # `raw` stays as it was for logprobs
        logits.index_put_(
            (self._to_device(rows, torch.long), self._to_device(cols, torch.long)),
            self._to_device(values, logits.dtype),
            accumulate=True,
        )
        return logits

    def _apply_min_tokens(
        self, logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence]
    ) -> torch.Tensor:
        """Until a request has `min_tokens` outputs, it may not pick EOS or a stop token."""
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(seq.eos_token_ids)
            for token_id in banned:
                if token_id < vocab:  # an out-of-vocab stop id can never be sampled anyway
                    ban_rows.append(i)
                    ban_cols.append(token_id)
        if not ban_rows:
            return logits
        if logits is raw:
            logits = logits.clone()
        logits.index_put_(
            (self._to_device(ban_rows, torch.long), self._to_device(ban_cols, torch.long)),
            # new_full fills on the device; torch.tensor(..., device=cuda) would be a
            # blocking host->device copy, i.e. a hidden sync.
            logits.new_full((len(ban_rows),), -math.inf),
        )
        return logits

    def _apply_forced(
        self, logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence]
    ) -> torch.Tensor:
        """Rows whose thinking budget is spent (worker/sampling/thinking.py) may pick only
        their forced token: every other logit of those rows -inf, in two ops for the batch.
        Whatever the row's sampling, its one finite logit is what it samples."""
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            forced = seq.thinking.forced_token() if seq.thinking is not None else None
            if forced is not None:
                rows.append(i)
                cols.append(forced)
        if not rows:
            return logits
        if logits is raw:
            logits = logits.clone()
        index = self._to_device(rows, torch.long)
        logits.index_fill_(0, index, -math.inf)
        logits.index_put_((index, self._to_device(cols, torch.long)), logits.new_zeros((len(rows),)))
        return logits

    # ------------------------------------------------------------------ random sampling

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one token per row; every row here has temperature > 0 and top_k != 1."""
        params = [s.params for s in seqs]
        num_rows = len(seqs)
        x = self.filtered(logits, seqs)

        # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) samples from p. In log
        # space that is argmax_i x_i - log E_i (Gumbel-max), which needs no softmax.
        # Seeded rows draw their noise from their own generator, so the draw depends
        # only on the request's seed and how many steps it has sampled, never on which
        # other rows share the batch.
        noise = torch.empty_like(x)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < num_rows:
            noise.exponential_()  # one batch-level draw for the unseeded rows
        for i in seeded:
            noise[i].exponential_(generator=self._generator(seqs[i]))
        # Exp(1) can round to 0 in float32; log(0) = -inf would give +inf noise and
        # -inf + inf = NaN on a masked token, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_()
        return x.sub_(noise).argmax(dim=-1)

    def filtered(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The rows' logits as random sampling draws from them: divided by the temperature,
        then min_p, top_k and top_p cut (a new tensor). softmax of it is the distribution
        a row samples (speculative decoding's rejection sampling reads it, worker/spec/)."""
        params = [s.params for s in seqs]
        # Out of place: `logits` may be the caller's tensor.
        temps = self._to_device([[p.temperature] for p in params], torch.float32)
        x = logits / temps

        if any(p.min_p > 0.0 for p in params):
            # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed.
            # min_p = 0 gives log(0) = -inf, i.e. no cut for that row.
            log_min_p = self._to_device(
                [[math.log(p.min_p) if p.min_p > 0.0 else -math.inf] for p in params],
                torch.float32,
            )
            threshold = x.max(dim=-1, keepdim=True).values + log_min_p
            x.masked_fill_(x < threshold, -math.inf)

        vocab = x.shape[1]
        if any(p.top_p < 1.0 for p in params):
            x = self._apply_top_k_top_p(x, params, vocab)
        elif any(p.top_k > 0 for p in params):
            x = self._apply_top_k(x, params, vocab)
        return x

    def generator(self, seq: Sequence) -> torch.Generator:
        """The seeded request's own generator (made on its first draw)."""
        return self._generator(seq)

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = seq.sampler_state
        if not isinstance(generator, torch.Generator):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
            seq.sampler_state = generator
        return generator

    def _apply_top_k(
        self, x: torch.Tensor, params: list[SamplingParams], vocab: int
    ) -> torch.Tensor:
        """top_k alone: the k-th largest value is a threshold, so a partial topk over the
        largest k in the batch is enough (no full sort)."""
        enabled = [0 < p.top_k < vocab for p in params]
        ks = [p.top_k if on else 1 for p, on in zip(params, enabled)]
        max_k = max(k for k, on in zip(ks, enabled) if on) if any(enabled) else 1
        top_values = x.topk(max_k, dim=-1, sorted=True).values
        threshold = top_values.gather(1, self._to_device([[k - 1] for k in ks], torch.long))
        # Rows with top_k off get a -inf threshold: nothing is cut.
        off = self._to_device([[not on] for on in enabled], torch.bool)
        threshold.masked_fill_(off, -math.inf)
        # Ties at the threshold keep a few more than k tokens; that is harmless.
        return x.masked_fill_(x < threshold, -math.inf)

    def _apply_top_k_top_p(
        self, x: torch.Tensor, params: list[SamplingParams], vocab: int
    ) -> torch.Tensor:
        """top_k and top_p together on one descending sort."""
        sorted_x, order = x.sort(dim=-1, descending=True)
        if any(0 < p.top_k < vocab for p in params):
            # Same threshold rule as `_apply_top_k` (ties at the k-th value survive), so a
            # seeded request samples the same token whichever path its batch takes.
            ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            kth = sorted_x.gather(1, self._to_device([[k - 1] for k in ks], torch.long))
            sorted_x.masked_fill_(sorted_x < kth, -math.inf)
        # top_p = 1 rows get an unreachable bound: float rounding can push the cumulative
        # sum past 1.0 before the tail, which must not cut anything for them.
        top_p = self._to_device(
            [[p.top_p if p.top_p < 1.0 else 2.0] for p in params], torch.float32
        )
        probs = sorted_x.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first
        # token always survives (its preceding mass is 0).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_x.masked_fill_(mass_before >= top_p, -math.inf)
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    # ------------------------------------------------------------------ logprobs

    def _logprob_tensors(
        self,
        raw: torch.Tensor,
        sampled: torch.Tensor,
        seqs: list[Sequence],
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen-token and top-n logprobs from the raw logits, on the device: the ids (the
        sampled ids, then each row's top ids) and the values (per row: chosen, then top)."""
        if len(rows) == len(seqs):
            sub, chosen = raw, sampled.unsqueeze(1)
        else:
            index = self._to_device(rows, torch.long)
            sub, chosen = raw.index_select(0, index), sampled.index_select(0, index).unsqueeze(1)
        # log_softmax(x)_i = x_i - logsumexp(x): gather the few values needed first
        # instead of materialising a (R, V) log_softmax.
        lse = torch.logsumexp(sub, dim=-1, keepdim=True)
        chosen_logprob = sub.gather(1, chosen) - lse
        max_n = max(seqs[i].params.logprobs for i in rows)
        if max_n > 0:
            top_values, top_ids = sub.topk(min(max_n, sub.shape[1]), dim=-1)
            return torch.cat([sampled, top_ids.flatten()]), torch.cat([chosen_logprob, top_values - lse], dim=1)
        return sampled, chosen_logprob
