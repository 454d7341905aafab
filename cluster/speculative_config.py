"""The `engine.speculative` block of the config schema (speculative decoding, worker/spec/):

    engine:
      speculative:
        method: ngram     # unset: off (the default); ngram or draft_model
        num_tokens: 4     # draft tokens per decode row (k)
        ngram_min: 1      # ngram: the shortest suffix the prompt lookup matches
        ngram_max: 4      # ngram: the longest
        draft_model: /models/small   # draft_model: a checkpoint of the same tokenizer

Each field's default is worker.config.SpeculativeConfig's.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.config_fields import Section, build, default_of
from worker.config import SpeculativeConfig


class SpeculativeSection(Section):
    method: Literal["ngram", "draft_model"] | None = default_of(SpeculativeConfig, "method")
    num_tokens: int = Field(default_of(SpeculativeConfig, "num_tokens"), ge=1, le=16)
    ngram_min: int = Field(default_of(SpeculativeConfig, "ngram_min"), ge=1)
    ngram_max: int = Field(default_of(SpeculativeConfig, "ngram_max"), ge=1)
    draft_model: str | None = default_of(SpeculativeConfig, "draft_model")

    @model_validator(mode="after")
    def _ngram_bounds(self) -> SpeculativeSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("method draft_model needs draft_model (a checkpoint directory), and "
                             "draft_model needs that method")
        return self

    def speculative_config(self) -> SpeculativeConfig:
        return build(SpeculativeConfig, self)
