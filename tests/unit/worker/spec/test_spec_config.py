"""Speculative decoding is off by default, validated when on, refused where it is not
built, and runs the serial step loop; the KV manager's shrink gives back lookahead blocks."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kv.cache_manager import KVCacheManager
from worker.api import SamplingParams
from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence
from worker.config import EngineConfig, ModelConfig, SpeculativeConfig
from worker.engine.build import build_engine, check_speculative
from tests.unit.worker.spec.test_spec_vs_hf import _engine

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def test_off_by_default_and_validated() -> None:
    assert not EngineConfig(ModelConfig("m")).speculative.enabled
    assert SpeculativeConfig(method="ngram").enabled
    for bad in (dict(method="eagle"), dict(method="ngram", num_tokens=0), dict(method="ngram", num_tokens=17),
                dict(method="ngram", ngram_min=3, ngram_max=2), dict(method="ngram", ngram_min=0)):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)  # type: ignore[arg-type]


def test_refused_under_tensor_parallelism_and_on_a_simulated_device() -> None:
    spec = SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_speculative(EngineConfig(ModelConfig("m", tensor_parallel_size=2), speculative=spec))
    with pytest.raises(ValueError, match="simulated device"):
        build_engine(EngineConfig(ModelConfig("m", device="sim:h100"), speculative=spec))


def test_runs_the_serial_loop(tiny_model: TinyModels) -> None:
    engine = _engine(tiny_model("llama"))
    assert not engine.overlaps_device and not engine.launches_ahead
    assert type(engine.scheduler).__name__ == "Scheduler"
    with pytest.raises(RuntimeError, match="serial step loop"):
        engine.launch_step()


def test_shrink_frees_trailing_blocks_of_every_group() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    table = kv.allocate("r", 14)  # 4 blocks
    assert len(table) == 4 and kv.num_free_blocks == 12
    kv.cache_computed("r", list(range(14)), 8)  # blocks 0-1 registered
    kv.shrink("r", 9)  # 9 tokens need 3 blocks
    assert kv.allocate("r", 9) is table and len(table) == 3 and kv.num_free_blocks == 13
    kv.shrink("r", 12)  # nothing past what 12 tokens need
    assert len(table) == 3
    kv.shrink("missing", 1)
    kv.free("r")
    assert kv.num_free_blocks == 16



def test_a_row_taken_out_of_the_plan_takes_its_drafts() -> None:
    """A verify row preempted later in the same schedule may be planned again as a prompt:
    its drafts must not follow it."""
    seq, other = Sequence("a", [1, 2, 3], SamplingParams()), Sequence("b", [4, 5], SamplingParams())
    plan = SchedulerOutput([seq, other], [3, 1], [[0], [1]], draft_token_ids={"a": [7, 8]})
    assert plan.samples(0) and not plan.samples(1)  # a verify row samples; a prompt chunk short of its end not
    plan.remove(seq)
    assert plan.draft_token_ids == {} and plan.seqs == [other]
