"""engine.speculative in the user schema: off by default, mapped field by field onto
worker.config.SpeculativeConfig, bad values refused with the key named."""
from __future__ import annotations

import pytest

from cluster.config import ConfigError, KVServeConfig
from worker.config import SpeculativeConfig


def test_off_by_default_and_mapped() -> None:
    assert KVServeConfig.from_dict({}).engine_config().speculative == SpeculativeConfig()
    config = KVServeConfig.from_dict({"engine": {"speculative": {"method": "ngram", "num_tokens": 3, "ngram_max": 5}}})
    assert config.engine_config().speculative == SpeculativeConfig(method="ngram", num_tokens=3, ngram_max=5)
    draft = KVServeConfig.from_dict({"engine": {"speculative": {"method": "draft_model", "draft_model": "/m"}}})
    assert draft.engine_config().speculative == SpeculativeConfig(method="draft_model", draft_model="/m")


@pytest.mark.parametrize("bad,named", [
    ({"speculative": {"method": "eagle"}}, "engine.speculative.method"),
    ({"speculative": {"method": "ngram", "num_tokens": 0}}, "engine.speculative.num_tokens"),
    ({"speculative": {"ngram_min": 3, "ngram_max": 2}}, "ngram_min"),
    ({"speculative": {"k": 3}}, "engine.speculative.k"),
    ({"device": "sim:h100", "speculative": {"method": "ngram"}}, "simulated device"),
    ({"speculative": {"method": "draft_model"}}, "needs draft_model"),
    ({"speculative": {"method": "ngram", "draft_model": "/m"}}, "needs that method"),
])
def test_refused(bad: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        KVServeConfig.from_dict({"engine": bad})
