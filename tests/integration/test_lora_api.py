"""Multi-LoRA serving end to end through the official `openai` client (and gRPC): a
configured adapter and one loaded at run time (vLLM's /v1/load_lora_adapter) answer
with transformers + peft's greedy text, /v1/models lists them with their parent, an
unknown model is a 404 naming the known ones, a bad adapter is a 400 at load with the
server undisturbed, and the load/unload endpoints need an admin key (ordinary keys see
adapter names, not directories, in /v1/models)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration import tiny_app

pytestmark = pytest.mark.integration

import openai

APP = "lora-api-test"
MODEL = "kv-tiny-lora"
KEY = "lora-test-key"
ADMIN_KEY = "lora-test-admin-key"  # the operator endpoints' (router/frontend/auth.py admin scope)
ENV = {"KVSERVE_TEST_LORA_KEYS": f"sha256:{hashlib.sha256(KEY.encode()).hexdigest()}",
       "KVSERVE_TEST_LORA_ADMIN_KEYS": ADMIN_KEY}
PROMPT = "The quick brown fox"
MAX_TOKENS = 8


@dataclass
class Api:
    root: str
    grpc_target: str
    model_dir: Path
    adapters: dict[str, Path]
    tokenizer: Any
    adapter_root: Path  # lora.adapter_roots' one directory

    def http(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.root, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=60)

    def expected(self, adapter: str | None) -> str:
        """transformers + peft's greedy continuation of PROMPT, as text."""
        from tests.support.tiny_lora import peft_greedy

        ids = self.tokenizer(PROMPT).input_ids
        (out,) = peft_greedy(self.model_dir, self.adapters[adapter] if adapter else None, [ids], [MAX_TOKENS])
        return self.tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def api(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    from ray import serve
    from transformers import AutoTokenizer

    from tests.support.tiny_lora import make_tiny_adapter
    from tests.support.tiny_served_model import make_served_model

    root = tmp_path_factory.mktemp("lora-api")
    model_dir = make_served_model(root / "tiny")
    adapters = {"sql": make_tiny_adapter(model_dir, root / "sql", 8, seed=1),
                "math": make_tiny_adapter(model_dir, root / "math", 4, ("q_proj", "v_proj"), seed=2)}
    config = tiny_app.tiny_config(APP, model_dir, MODEL, {"api_keys_env": "KVSERVE_TEST_LORA_KEYS",
                                                          "admin_api_keys_env": "KVSERVE_TEST_LORA_ADMIN_KEYS"})
    config = config.with_overrides({"lora.modules": {"sql": str(adapters["sql"])}, "lora.max_loras": 2,
                                    "lora.allow_runtime_updates": True, "lora.adapter_roots": [str(root)]})
    tiny_app.deploy(config, ingress_env=ENV)
    try:
        yield Api(f"{serve_cluster.http_url}/{APP}", f"127.0.0.1:{serve_cluster.grpc_port}", model_dir, adapters,
                  AutoTokenizer.from_pretrained(model_dir), root)
    finally:
        serve.delete(APP)


@pytest.fixture
def client(api: Api) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.root}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_configured_adapter_matches_peft_and_is_listed(api: Api, client: openai.OpenAI) -> None:
    base, sql = _complete(client, MODEL), _complete(client, "sql")
    assert base == api.expected(None) and sql == api.expected("sql")
    assert sql != base
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == "sql"  # no directory to an ordinary key
    with api.http(ADMIN_KEY) as admin:
        roots = {m["id"]: m["root"] for m in admin.get("/v1/models").json()["data"]}
    assert roots["sql"] == str(api.adapters["sql"])


def test_unknown_model_is_404_with_the_list(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope")
    assert f"`{MODEL}`, `sql`" in str(e.value)


def test_load_and_unload_at_run_time(api: Api, client: openai.OpenAI, tmp_path: Path) -> None:
    body = {"lora_name": "math", "lora_path": str(api.adapters["math"])}
    with api.http(key=None) as anonymous:
        assert anonymous.post("/v1/load_lora_adapter", json=body).status_code == 401
    with api.http() as ordinary:
        assert ordinary.post("/v1/load_lora_adapter", json=body).status_code == 403
    with api.http(ADMIN_KEY) as http:
        outside = http.post("/v1/load_lora_adapter", json={"lora_name": "out", "lora_path": str(tmp_path)})
        assert outside.status_code == 400 and str(tmp_path) not in outside.text  # not under adapter_roots
        bad_dir = api.adapter_root / "bad"
        bad_dir.mkdir(exist_ok=True)
        (bad_dir / "adapter_config.json").write_text('{"r": 99, "lora_alpha": 8}')
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad_dir)})
        assert bad.status_code == 400 and "ranks 1..16" in bad.json()["error"]["message"]
        assert str(bad_dir) not in bad.text
        gone = str(api.adapter_root / "gone")
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": gone})
        assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error"]["message"]
        assert _complete(client, "sql") == api.expected("sql")  # undisturbed
        loaded = http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 400  # already loaded
        assert {m.id for m in client.models.list().data} == {MODEL, "sql", "math"}
        assert _complete(client, "math") == api.expected("math")
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "math"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "math"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _complete(client, "math")


def test_grpc_request_names_the_adapter(api: Api) -> None:
    from router.frontend.grpc_api.client import KVServeClient

    with KVServeClient(api.grpc_target, KEY, application=APP, timeout=60) as grpc_client:
        tiny_app.wait_for(lambda: _grpc_ready(grpc_client), "the gRPC proxy to route to the application")
        models = {m.id: m.parent for m in grpc_client.list_models()}
        assert models[MODEL] == "" and models["sql"] == MODEL
        out = grpc_client.generate(PROMPT, model="sql", max_tokens=MAX_TOKENS, temperature=0.0)
        assert out.model == "sql" and out.choices[0].text == api.expected("sql")


def _grpc_ready(grpc_client: Any) -> bool:
    try:
        grpc_client.list_models()
        return True
    except Exception:
        return False
