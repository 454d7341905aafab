"""deploy/helm/kvserve/values.schema.json's `kvserve` block is generated from KVServeConfig
(cluster/helm_schema.py): it must be current, and it must accept and reject what the
model does. The real Helm engine's checks of the same schema are in tests/helm/."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster import helm_schema
from cluster.config import ConfigError, KVServeConfig


def test_chart_schema_is_current() -> None:
    assert not helm_schema.is_stale(), f"values.schema.json's kvserve block is stale: {helm_schema.STALE_HINT}"


def test_check_mode_names_the_fix(tmp_path: Any, capsys: Any) -> None:
    stale = json.loads(helm_schema.CHART_SCHEMA.read_text())
    stale["properties"]["kvserve"] = {"type": "object"}
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale, indent=2) + "\n")
    assert helm_schema.main(["--check", "--path", str(path)]) == 1
    assert helm_schema.STALE_HINT in capsys.readouterr().err
    assert helm_schema.main(["--write", "--path", str(path)]) == 0
    assert helm_schema.main(["--check", "--path", str(path)]) == 0
    # Only the kvserve block is the generator's; the chart's own keys are kept as written.
    written = json.loads(path.read_text())
    assert {k: v for k, v in written["properties"].items() if k != "kvserve"} == \
        {k: v for k, v in stale["properties"].items() if k != "kvserve"}


def test_no_refs_left() -> None:
    text = json.dumps(helm_schema.kvserve_values_schema())
    assert "$ref" not in text and "$defs" not in text


def _schema_accepts(values: dict[str, Any]) -> bool:
    validator = jsonschema.Draft7Validator(helm_schema.kvserve_values_schema())
    return not list(validator.iter_errors(values))


def _model_accepts(values: dict[str, Any]) -> bool:
    try:
        KVServeConfig.from_dict(values)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("values", [
    {},
    {"engine": {"kv_cache_bytes": "256MiB", "max_num_seqs": 8, "num_blocks": None, "dtype": "bfloat16"}},
    {"engine": {"kv_cache_bytes": 268435456}, "ingress": {"max_body_bytes": "4 MB"}},
    {"model": "/models/model"},
    {"model": {"path": "/m", "served_model_name": None}},
    {"workers": {"tensor_parallel_size": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}},
    {"state": {"redis_url": "rediss://default@redis.ns.svc:6380/1"}},
    {"disaggregation": {"prefill": {}, "decode": {"num_gpus": 2}}},
    {"engine": {"max_num_seq": 8}},  # typo
    {"worker": {}},  # typo at the top
    {"engine": {"dtype": "fp8"}},  # not one of the Literal's values
    {"engine": {"kv_cache_bytes": "lots"}},
    {"engine": {"kv_cache_bytes": 0}},
    {"workers": {"tensor_parallel_size": 0}},
    {"http": {"port": 70000}},
    {"route_prefix": "api"},
    {"state": {"redis_url": "redis://:hunter2@redis:6379/0"}},
    {"state": {"redis_url": "http://redis:6379"}},
    {"workers": {"autoscaling": {"upscale_delay": 3}}},
])
def test_schema_agrees_with_the_model(values: dict[str, Any]) -> None:
    assert _schema_accepts(values) == _model_accepts(values), values
