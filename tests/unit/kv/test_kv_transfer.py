"""KV export/import (kv/transfer.py) and the engine's pinning of exported blocks, with a
fake runner that writes recognisable K/V (no model, no Ray)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from kv.kv_cache import KVCacheSpec
from kv.transfer import (
    KVExport,
    KVTransferError,
    LocalKVTransport,
    gather_blocks,
    make_transport,
    scatter_blocks,
)
from tests.support.fake_runner import FakeRunner, FakeRunnerOutput
from worker.config import CacheConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import KVImportError
from worker.api import SamplingParams
from worker.scheduling.scheduler import SchedulerOutput
from worker.sequence import Sequence

BLOCK = 4
VOCAB = 64
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=3, block_size=BLOCK, dtype=torch.float32)


class KVWritingRunner(FakeRunner):
    """Writes, for every token computed, K = token id + position/1000 and V = -K into its
    slot (all layers and heads), and samples (last token + 1) % VOCAB, avoiding EOS."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, vocab_size=VOCAB)
        self.spec = SPEC
        self.kv_caches = torch.zeros(SPEC.num_layers, 2, num_blocks, BLOCK, SPEC.num_kv_heads, SPEC.head_dim)

    # The KV-transfer capability (worker/runner/protocols.py), as worker/runner/model_runner.py has it.
    @property
    def kv_spec(self) -> KVCacheSpec:
        return self.spec

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        return gather_blocks(self.kv_caches, block_ids)

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        scatter_blocks(self.kv_caches, block_ids, kv)

    def execute(self, plan: SchedulerOutput) -> FakeRunnerOutput:
        flat = self.kv_caches.view(SPEC.num_layers, 2, -1, SPEC.num_kv_heads, SPEC.head_dim)
        for i, seq in enumerate(plan.seqs):
            start = seq.num_computed_tokens
            for pos in range(start, start + plan.num_new_tokens[i]):
                slot = plan.block_ids[i][pos // BLOCK] * BLOCK + pos % BLOCK
                value = seq.token_ids[pos] + pos / 1000
                flat[:, 0, slot] = value
                flat[:, 1, slot] = -value
        return super().execute(plan)

    def sample(self, seq: Sequence) -> int:
        token_id = (seq.token_ids[-1] + 1) % VOCAB
        return 3 if token_id == 2 else token_id


def _engine(num_blocks: int = 16) -> Engine:
    return Engine(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        KVWritingRunner(num_blocks),
        vocab_size=VOCAB,
        eos_token_ids=frozenset({2}),
    )


def _prefill(engine: Engine, request_id: str, prompt: list[int]) -> KVExport:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    for _ in range(100):
        for out in engine.step():
            if out.request_id == request_id:
                assert out.finished and out.new_token_ids
                return out.extra["kv_export"]
    raise AssertionError("no first token")


def _expected_rows(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([t + p / 1000 for p, t in enumerate(tokens)])


# -- the tensor form ------------------------------------------------------------------------
def test_gather_scatter_round_trip_is_exact() -> None:
    torch.manual_seed(0)
    src = torch.randn(2, 2, 10, BLOCK, 2, 3)
    ids = [7, 2, 9]
    packed = gather_blocks(src, ids)
    assert packed.shape == (2, 2, 3 * BLOCK, 2, 3)
    dst = torch.zeros_like(src)
    scatter_blocks(dst, [0, 5, 1], packed)
    for a, b in zip(ids, [0, 5, 1]):
        assert torch.equal(dst[:, :, b], src[:, :, a])
    src[:, :, 7] = 0  # the export is a copy
    assert torch.equal(dst[:, :, 0], packed[:, :, :BLOCK])


def test_export_import_round_trip_between_engines() -> None:
    prefill, decode = _engine(), _engine()
    prompt = list(range(5, 15))  # 10 tokens: 2 full blocks and a partial one
    export = _prefill(prefill, "r", prompt)
    assert export.num_tokens == 10 and export.num_blocks == 3 and export.next_token_id == 15
    assert export.kv.shape == (2, 2, 12, 2, 3)
    assert torch.equal(export.kv[0, 0, :10, 0, 0], _expected_rows(prompt))
    assert len(export.block_hashes) == 2
    decode.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0), kv_import=export)
    decode.step()  # admits the import, writes its KV, decodes the first token (15)
    block_ids = decode.kv.block_ids("r")
    got = gather_blocks(decode.runner.kv_caches, block_ids[:3])
    assert torch.equal(got[:, :, :10], export.kv[:, :, :10])
    # the first token's KV was computed here, at position 10, by the decode engine
    assert got[0, 0, 10, 0, 0].item() == pytest.approx(15 + 10 / 1000)
    # full imported blocks are in the decode side's prefix cache
    assert all(decode.kv.pool.lookup(h) is not None for h in export.block_hashes)


def test_check_compatible_names_every_mismatch() -> None:
    export = _prefill(_engine(), "r", list(range(5, 12)))
    export.check_compatible(SPEC)
    for field, value in [("block_size", 8), ("num_layers", 3), ("num_kv_heads", 1), ("head_dim", 4),
                         ("dtype", torch.bfloat16)]:
        with pytest.raises(KVTransferError, match=field):
            export.check_compatible(replace(SPEC, **{field: value}))
    bad = replace(export, kv=export.kv[:, :, :4])
    with pytest.raises(KVTransferError, match="shape"):
        bad.check_compatible(SPEC)


def test_import_mismatch_is_a_request_error_and_leaves_nothing() -> None:
    export = _prefill(_engine(), "r", list(range(5, 12)))
    decode = _engine()
    decode.runner.spec = replace(SPEC, head_dim=8)
    with pytest.raises(KVImportError, match="head_dim"):
        decode.add_request("r", list(range(5, 12)), SamplingParams(max_tokens=4), kv_import=export)
    decode.runner.spec = SPEC
    with pytest.raises(KVImportError, match="other tokens"):
        decode.add_request("r", list(range(6, 13)), SamplingParams(max_tokens=4), kv_import=export)
    assert not decode.seqs and not decode.has_unfinished()


# -- pinning on the prefill side ---------------------------------------------------------------
def test_exported_blocks_stay_pinned_until_release() -> None:
    engine = _engine(num_blocks=8)
    _prefill(engine, "r", list(range(5, 15)))  # 3 blocks
    assert not engine.has_unfinished() and "r" not in engine.seqs
    assert engine.kv.num_free_blocks == 8 - 3 and engine.num_pinned_blocks == 3
    # Pressure: another request must not get the pinned blocks (their content stays intact).
    before = engine.runner.kv_caches.clone()
    pinned_ids = engine.connector.pinned_block_ids("r")
    engine.add_request("other", list(range(20, 39)), SamplingParams(max_tokens=1))  # 5 blocks: all the rest
    while engine.has_unfinished():
        engine.step()
    for block_id in pinned_ids:
        assert torch.equal(engine.runner.kv_caches[:, :, block_id], before[:, :, block_id])
    assert engine.release_kv("r") and not engine.release_kv("r")
    assert engine.kv.num_free_blocks == 8 and engine.num_pinned_blocks == 0


def test_pins_expire_after_the_timeout() -> None:
    engine = _engine()
    _prefill(engine, "a", list(range(5, 15)))
    engine.connector.pin_timeout_s = 0.0
    _prefill(engine, "b", list(range(5, 9)))
    assert engine.num_pinned_blocks == 4
    assert engine.connector.expire_pins(now=time.monotonic() + 1.0) == 1  # b only: a is still in time
    assert engine.num_pinned_blocks == 3
    assert engine.connector.expire_pins(now=time.monotonic() + 31.0) == 1
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_abort_frees_pinned_and_pending_import_blocks() -> None:
    prefill, decode = _engine(), _engine(num_blocks=4)
    export = _prefill(prefill, "r", list(range(5, 15)))
    assert prefill.abort_request("r") is None  # the request is done; its pin goes anyway
    assert prefill.kv.num_free_blocks == prefill.kv.num_total_blocks
    # Decode side: the pool is taken, so the import waits; aborting it frees nothing twice.
    decode.add_request("x", [3, 4, 5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=3))
    decode.step()
    decode.add_request("r", list(range(5, 15)), SamplingParams(max_tokens=4), kv_import=export)
    decode.step()
    assert decode.seqs["r"].num_computed_tokens == 0  # still pending
    out = decode.abort_request("r")
    assert out is not None and out.finish_reason == "abort"
    while decode.has_unfinished():
        decode.step()
    assert decode.kv.num_free_blocks == 4


def test_pending_import_is_admitted_when_blocks_free_up() -> None:
    prefill, decode = _engine(), _engine(num_blocks=4)
    export = _prefill(prefill, "r", list(range(5, 15)))  # needs 3 blocks (+1 to grow)
    decode.add_request("x", list(range(30, 38)), SamplingParams(max_tokens=2))  # 2..3 blocks
    decode.step()
    decode.add_request("r", list(range(5, 15)), SamplingParams(max_tokens=3, temperature=0.0), kv_import=export)
    tokens: list[int] = []
    while decode.has_unfinished():
        for out in decode.step():
            if out.request_id == "r":
                tokens += out.new_token_ids
    assert tokens == [16, 17]  # after the first token 15, streamed by the prefill side
    assert decode.kv.num_free_blocks == 4


# -- transports ---------------------------------------------------------------------------------
def test_local_transport_send_receive_release() -> None:
    export = _prefill(_engine(), "r", list(range(5, 15)))
    transport = make_transport("local")
    assert isinstance(transport, LocalKVTransport)
    handle = transport.send(export, "replica-1")
    assert handle.num_tokens == 10 and handle.source_replica_id == "replica-1" and handle.nbytes > 0
    got = asyncio.run(transport.receive(handle))
    assert got is export
    transport.release(handle.request_id)
    assert len(transport) == 0
    with pytest.raises(KVTransferError, match="no longer available"):
        asyncio.run(transport.receive(handle))
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_transport("carrier-pigeon")


def test_500_disaggregated_requests_with_aborts_leak_no_block() -> None:
    """Random load through a prefill and a decode engine: some requests are aborted after
    their prefill (the pin must go), some while their import waits, some mid-decode, some
    are never acknowledged (the pin expires). Every block of both pools ends up free."""
    import random

    rng = random.Random(0)
    prefill, decode = _engine(num_blocks=24), _engine(num_blocks=12)
    live: set[str] = set()
    exports: list[KVExport] = []
    for i in range(500):
        rid = f"r{i}"
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 14))]
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
        for out in prefill.step():
            exports.append(out.extra["kv_export"])
        while exports:
            export = exports.pop()
            fate = rng.random()
            if fate < 0.1:
                prefill.abort_request(export.request_id)  # the client left after its first token
                continue
            if fate < 0.15:
                continue  # never acknowledged: expires below
            decode.add_request(export.request_id, export.token_ids,
                               SamplingParams(max_tokens=rng.randint(2, 6), temperature=0.0), kv_import=export)
            prefill.release_kv(export.request_id)
            live.add(export.request_id)
        for out in decode.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            decode.abort_request(victim)
            live.discard(victim)
    while prefill.has_unfinished():
        for out in prefill.step():
            prefill.release_kv(out.request_id)
    while decode.has_unfinished():
        decode.step()
    prefill.connector.expire_pins(now=time.monotonic() + prefill.connector.pin_timeout_s + 1)
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        assert engine.num_pinned_blocks == 0 and not engine.seqs


def test_failed_export_is_an_error_not_a_clean_finish_and_frees_the_blocks() -> None:
    engine = _engine()

    def broken(block_ids: list[int]) -> torch.Tensor:
        raise RuntimeError("tensor-parallel KV export failed: rank 1 died")

    engine.runner.export_kv = broken  # type: ignore[method-assign]
    engine.add_request("r", list(range(5, 40)), SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    outs = [out for _ in range(10) if engine.has_unfinished() for out in engine.step()]
    (out,) = [o for o in outs if o.request_id == "r"]
    assert out.finished and out.finish_reason == "error" and "KV export failed" in out.error
    assert "kv_export" not in out.extra
    assert engine.num_pinned_blocks == 0 and engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert not engine.seqs


def test_failed_import_is_an_error_and_frees_its_blocks() -> None:
    export = _prefill(_engine(), "r", list(range(5, 15)))
    decode = _engine()

    def broken(block_ids: list[int], kv: torch.Tensor) -> None:
        raise RuntimeError("tensor-parallel KV import failed: rank 1 died")

    decode.runner.import_kv = broken  # type: ignore[method-assign]
    decode.add_request("ok", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0.0))
    decode.add_request("r", list(range(5, 15)), SamplingParams(max_tokens=4), kv_import=export)
    outs = decode.step()  # both admitted; the import fails before the step executes
    (failed,) = [o for o in outs if o.request_id == "r"]
    assert failed.finished and failed.finish_reason == "error" and "KV import failed" in failed.error
    assert [o.request_id for o in outs if o.new_token_ids] == ["ok"]  # the rest of the step ran
    while decode.has_unfinished():
        decode.step()
    assert decode.kv.num_free_blocks == decode.kv.num_total_blocks and not decode.seqs


def test_an_import_is_admitted_under_max_num_seqs_like_any_request() -> None:
    export = _prefill(_engine(), "r", list(range(5, 15)))
    decode = Engine(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BLOCK, num_blocks_override=16),
        KVWritingRunner(16),
        vocab_size=VOCAB,
        eos_token_ids=frozenset({2}),
    )
    decode.add_request("x", [30, 31, 32], SamplingParams(max_tokens=3, temperature=0.0))
    decode.step()
    decode.add_request("r", list(range(5, 15)), SamplingParams(max_tokens=3, temperature=0.0), kv_import=export)
    order: list[str] = []
    while decode.has_unfinished():
        assert decode.scheduler.num_running <= 1
        order += [o.request_id for o in decode.step() if o.new_token_ids]
    # The import waited (a WAITING sequence) until x's slot was free; x's 2 decode steps come first.
    assert order == ["x", "x", "r", "r"]
    assert decode.kv.num_free_blocks == decode.kv.num_total_blocks


def test_a_runner_without_kv_transfer_refuses_exports_and_imports() -> None:
    from worker.kvcache.connector import NullConnector

    export = _prefill(_engine(), "r", list(range(5, 15)))
    engine = Engine(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BLOCK, num_blocks_override=16), FakeRunner(16), vocab_size=VOCAB,
    )
    assert isinstance(engine.connector, NullConnector)
    with pytest.raises(KVImportError, match="cannot export"):
        engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=1), export_kv=True)
    with pytest.raises(KVImportError, match="no KV cache to import into"):
        engine.add_request("r", list(range(5, 15)), SamplingParams(max_tokens=4), kv_import=export)
    assert not engine.seqs and not engine.has_unfinished()

