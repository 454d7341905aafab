"""The KV connector: where prefill/decode disaggregation plugs into the engine.

The engine calls a connector at fixed points of every step and never branches on a role
(the shape of vLLM's KVConnector):

    add_request   a request that exports its KV (prefill pool) or carries imported KV
                  (decode pool) is checked and registered; an import becomes a WAITING
                  sequence holding its payload (`seq.kv_import`), which the scheduler
                  admits under the same token budget, max_num_seqs and block checks as
                  any other sequence
    load_kv       after scheduling, before execute: write the KV of the imports admitted
                  this step into the blocks the scheduler gave them
    save_kv       after execute, before update: export the KV of every exporting request
                  whose prompt is now computed (its first token was just sampled), and
                  pin its blocks (they outlive the request until release_kv or a deadline)
    expire_pins   at the start of a step (and when idle): unpin unacknowledged exports

`NullConnector` is for runners that cannot move KV (fakes, simulated devices): it refuses
such requests. `KVTransferConnector` needs a `KVTransferRunner`. A replica serves either
role through the same connector: which requests export and which import is decided per
request by the router (router/frontend/disagg.py), not by the engine.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from kv.block_hash import hash_full_blocks
from kv.block_pool import Block
from kv.cache_manager import KVCacheManager, cdiv
from kv.transfer import DEFAULT_PIN_TIMEOUT_S, KVExport, KVTransferError, dtype_name
from worker.runner.protocols import KVTransferRunner, Runner
from worker.api import SamplingParams
from worker.scheduling.scheduler import SchedulerOutput
from worker.sequence import Sequence

logger = logging.getLogger(__name__)

# What save_kv reports per exporting request: its export, or the message of a failure.
SavedKV = dict[str, KVExport | str]


class KVConnector(Protocol):
    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool, kv_import: KVExport | None
    ) -> None:
        """Raise KVTransferError for a transfer this engine cannot do (nothing is changed)."""
        ...

    def add_request(self, seq: Sequence, export_kv: bool, kv_import: KVExport | None) -> None: ...

    def load_kv(self, plan: SchedulerOutput) -> list[tuple[Sequence, str]]:
        """Write `plan.kv_imports`' KV; returns the ones that failed, with a message."""
        ...

    def save_kv(self, plan: SchedulerOutput, sampled_token_ids: list[int | None]) -> SavedKV: ...

    def expire_pins(self, now: float | None = None) -> int: ...

    def release_kv(self, request_id: str) -> bool: ...

    def request_finished(self, request_id: str) -> None:
        """The request ended outside the normal path (abort, error): drop what is held for it."""
        ...

    def next_pin_deadline(self) -> float | None: ...

    @property
    def num_pinned_blocks(self) -> int: ...

    @property
    def exporting(self) -> bool:
        """Does a request wait for its first token to export its KV?"""
        ...


class NullConnector:
    """For a runner without KV transfer: no request may export or import."""

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool, kv_import: KVExport | None
    ) -> None:
        if export_kv:
            raise KVTransferError("this engine's runner cannot export its KV cache")
        if kv_import is not None:
            raise KVTransferError("this engine's runner has no KV cache to import into")

    def add_request(self, seq: Sequence, export_kv: bool, kv_import: KVExport | None) -> None:
        pass

    def load_kv(self, plan: SchedulerOutput) -> list[tuple[Sequence, str]]:
        return []

    def save_kv(self, plan: SchedulerOutput, sampled_token_ids: list[int | None]) -> SavedKV:
        return {}

    def expire_pins(self, now: float | None = None) -> int:
        return 0

    def release_kv(self, request_id: str) -> bool:
        return False

    def request_finished(self, request_id: str) -> None:
        pass

    def next_pin_deadline(self) -> float | None:
        return None

    @property
    def exporting(self) -> bool:
        return False

    @property
    def num_pinned_blocks(self) -> int:
        return 0


class KVTransferConnector:
    """Exports through the runner's `export_kv` and pins the exported blocks (an extra
    reference each) until `release_kv` or `pin_timeout_s`; imports through `import_kv`
    into blocks the scheduler allocated, then registers the full ones in the prefix cache."""

    def __init__(
        self, runner: KVTransferRunner, kv: KVCacheManager, vocab_size: int,
        pin_timeout_s: float = DEFAULT_PIN_TIMEOUT_S,
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        self.pin_timeout_s = pin_timeout_s
        self._exporting: set[str] = set()  # export when their first token is sampled
        self._pinned: dict[str, tuple[list[Block], float]] = {}  # request id -> (blocks, deadline)
        self._next_deadline = float("inf")  # earliest pin deadline (inf: none)

    @property
    def exporting(self) -> bool:
        """Does a request wait for its first token to export its KV (its table pinned then)?"""
        return bool(self._exporting)

    # -- admission ----------------------------------------------------------------------------
    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, export_kv: bool, kv_import: KVExport | None
    ) -> None:
        if kv_import is None:
            return
        kv_import.check_compatible(self.runner.kv_spec)
        if list(prompt_token_ids) != list(kv_import.token_ids):
            raise KVTransferError(f"the KV export of {kv_import.request_id!r} holds other tokens than the prompt")
        if kv_import.next_token_id is None or not 0 <= kv_import.next_token_id < self.vocab_size:
            raise KVTransferError(f"the KV export of {kv_import.request_id!r} has no valid first token")
        if params.max_tokens < 2:
            raise KVTransferError("an imported request must still have tokens to generate (max_tokens >= 2)")

    def add_request(self, seq: Sequence, export_kv: bool, kv_import: KVExport | None) -> None:
        if export_kv:
            self._exporting.add(seq.request_id)
        if kv_import is not None:
            # The request continues after the export's first token: prompt + that token,
            # the prompt's KV in the payload (num_computed_tokens is set at admission).
            assert kv_import.next_token_id is not None
            seq.append_token(kv_import.next_token_id)
            seq.num_cached_tokens = kv_import.num_cached_tokens
            seq.kv_import = kv_import

    # -- the step ------------------------------------------------------------------------------
    def load_kv(self, plan: SchedulerOutput) -> list[tuple[Sequence, str]]:
        failed: list[tuple[Sequence, str]] = []
        for seq in plan.kv_imports:
            export, seq.kv_import = seq.kv_import, None  # consumed: a recompute never re-imports
            assert export is not None
            # Every KV group's table: the export holds every layer's KV.
            block_ids = self.kv.table_prefix(seq.request_id, export.num_blocks)
            try:
                self.runner.import_kv(block_ids, export.kv)
            except Exception as e:  # e.g. a dead tensor-parallel rank
                logger.exception("KV import of %s failed", seq.request_id)
                failed.append((seq, f"KV import failed: {type(e).__name__}: {e}"))
                continue
            self.kv.cache_computed(seq.request_id, seq.token_ids, export.num_tokens, seq.hash_root)
        return failed

    def save_kv(self, plan: SchedulerOutput, sampled_token_ids: list[int | None]) -> SavedKV:
        if not self._exporting:
            return {}
        saved: SavedKV = {}
        for i, seq in enumerate(plan.seqs):
            token_id = sampled_token_ids[i]
            if token_id is None or seq.request_id not in self._exporting:
                continue  # not exporting, or its prompt is not computed yet
            self._exporting.discard(seq.request_id)
            try:
                saved[seq.request_id] = self._export(seq, plan.block_ids[i], token_id)
            except Exception as e:  # e.g. a dead tensor-parallel rank
                logger.exception("KV export of %s failed", seq.request_id)
                saved[seq.request_id] = f"KV export failed: {type(e).__name__}: {e}"
                continue
            # Before update(): a request that ends with this token frees its blocks there.
            self._pin(seq.request_id, self.kv.pin(seq.request_id))
        return saved

    def _export(self, seq: Sequence, block_ids: list[int] | list[list[int]], next_token_id: int) -> KVExport:
        n = seq.num_tokens  # before update: the prompt, all computed now; next_token_id has no KV
        spec = self.runner.kv_spec  # all heads, under TP too
        block_size = self.kv.block_size
        return KVExport(
            request_id=seq.request_id,
            kv=self.runner.export_kv(_prefix(block_ids, cdiv(n, block_size))),
            token_ids=seq.token_ids[:n],
            next_token_id=next_token_id,
            block_size=block_size,
            dtype=dtype_name(spec.dtype),
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_planes=spec.num_planes,
            block_hashes=hash_full_blocks(seq.token_ids[:n], block_size, root=seq.hash_root),
            hash_root=seq.hash_root,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- pins ----------------------------------------------------------------------------------
    def _pin(self, request_id: str, blocks: list[Block]) -> None:
        self.release_kv(request_id)  # a reused request id must not strand the older pin
        deadline = time.monotonic() + self.pin_timeout_s
        self._pinned[request_id] = (blocks, deadline)
        self._next_deadline = min(self._next_deadline, deadline)

    def release_kv(self, request_id: str) -> bool:
        """The decode side has the request's KV (or gave up): unpin its blocks."""
        pinned = self._pinned.pop(request_id, None)
        if pinned is None:
            return False
        self.kv.unpin(pinned[0])
        return True

    def expire_pins(self, now: float | None = None) -> int:
        """Unpin exports nobody acknowledged within pin_timeout_s. Returns how many."""
        if not self._pinned:
            return 0
        now = time.monotonic() if now is None else now
        # A scan, but over the transfers in flight only (few), and only once one is due.
        if self._next_deadline > now:
            return 0
        expired = [request_id for request_id, (_, deadline) in self._pinned.items() if deadline <= now]
        for request_id in expired:
            logger.warning("KV export of %s was not acknowledged within %.0f s; freeing it",
                           request_id, self.pin_timeout_s)
            self.release_kv(request_id)
        self._next_deadline = min((d for _, d in self._pinned.values()), default=float("inf"))
        return len(expired)

    def request_finished(self, request_id: str) -> None:
        self._exporting.discard(request_id)
        self.release_kv(request_id)

    def next_pin_deadline(self) -> float | None:
        return self._next_deadline if self._pinned else None

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks, _ in self._pinned.values())

    def pinned_block_ids(self, request_id: str) -> list[int]:
        pinned = self._pinned.get(request_id)
        return [] if pinned is None else [b.block_id for b in pinned[0]]


def _prefix(table: list[int] | list[list[int]], num_blocks: int) -> list[int] | list[list[int]]:
    """A table's first `num_blocks` entries (every KV group's; a sliding group's released
    entries name the null block: positions no query reads again)."""
    if table and isinstance(table[0], list):
        return [ids[:num_blocks] for ids in table]  # type: ignore[index]
    return table[:num_blocks]


def make_connector(runner: Runner, kv: KVCacheManager, vocab_size: int) -> KVConnector:
    """The connector a runner supports: KV transfer when it can copy blocks out and in."""
    if isinstance(runner, KVTransferRunner):
        return KVTransferConnector(runner, kv, vocab_size)
    return NullConnector()
