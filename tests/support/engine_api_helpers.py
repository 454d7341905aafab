"""Shared fixtures and helpers for the engine API tests (tests/unit/worker/test_engine_api*.py):
a tokenizer with exactly the tiny model's ids, an Engine / AsyncEngine on the tiny Llama,
and small helpers over their outputs.

Synchronisation: results are awaited through the streams. Block release after an abort
happens on the step thread after the caller's stream has ended, so it is observed by
polling `stats()` in a bounded loop of zero-length awaits (no sleeps as synchronisation):
`await_condition(all_free(ae), ...)`.

The fixtures are imported by name into each test module (module-scoped there, as before
the split), not put in a conftest: other unit tests define their own `tokenizer`.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.engine.async_engine import AsyncEngine
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from worker.engine.core import Engine
from worker.api import RequestOutput
from worker.engine.build import build_engine

VOCAB = 512  # tests/support/tiny_models.py; the tokenizer below has exactly this many tokens
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly the tiny model's 512 ids, <pad>/<s>/</s> = 0/1/2 as
    in the model's config (the tiny checkpoints ship no tokenizer)."""
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    corpus = [
        " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(40)) + ". "
        for _ in range(300)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    assert len(fast) == VOCAB and fast.eos_token_id == 2
    return fast


def make_engine(model_dir: Path, max_num_seqs: int = 16) -> Engine:
    return build_engine(
        EngineConfig(
            ModelConfig(str(model_dir), dtype="float32", device="cpu"),
            CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN),
        )
    )


@pytest.fixture
def engine(tiny_llama: Path) -> Engine:
    return make_engine(tiny_llama)


@pytest.fixture
def async_engine(engine: Engine, tokenizer: PreTrainedTokenizerFast) -> Iterator[AsyncEngine]:
    ae = AsyncEngine(engine, tokenizer)
    yield ae
    ae.shutdown()


# -- helpers --------------------------------------------------------------------------------

def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outs)


async def await_condition(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll a condition set by the step thread, yielding to the loop between checks."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.001)


def all_free(ae: AsyncEngine) -> Callable[[], bool]:
    def check() -> bool:
        s = ae.stats()
        return s.kv.free_blocks == s.kv.total_blocks and s.num_running == 0 and s.num_waiting == 0

    return check


class FailingForward:
    """Wraps the model's forward; raises on the next call once armed."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward
        self.armed = False
        self.num_failures = 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.armed:
            self.armed = False
            self.num_failures += 1
            raise RuntimeError("injected forward failure")
        return self.forward(*args, **kwargs)
