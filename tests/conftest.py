"""Shared test fixtures: tiny Llama-family checkpoints (built once per session), a cached
transformers reference, and a helper that steps the synchronous engine to completion.

Nothing here starts Ray; integration tests bring their own fixtures.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.support.redis_server import REDIS_SERVER, RedisServer
from worker.engine.core import Engine
from worker.api import RequestOutput
from worker.api import SamplingParams

# The test models are tiny (hidden 64, 2 layers): one intra-op thread is several times
# faster than two on a shared 2-core machine (spinning workers fight for the cores), and
# it keeps the numerics of the engine and the reference on the same code paths.
torch.set_num_threads(1)

TINY_FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")


class TinyModels:
    """Builds each tiny family's checkpoint on first use, once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def __call__(self, family: str) -> Path:
        from tests.support.tiny_models import make_tiny_model

        with self._lock:
            if family not in self._dirs:
                self._dirs[family] = make_tiny_model(family, self.root / family)
            return self._dirs[family]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """`tiny_model(family) -> Path`: a tiny random checkpoint written by transformers."""
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: TinyModels) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model: TinyModels) -> Path:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model: TinyModels) -> Path:
    return tiny_model("qwen3")


class HFReference:
    """transformers' greedy `generate` (fp32, one request at a time), memoised per
    (family, prompt, max_tokens) so that each reference is computed once per session."""

    def __init__(self, models: TinyModels) -> None:
        self.models = models
        self._cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def __call__(
        self, family: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]
    ) -> list[list[int]]:
        from tests.support.tiny_models import hf_greedy

        keys = [(family, tuple(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
        missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
        if missing:
            outs = hf_greedy(self.models(family), [list(k[1]) for k in missing], [k[2] for k in missing])
            self._cache.update(zip(missing, outs))
        return [list(self._cache[k]) for k in keys]


@pytest.fixture(scope="session")
def hf_reference(tiny_model: TinyModels) -> HFReference:
    """`hf_reference(family, prompts, max_tokens) -> list[list[int]]` (cached)."""
    return HFReference(tiny_model)


_MULTINODE = Path(__file__).resolve().parent / "multinode"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/multinode builds its own multi-node Ray cluster, and a driver can be connected
    to one cluster only: it runs as its own pytest invocation (scripts/test.sh runs both),
    collected only when the command line points into it."""
    if collection_path != _MULTINODE:
        return None
    for arg in config.args:
        target = Path(arg.split("::", 1)[0]).resolve()
        if target == _MULTINODE or _MULTINODE in target.parents:
            return None
    return True


def run_engine(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params_list: Sequence[SamplingParams] | SamplingParams,
    request_ids: Sequence[str] | None = None,
    final_outputs: dict[str, RequestOutput] | None = None,
    max_steps: int = 100_000,
) -> dict[str, list[int]]:
    """Add every prompt (ids "0", "1", ... unless given) and step the synchronous engine
    until nothing is left. Returns the output token ids per request id; the last output
    of each request goes into `final_outputs` when one is passed."""
    if isinstance(params_list, SamplingParams):
        params_list = [params_list] * len(prompts)
    ids = list(request_ids) if request_ids is not None else [str(i) for i in range(len(prompts))]
    assert len(ids) == len(prompts) == len(params_list)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt, params in zip(ids, prompts, params_list):
        engine.add_request(rid, list(prompt), params)
    finished: set[str] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id not in tokens:
                continue  # a request added by someone else
            assert out.request_id not in finished, f"output after finish for {out.request_id}"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
                if final_outputs is not None:
                    final_outputs[out.request_id] = out
    else:
        raise AssertionError(f"the engine did not finish within {max_steps} steps")
    assert finished == set(ids), f"unfinished: {sorted(set(ids) - finished)}"
    return tokens


@pytest.fixture(name="run_engine")
def run_engine_fixture() -> Callable[..., dict[str, list[int]]]:
    """The `run_engine` helper, as a fixture (tests do not import conftest)."""
    return run_engine


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the whole session (tests/support/redis_server.py).
    A test that stops it starts it again. Skipped only when the binary is missing (CI
    installs it: scripts/test.sh)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- CI: a full run skips only what needs a GPU ---------------------------------------------
# With KVSERVE_CI=1 (scripts/test.sh) any skipped test not marked `gpu` fails the session:
# a missing tool (redis-server, the Helm venv) or a broken install must not turn into a
# quiet skip. pyproject's `-rs` lists every skip with its reason either way.
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import os

    if os.environ.get("KVSERVE_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    not_gpu = [r for r in skipped if "gpu" not in getattr(r, "keywords", {})]
    if not not_gpu:
        return
    lines = [f"  {r.nodeid}: {r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr}" for r in not_gpu]
    reporter.write_line("KVSERVE_CI=1: only tests marked `gpu` may skip; these skipped:\n" + "\n".join(lines), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
