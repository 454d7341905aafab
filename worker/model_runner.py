"""Executes a scheduler plan as ONE flat token batch and samples the next tokens.

Per step: build the flat inputs (token ids, positions, KV slots, attention metadata) with
a handful of tensor ops, run the model over every token, compute logits only for the
last token of each sequence that samples, and sample the whole batch at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kv.kv_cache import KVCacheSpec, allocate_kv_cache, gpu_kv_budget, num_blocks_for_budget
from worker.attention import AttentionMetadata, DecodeGroup, PrefillInfo, select_backend
from worker.config import EngineConfig
from worker.model.llama import LlamaArch
from worker.model.loader import load_model, resolve_model_path
from worker.model.parallel import SINGLE, TPContext, kv_head_range
from worker.outputs import TokenLogprob
from worker.sampler import Sampler
from worker.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunnerOutput:
    token_ids: list[int | None]  # aligned with plan.seqs; None where the seq did not sample
    logprobs: list[TokenLogprob | None]
    forward_s: float  # time in the model forward + logits (for the overhead figure)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU: fp32 (bf16 matmuls are slow on most CPUs); GPU: bf16.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} ({', '.join(_DTYPES)}, auto)")
    return _DTYPES[name]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: object, max_model_len: int, tp: TPContext = SINGLE
    ) -> None:
        """Under tensor parallelism every rank builds one of these (its shard of the model and
        a KV cache of its own kv heads); only rank 0 samples."""
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if config.model.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        self.arch = LlamaArch.from_hf_config(hf_config)
        self.block_size = config.cache.block_size
        self.backend = select_backend(config.model.attention_backend, self.device)
        path = resolve_model_path(config.model.model)
        self.model = load_model(path, hf_config, self.backend, max_model_len, self.dtype, self.device, tp)
        kv_lo, kv_hi = kv_head_range(self.arch.num_heads, self.arch.num_kv_heads, tp)
        self.spec = KVCacheSpec(
            num_layers=self.arch.num_layers,
            num_kv_heads=kv_hi - kv_lo,
            head_dim=self.arch.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        self.num_blocks = self._num_blocks()
        self.kv_caches = allocate_kv_cache(self.spec, self.num_blocks, self.device)
        self.sampler = Sampler(self.arch.vocab_size, self.device) if tp.rank == 0 else None

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            budget = gpu_kv_budget(self.device, cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_bytes
        return num_blocks_for_budget(self.spec, budget)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        # Decodes (1 query token) first, shortest context first (see _decode_group_bounds).
        num_new, seqs = plan.num_new_tokens, plan.seqs
        order = sorted(
            range(len(seqs)),
            key=lambda i: (num_new[i] != 1, seqs[i].num_computed_tokens if num_new[i] == 1 else 0),
        )
        input_ids, positions, meta, last_token_idx, sample_rows = self._prepare(plan, order)
        start = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        token_ids: list[int | None] = [None] * len(plan.seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(plan.seqs)
        if sample_rows:
            logits = self.model.compute_logits(hidden[last_token_idx])
            forward_s = time.perf_counter() - start
            if self.sampler is None:  # a TP rank other than 0: it only joined the collectives
                return RunnerOutput(token_ids, logprobs, forward_s)
            sampled = self.sampler(logits, [plan.seqs[i] for i in sample_rows])
            for row, i in enumerate(sample_rows):
                token_ids[i] = sampled.token_ids[row]
                logprobs[i] = sampled.logprobs[row]
        else:
            forward_s = time.perf_counter() - start
        return RunnerOutput(token_ids, logprobs, forward_s)

    def _prepare(
        self, plan: SchedulerOutput, order: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        bs = self.block_size
        seqs, num_new = plan.seqs, plan.num_new_tokens
        flat_ids: list[int] = []
        starts: list[int] = []  # first position computed this step, per seq (in `order`)
        lens: list[int] = []
        tables: list[list[int]] = []
        for i in order:
            seq, n = seqs[i], num_new[i]
            c = seq.num_computed_tokens
            flat_ids.extend(seq.token_ids[c : c + n])
            starts.append(c)
            lens.append(n)
            tables.append(plan.block_ids[i])
        num_seqs = len(order)
        max_blocks = max(len(t) for t in tables)
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
        for row, t in enumerate(tables):
            table[row, : len(t)] = torch.tensor(t, dtype=torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        query_start = torch.cumsum(lens_t, 0) - lens_t
        # position of flat token j = starts[seq(j)] + (j - query_start[seq(j)])
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens_t)
        positions = torch.arange(len(flat_ids)) + (starts_t - query_start)[seq_of_token]
        slots = table[seq_of_token, positions // bs] * bs + positions % bs
        context_lens = starts_t + lens_t

        num_decodes = sum(1 for n in lens if n == 1)
        dev = self.device
        groups = []
        for lo, hi in _decode_group_bounds(starts[:num_decodes]):
            max_ctx = starts[hi - 1] + 1  # sorted ascending: the last is the longest
            groups.append(
                DecodeGroup(
                    lo, hi,
                    table[lo:hi, : -(-max_ctx // bs)].to(dev, non_blocking=True),
                    context_lens[lo:hi].to(dev, non_blocking=True),
                    max_ctx,
                )
            )
        prefills = []
        qs = query_start.tolist()
        for row in range(num_decodes, num_seqs):
            ctx = starts[row] + lens[row]
            prefills.append(
                PrefillInfo(qs[row], lens[row], ctx, table[row, : -(-ctx // bs)].to(dev, non_blocking=True))
            )
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            num_decode_tokens=num_decodes,
            decode_groups=groups,
            prefills=prefills,
        )
        if self.backend.name == "flash":
            cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(lens_t, 0)
            meta.cu_seqlens_q = cu.to(dev, non_blocking=True)
            meta.seqused_k = context_lens.to(torch.int32).to(dev, non_blocking=True)
            meta.block_table = table.to(torch.int32).to(dev, non_blocking=True)
            meta.max_query_len = max(lens)
            meta.max_context_len = int(context_lens.max())
        # Sample where a seq reaches its last token; its logits come from that token.
        sample_rows: list[int] = []
        last_idx: list[int] = []
        for row, i in enumerate(order):
            if starts[row] + lens[row] == seqs[i].num_tokens:
                sample_rows.append(i)
                last_idx.append(qs[row] + lens[row] - 1)
        input_ids = torch.tensor(flat_ids, dtype=torch.long).to(dev, non_blocking=True)
        return (
            input_ids,
            positions.to(dev, non_blocking=True),
            meta,
            torch.tensor(last_idx, dtype=torch.long).to(dev, non_blocking=True),
            sample_rows,
        )


def _decode_group_bounds(sorted_starts: list[int], min_group: int = 8) -> list[tuple[int, int]]:
    """Split decodes (sorted by context length) into groups attended in one call each.
    A group pads every member to its longest context, so a new group starts when the
    context has doubled since the group's first member (padding waste < 2x), provided the
    group already has `min_group` members (each call has a fixed cost too)."""
    bounds = []
    lo = 0
    for i in range(1, len(sorted_starts)):
        if i - lo >= min_group and sorted_starts[i] + 1 > 2 * (sorted_starts[lo] + 1):
            bounds.append((lo, i))
            lo = i
    if sorted_starts:
        bounds.append((lo, len(sorted_starts)))
    return bounds
