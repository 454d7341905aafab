"""The per-step plan, as rank 0 sends it to the other tensor-parallel ranks.

Compact and pickle-free: one flat int64 tensor, broadcast (length first, then payload)
over the group's CPU (gloo) process group. Rank 0 keeps what each rank already knows
about a request, so a running request costs a few ints per step (a diff), and only a new
(or preempted, then re-admitted) request carries its whole token list.

    payload = [op, num_dropped, num_entries, dropped keys..., entries..., num_lora_loads, loads...]
    entry   = [key, num_computed, num_new, tokens_from, num_tokens_sent, blocks_from,
               num_blocks_sent, lora_slot, token ids (num_tokens_sent)..., block ids (num_blocks_sent)...]
    load    = [slot, num_name_bytes, the adapter name's UTF-8 bytes...]

A receiving rank sets  tokens[key] = tokens[key][:tokens_from] + sent tokens  (same for
blocks), so tokens_from = blocks_from = 0 means "in full". A model with several KV groups
(kv/kv_groups.py) has one table per group, all one length; they travel position-major,

    flat = [g0[0], g1[0], ..., g0[1], g1[1], ...]      (num_groups ids per position)

so the flat list, too, only grows at its end while a request runs. Sliding groups replace
released entries with the null block on rank 0; the other ranks may keep the old id there:
such a position lies behind every query's window, masked, never read or written. `lora_slot` is the device slot
of the request's LoRA adapter (-1: the base model); a load names the adapter every rank
writes into that slot before the step runs (each rank holds the adapter in host memory
already: worker/tp/runner.py reads it on every rank before the request is admitted).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.scheduling.scheduler import SchedulerOutput
from worker.sequence import Sequence, SequenceStatus

OP_STEP = 1
OP_STOP = 2
# Disaggregation (worker/tp/kv_exchange.py): move the KV of these blocks to / from rank 0.
OP_EXPORT_KV = 3
OP_IMPORT_KV = 4
_HEADER = 3
_ENTRY = 8


@dataclass
class _Sent:
    key: int
    seq: Sequence
    num_tokens: int = 0
    num_blocks: int = 0
    last_block: int = -1
    num_preemptions: int = 0


@dataclass(frozen=True)
class KVOp:
    """A KV exchange every rank joins: `op` OP_EXPORT_KV or OP_IMPORT_KV, on these blocks."""

    op: int
    block_ids: list[int]


def kv_message(op: int, block_ids: list[int]) -> torch.Tensor:
    """[op, num_blocks, 0, block ids...] (the plan header's shape)."""
    return torch.tensor([op, len(block_ids), 0, *block_ids], dtype=torch.long)


class PlanEncoder:
    """Rank 0 side: SchedulerOutput -> int64 tensor."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._next_key = 0

    @property
    def num_known(self) -> int:
        return len(self._sent)

    def encode(self, plan: SchedulerOutput) -> torch.Tensor:
        dropped: list[int] = []
        # Forget requests that ended or were preempted (their blocks are gone); O(running).
        for request_id, sent in list(self._sent.items()):
            if sent.seq.status is not SequenceStatus.RUNNING:
                dropped.append(sent.key)
                del self._sent[request_id]
        body: list[int] = []
        for seq, num_new, table in zip(plan.seqs, plan.num_new_tokens, plan.block_ids):
            block_ids = _FlatTable(table)
            sent = self._sent.get(seq.request_id)
            if sent is not None and sent.seq is not seq:  # request id reused
                dropped.append(sent.key)
                sent = None
            if sent is None:
                sent = _Sent(self._next_key, seq)
                self._next_key += 1
                self._sent[seq.request_id] = sent
            tokens_from = sent.num_tokens
            new_tokens = seq.token_ids[tokens_from:]
            blocks_from = sent.num_blocks
            # A block table only grows while a request runs; check its last known entry.
            # (A preemption frees them all, even when the empty plan of that step was never sent.)
            if blocks_from and (
                seq.num_preemptions != sent.num_preemptions
                or len(block_ids) < blocks_from
                or block_ids[blocks_from - 1] != sent.last_block
            ):
                blocks_from = 0
            new_blocks = block_ids.tail(blocks_from)
            body += [sent.key, seq.num_computed_tokens, num_new, tokens_from, len(new_tokens),
                     blocks_from, len(new_blocks), seq.lora_slot]
            body += new_tokens
            body += new_blocks
            sent.num_tokens = seq.num_tokens
            sent.num_blocks = len(block_ids)
            sent.last_block = block_ids[len(block_ids) - 1] if len(block_ids) else -1
            sent.num_preemptions = seq.num_preemptions
        body.append(len(plan.lora_loads))
        for slot, name in plan.lora_loads:
            data = name.encode("utf-8")
            body += [slot, len(data), *data]
        return torch.tensor([OP_STEP, len(dropped), len(plan.seqs), *dropped, *body], dtype=torch.long)


class _FlatTable:
    """A request's table as the flat list the plan sends (one group: the list itself;
    several: position-major), without building it whole each step."""

    __slots__ = ("table", "num_groups")

    def __init__(self, table: list[int] | list[list[int]]) -> None:
        multi = bool(table) and isinstance(table[0], list)
        self.table = table
        self.num_groups = len(table) if multi else 1

    def __len__(self) -> int:
        return len(self.table[0]) * self.num_groups if self.num_groups > 1 else len(self.table)

    def __getitem__(self, i: int) -> int:
        if self.num_groups == 1:
            return self.table[i]  # type: ignore[return-value]
        return self.table[i % self.num_groups][i // self.num_groups]  # type: ignore[index]

    def tail(self, start: int) -> list[int]:
        """Entries start.. of the flat list (start: a multiple of num_groups)."""
        if self.num_groups == 1:
            return self.table[start:]  # type: ignore[return-value]
        rows = [row[start // self.num_groups :] for row in self.table]  # type: ignore[index]
        return [block for position in zip(*rows) for block in position]


@dataclass
class MirrorSeq:
    """What a non-zero rank knows of a request: enough for worker/runner/inputs.py host_batch."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    lora_slot: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PlanDecoder:
    """Other ranks: int64 tensor -> a SchedulerOutput over MirrorSeq objects (None = stop)."""

    def __init__(self, num_groups: int = 1) -> None:
        self.mirror: dict[int, MirrorSeq] = {}
        self.num_groups = num_groups  # KV groups: tables travel position-major

    def decode(self, payload: torch.Tensor) -> SchedulerOutput | KVOp | None:
        data = payload.tolist()
        op, num_dropped, num_entries = data[0], data[1], data[2]
        if op == OP_STOP:
            return None
        if op in (OP_EXPORT_KV, OP_IMPORT_KV):
            if len(data) != _HEADER + num_dropped:
                raise ValueError("malformed tensor-parallel KV message")
            return KVOp(op, data[_HEADER:])
        if op != OP_STEP:
            raise ValueError(f"unknown tensor-parallel op {op}")
        pos = _HEADER
        for key in data[pos : pos + num_dropped]:
            self.mirror.pop(key, None)
        pos += num_dropped
        plan = SchedulerOutput()
        for _ in range(num_entries):
            key, computed, num_new, tokens_from, num_tok, blocks_from, num_blk, lora_slot = data[pos : pos + _ENTRY]
            pos += _ENTRY
            seq = self.mirror.get(key)
            if seq is None:
                seq = self.mirror[key] = MirrorSeq()
            del seq.token_ids[tokens_from:]
            seq.token_ids += data[pos : pos + num_tok]
            pos += num_tok
            del seq.block_ids[blocks_from:]
            seq.block_ids += data[pos : pos + num_blk]
            pos += num_blk
            seq.num_computed_tokens = computed
            seq.lora_slot = lora_slot
            plan.seqs.append(seq)  # type: ignore[arg-type]  # duck-typed for the runner
            plan.num_new_tokens.append(num_new)
            groups = self.num_groups
            plan.block_ids.append(seq.block_ids if groups == 1
                                  else [seq.block_ids[g::groups] for g in range(groups)])
        num_loads = data[pos]
        pos += 1
        for _ in range(num_loads):
            slot, num_bytes = data[pos : pos + 2]
            plan.lora_loads.append((slot, bytes(data[pos + 2 : pos + 2 + num_bytes]).decode("utf-8")))
            pos += 2 + num_bytes
        if pos != len(data):
            raise ValueError(f"malformed tensor-parallel plan: {len(data) - pos} trailing ints")
        return plan


def stop_message() -> torch.Tensor:
    return torch.tensor([OP_STOP, 0, 0], dtype=torch.long)
