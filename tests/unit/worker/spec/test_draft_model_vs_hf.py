"""The draft-model proposer: greedy outputs stay token for token transformers' with a draft
that agrees (the target's own checkpoint: nearly every draft accepted) and one that does not
(another random checkpoint of the same vocabulary: most rejected), batched, chunked and
cached; a draft model of another vocabulary is refused."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.tiny_models import make_tiny_model
from tests.unit.worker.spec.test_spec_vs_hf import ALL, MAX_TOKENS, PROMPTS, _greedy
from worker.api import RequestOutput, SamplingParams
from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from worker.engine.build import build_engine
from worker.engine.core import Engine

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second random llama of the same vocabulary (another seed): a poor draft."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("draft") / "llama-other", seed=1)


def _engine(target: Path, draft: Path, max_num_batched_tokens: int = 2048, num_tokens: int = 3) -> Engine:
    return build_engine(EngineConfig(
        ModelConfig(str(target), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks_override=512),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens),
        speculative=SpeculativeConfig(method="draft_model", num_tokens=num_tokens, draft_model=str(draft)),
    ))


@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_matches_hf(draft: str, tiny_model: TinyModels, other_llama: Path, hf_reference: HFReference,
                           run_engine: Callable) -> None:
    target = tiny_model("llama")
    engine = _engine(target, target if draft == "same" else other_llama)
    finals: dict[str, RequestOutput] = {}
    out = run_engine(engine, [PROMPTS[i] for i in ALL], [_greedy(MAX_TOKENS[i]) for i in ALL], final_outputs=finals)
    refs = hf_reference("llama", [PROMPTS[i] for i in ALL], [MAX_TOKENS[i] for i in ALL])
    assert out == {str(i): ref for i, ref in zip(ALL, refs)}
    stats = engine.stats()
    assert stats.num_verify_rows > 0
    rate = stats.num_accepted_draft_tokens / stats.num_draft_tokens
    if draft == "same":
        assert rate > 0.95  # the target drafting for itself: only ties of float rounding differ
    else:
        assert rate < 0.5
    assert stats.kv.free_blocks == stats.kv.total_blocks


def test_chunked_and_sampled_rows(tiny_model: TinyModels, other_llama: Path, hf_reference: HFReference,
                                  run_engine: Callable) -> None:
    """A tiny token budget (drafts beside prompt chunks), greedy rows exact, seeded sampled
    rows the same on a second run."""
    target = tiny_model("llama")
    indices = [3, 8, 11, 0, 14]
    params = [_greedy(MAX_TOKENS[i]) if j % 2 == 0 else
              SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.8, seed=j) for j, i in enumerate(indices)]
    runs = [run_engine(_engine(target, other_llama, max_num_batched_tokens=9), [PROMPTS[i] for i in indices], params)
            for _ in range(2)]
    assert runs[0] == runs[1]
    refs = hf_reference("llama", [PROMPTS[i] for i in indices], [MAX_TOKENS[i] for i in indices])
    for j, ref in enumerate(refs):
        if j % 2 == 0:
            assert runs[0][str(j)] == ref


def test_another_vocabulary_is_refused(tiny_model: TinyModels, tmp_path: Path) -> None:
    small_vocab = make_tiny_model("llama", tmp_path / "v256", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(tiny_model("llama"), small_vocab)
