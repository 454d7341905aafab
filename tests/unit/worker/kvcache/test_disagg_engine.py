"""Prefill/decode disaggregation between two engines in one process (no Ray): the prefill
engine computes the prompt and first token and exports the KV; the decode engine imports
it into its own blocks and continues. Greedy outputs equal one engine's and transformers'."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kv.block_hash import hash_full_blocks
from kv.transfer import KVExport, LocalKVTransport
from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.serving.replica import WorkerReplica
from worker.api import GenerateRequest
from worker.api import SamplingParams
from worker.engine.build import build_engine

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels

BLOCK = 16
VOCAB = 512


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    shared = tokens(2 * BLOCK)
    prompts = [
        tokens(5),
        tokens(BLOCK),  # an exact multiple of block_size
        tokens(3 * BLOCK),  # another, several blocks
        tokens(37),
        shared + tokens(9),  # the prefix group: the second one hits the prefill side's cache
        shared + tokens(20),
    ]
    return prompts, [12, 10, 9, 14, 11, 8]


PROMPTS, MAX_TOKENS = _prompts()


def _engine(model_dir: Path, num_blocks: int = 128) -> Engine:
    return build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        )
    )


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def _step_until(engine: Engine, request_ids: set[str]) -> dict[str, list]:
    outs: dict[str, list] = {rid: [] for rid in request_ids}
    done: set[str] = set()
    while done != request_ids:
        assert engine.has_unfinished(), f"unfinished: {request_ids - done}"
        for out in engine.step():
            if out.request_id in outs:
                outs[out.request_id].append(out)
                if out.finished:
                    done.add(out.request_id)
    return outs


def _disaggregated(prefill: Engine, decode: Engine, groups: list[list[int]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Prefill each group of prompts together (groups in order, so later groups can hit the
    prefill side's prefix cache), hand every export to the decode engine, decode all."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for group in groups:
        for i in group:
            prefill.add_request(str(i), PROMPTS[i], _greedy(1), export_kv=True)
        firsts = _step_until(prefill, {str(i) for i in group})
        for i in group:
            (out,) = firsts[str(i)]
            rid = str(i)
            tokens[rid] = list(out.new_token_ids)
            cached[rid] = out.num_cached_tokens
            export: KVExport = out.extra["kv_export"]
            assert export.num_tokens == len(PROMPTS[i]) and export.next_token_id == out.new_token_ids[0]
            if out.finish_reason == "stop" or MAX_TOKENS[i] == 1:  # EOS first: nothing to decode
                prefill.release_kv(rid)
                continue
            decode.add_request(rid, PROMPTS[i], _greedy(MAX_TOKENS[i]), kv_import=export)
            prefill.release_kv(rid)  # the decode side holds its own copy now
    rest = _step_until(decode, {rid for rid in tokens if rid in decode.seqs})
    for rid, outs in rest.items():
        for out in outs:
            tokens[rid] += out.new_token_ids
    return tokens, cached


def test_disaggregated_greedy_equals_one_engine_and_hf(
    tiny_model: TinyModels, hf_reference: HFReference, run_engine
) -> None:
    model_dir = tiny_model("llama")
    prefill, decode = _engine(model_dir), _engine(model_dir)
    tokens, cached = _disaggregated(prefill, decode, [[0, 1, 2, 3, 4], [5]])
    assert cached["5"] == 2 * BLOCK  # the prefill side served the shared prefix from its cache

    single = run_engine(_engine(model_dir), PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    reference = hf_reference("llama", PROMPTS, MAX_TOKENS)
    for i in range(len(PROMPTS)):
        assert tokens[str(i)] == single[str(i)] == reference[i], f"prompt {i} (len {len(PROMPTS[i])})"

    # Nothing leaked: every block of both pools is free again.
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        assert engine.num_pinned_blocks == 0 and not engine.has_unfinished()
    # The decode side registered the imported full blocks in its own prefix cache.
    assert all(h in decode.kv.pool.cached for h in hash_full_blocks(PROMPTS[2], BLOCK))


def test_replica_prefill_then_decode_streams_the_same_text(tiny_model: TinyModels, run_engine) -> None:
    """WorkerReplica.prefill / decode / release_kv through the async engines (local transport)."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    model_dir = tiny_model("llama")

    def replica() -> WorkerReplica:
        r = WorkerReplica.__new__(WorkerReplica)
        r._attach(AsyncEngine(_engine(model_dir), tokenizer), BLOCK, 5.0)
        return r

    transport = LocalKVTransport()
    prefill, decode, mixed = replica(), replica(), replica()
    prefill.kv_transport = decode.kv_transport = transport
    prompt, n = PROMPTS[3], MAX_TOKENS[3]

    async def main() -> tuple[list[int], str, int]:
        request = GenerateRequest("r", prompt, _greedy(n))
        first, handle = await prefill.prefill(request)
        assert handle is not None and not first.finished and len(first.new_token_ids) == 1
        assert prefill.engine.engine.num_pinned_blocks > 0
        token_ids, text = list(first.new_token_ids), first.text_delta
        async for out in decode.decode(request, handle):
            token_ids += out.new_token_ids
            text += out.text_delta
        await prefill.release_kv("r")
        for _ in range(500):  # the release goes through the step thread's inbox
            if prefill.engine.engine.num_pinned_blocks == 0:
                break
            await asyncio.sleep(0.01)
        single_ids, single_text = [], ""
        async for out in mixed.generate(GenerateRequest("m", prompt, _greedy(n))):
            single_ids += out.new_token_ids
            single_text += out.text_delta
        assert token_ids == single_ids and text == single_text and text
        return token_ids, text, prefill.engine.engine.num_pinned_blocks

    try:
        token_ids, text, pinned = asyncio.run(main())
    finally:
        for r in (prefill, decode, mixed):
            r._stop_engine()
    assert token_ids == run_engine(_engine(model_dir), [prompt], _greedy(n))["0"]
    assert pinned == 0 and len(transport) == 0


def test_prefill_of_a_one_token_request_exports_nothing(tiny_model: TinyModels) -> None:
    model_dir = tiny_model("llama")
    r = WorkerReplica.__new__(WorkerReplica)
    r._attach(AsyncEngine(_engine(model_dir)), BLOCK, 5.0)

    async def main():  # noqa: ANN202
        return await r.prefill(GenerateRequest("one", PROMPTS[0], _greedy(1)))

    try:
        out, handle = asyncio.run(main())
    finally:
        r._stop_engine()
    assert handle is None and out.finished and out.finish_reason in ("length", "stop")
    assert r.engine.engine.num_pinned_blocks == 0


@pytest.mark.parametrize("field", ["block_size"])
def test_decode_engine_with_another_block_size_rejects_the_export(tiny_model: TinyModels, field: str) -> None:
    from worker.api import KVImportError

    model_dir = tiny_model("llama")
    prefill = _engine(model_dir)
    decode = build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(block_size=8, num_blocks_override=64),
            SchedulerConfig(),
        )
    )
    prefill.add_request("r", PROMPTS[3], _greedy(1), export_kv=True)
    (out,) = _step_until(prefill, {"r"})["r"]
    with pytest.raises(KVImportError, match=field):
        decode.add_request("r", PROMPTS[3], _greedy(5), kv_import=out.extra["kv_export"])
