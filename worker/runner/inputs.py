"""A step's flat inputs: the host batch a plan becomes (token ids, positions, slots, block
tables, which rows sample) and the attention metadata the backends read, per KV group.

    flat tokens:  [ d0 d1 ... | p0 chunk ... | p1 chunk ... ]   decodes first, then prompt chunks
    position of flat token j = starts[seq(j)] + (j - query_start[seq(j)])
    slot of token j = table[seq(j), position // block_size] * block_size + position % block_size
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from worker.attention import AttentionMetadata, DecodeGroup, PrefillInfo
from worker.runner.batches import HostBatch
from worker.runner.block_table import PersistentBlockTable
from worker.runner.staging import InputStaging
from worker.runner.decode_groups import decode_group_bounds
from worker.runner.kv_group_binding import group_table_tensor
from worker.scheduling.plan import SchedulerOutput


def host_batch(plan: SchedulerOutput, order: list[int], block_size: int, num_groups: int,
               tables: PersistentBlockTable | None = None) -> HostBatch:
    """The step's flat inputs on the host, its rows in `order` (decodes first, by context).
    Given `tables` (one KV group), the block tables come from its persistent rows: slots
    read the host mirror and the step's table is a device gather (worker/runner/block_table.py)."""
    bs = block_size
    seqs, num_new = plan.seqs, plan.num_new_tokens
    flat_ids: list[int] = []
    starts: list[int] = []  # first position computed this step, per seq (in `order`)
    lens: list[int] = []
    rows_tables: list[list[int]] = []
    # Launched ahead, a row's one input token is not in token_ids yet (launch gathers it
    # on the device; 0 holds its place here), and the row samples one past token_ids.
    pending = int(plan.pending_inputs)
    # A verify row's inputs: its one uncomputed token, then its drafts (worker/spec/drafts.py).
    drafts_of = plan.draft_token_ids
    for i in order:
        seq, n = seqs[i], num_new[i]
        c = seq.num_computed_tokens
        flat_ids.extend(seq.token_ids[c : c + n] if not pending else (0,))
        if drafts_of and seq.request_id in drafts_of:
            flat_ids.extend(drafts_of[seq.request_id])
        starts.append(c)
        lens.append(n)
        if tables is None:
            rows_tables.append(plan.block_ids[i])
    num_seqs = len(order)
    slots_of_row = None
    if tables is not None:
        slots_of_row = tables.sync(plan, order)
        table = torch.from_numpy(tables.host)  # indexed by slot, not by row
    elif num_groups > 1:  # (groups, S, max_blocks): one table per KV group
        table = group_table_tensor(rows_tables, num_groups)  # type: ignore[arg-type]
    else:
        table = padded_table(rows_tables)  # type: ignore[arg-type]
    lens_t = torch.tensor(lens, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    query_start = torch.cumsum(lens_t, 0) - lens_t
    # position of flat token j = starts[seq(j)] + (j - query_start[seq(j)])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens_t)
    positions = torch.arange(len(flat_ids)) + (starts_t - query_start)[seq_of_token]
    table_row = seq_of_token if slots_of_row is None else torch.from_numpy(slots_of_row)[seq_of_token]
    slots = table[..., table_row, positions // bs].long() * bs + positions % bs  # (T,) or (groups, T)
    qs = query_start.tolist()
    # Sample where a seq reaches its last token; its logits come from that token.
    sample_rows: list[int] = []
    last_idx: list[int] = []
    draft_rows: list[tuple[int, int, int]] = []
    for row, i in enumerate(order):
        if starts[row] + lens[row] == seqs[i].num_tokens + pending:
            sample_rows.append(i)
            last_idx.append(qs[row] + lens[row] - 1)
        elif drafts_of and seqs[i].request_id in drafts_of:  # logits at each of its 1 + k tokens
            draft_rows.append((i, qs[row], lens[row] - 1))
    return HostBatch(
        input_ids=torch.tensor(flat_ids, dtype=torch.long),
        positions=positions,
        slot_mapping=slots,
        block_table=table if tables is None else None,
        device_table=tables.gather(slots_of_row) if tables is not None else None,
        context_lens=starts_t + lens_t,
        starts=starts,
        lens=lens,
        query_start=qs,
        num_decodes=sum(1 for n in lens if n == 1),
        sample_rows=sample_rows,
        last_token_idx=last_idx,
        draft_rows=draft_rows,
    )


def padded_table(tables: list[list[int]]) -> torch.Tensor:
    """(S, max_blocks) long, rows padded with block 0, filled in one masked assignment from
    the tables' concatenation: no padded Python list per row (at batch 256 with 1k-token
    contexts that was ~16k list elements built and converted every step)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    width = int(lens.max()) if len(tables) else 0
    out = np.zeros((len(tables), width), dtype=np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = flat
    return torch.from_numpy(out)


def attention_metadata(batch: HostBatch, block_size: int, num_groups: int, device: torch.device,
                       varlen: bool) -> AttentionMetadata:
    """The attention metadata on the device; with several KV groups, group 0's, listing
    every group's in `groups` (worker/runner/kv_group_binding.py)."""
    if num_groups == 1:
        return _group_metadata(batch, batch.block_table, batch.slot_mapping, block_size, device, varlen)
    metas = [_group_metadata(batch, batch.block_table[g], batch.slot_mapping[g], block_size, device, varlen)
             for g in range(num_groups)]
    metas[0].groups = metas
    return metas[0]


def _group_metadata(batch: HostBatch, table: torch.Tensor | None, slot_mapping: torch.Tensor, block_size: int,
                    device: torch.device, varlen: bool) -> AttentionMetadata:
    """One group's metadata: decode groups and prefill infos for the torch backend, the
    varlen fields for the flash and triton backends."""
    bs, dev = block_size, device
    starts, lens, context_lens = batch.starts, batch.lens, batch.context_lens
    num_decodes = batch.num_decodes
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(dev, non_blocking=True), num_decode_tokens=num_decodes
    )
    if varlen:
        lens_t = torch.tensor(lens, dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens_t, 0)
        meta.cu_seqlens_q = cu.to(dev, non_blocking=True)
        meta.seqused_k = context_lens.to(torch.int32).to(dev, non_blocking=True)
        meta.block_table = (batch.device_table if batch.device_table is not None
                            else table.to(torch.int32).to(dev, non_blocking=True))
        meta.max_query_len = max(lens)
        meta.max_context_len = int(context_lens.max())
        return meta
    for lo, hi in decode_group_bounds(starts[:num_decodes]):
        max_ctx = starts[hi - 1] + 1  # sorted ascending: the last is the longest
        meta.decode_groups.append(
            DecodeGroup(
                lo, hi,
                table[lo:hi, : -(-max_ctx // bs)].to(dev, non_blocking=True),
                context_lens[lo:hi].to(dev, non_blocking=True),
                max_ctx,
            )
        )
    for row in range(num_decodes, len(lens)):
        ctx = starts[row] + lens[row]
        meta.prefills.append(
            PrefillInfo(batch.query_start[row], lens[row], ctx, table[row, : -(-ctx // bs)].to(dev, non_blocking=True))
        )
    return meta


@dataclass
class DeviceInputs:
    """A one-group varlen step's inputs on the device, staged in one copy per dtype
    (worker/runner/staging.py)."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    last_token_idx: torch.Tensor  # (R,) long: the flat token each sampling row reads
    context_lens: torch.Tensor  # (S,) int32
    meta: AttentionMetadata


def staged_inputs(batch: HostBatch, staging: InputStaging) -> DeviceInputs:
    """The step's ids, positions, slots, sampling rows and varlen lengths in one pinned
    copy per dtype; the block table is the persistent tables' device gather. Input ids
    already on the device (a step launched ahead) are not copied again."""
    assert batch.device_table is not None, "staged inputs read the persistent block table"
    lens = torch.tensor(batch.lens, dtype=torch.int32)
    cu = torch.zeros(len(batch.lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu[1:])
    on_host = batch.input_ids.device.type == "cpu"
    longs = [batch.positions, batch.slot_mapping, torch.tensor(batch.last_token_idx, dtype=torch.long)]
    parts = longs + [cu, batch.context_lens.to(torch.int32)] + ([batch.input_ids] if on_host else [])
    up = staging.upload(parts)
    positions, slots, last_idx, cu_dev, ctx_dev = up[:5]
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=batch.num_decodes, cu_seqlens_q=cu_dev, seqused_k=ctx_dev,
        block_table=batch.device_table, max_query_len=max(batch.lens),
        max_context_len=int(batch.context_lens.max()),
    )
    return DeviceInputs(up[5] if on_host else batch.input_ids, positions, last_idx, ctx_dev, meta)
