"""Cold start of a worker replica: what its start-up costs, phase by phase, what a second
replica on the same node saves by reading the weights from the page cache, and what a
request to a pool at zero waits for its first token on a real local Serve cluster.

    python -m benchmarks.cold_start [--big-mb 300] [--no-serve]

1. Phases: a fresh process builds the engine as a replica does (build_engine, timed where it
   calls each piece, then AsyncEngine.from_config's tokenizer): imports (torch,
   transformers' auto classes, the engine), config (config.json through AutoConfig),
   weights (worker/model/loader.py's load_model), the rest of the runner (KV allocation,
   CUDA graphs where present), the rest of the engine, the tokenizer; ready there, with the
   structured-output tokenizer's build started in the background (GrammarCompiler.prewarm);
   then the first request's first token and a second request's, then the first grammar
   request's wait for its compiled matcher and a second one's.
2. A checkpoint of about --big-mb MB written by transformers with random weights and a
   128k-token byte-level BPE (deleted afterwards), three fresh processes:
     cold:   the files' pages evicted first (posix_fadvise DONTNEED: a node's first
             replica), no prewarm;
     before: pages cached (a second replica on the node: safetensors mmaps the files), no
             prewarm: the first grammar request builds the structured-output tokenizer
             (loading the tokenizer again, as the compiler did);
     after:  pages cached, the grammar tokenizer built from the replica's tokenizer in the
             background from the moment the replica is ready (not waited for).
   cold vs before: what the page cache saves; before vs after: what the background build
   costs the first plain requests (they share the GIL with it) and saves the first
   grammar request (the rest of the build, not all of it, and no second tokenizer load). A raw read of the files after eviction
   and again shows that the eviction takes effect.
3. Serve: kvserve's app (cluster/app.py's build_app) on a new local Ray cluster, the
   default model on CPU, its pool at zero replicas (scale_to_zero); the time from a
   streamed request to its first token (the ingress holds it while Serve starts the
   replica), then a second request's on the warm pool.

Last line: RESULT cold_start_phases_s=... serve_zero_to_first_token_s=... (see main).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINE = {"device": "cpu", "dtype": "float32", "num_threads": 1, "num_blocks": 64, "block_size": 16,
          "max_model_len": 512, "max_num_seqs": 4}
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
SCHEMA_2 = '{"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}'


def evict(path: Path) -> None:
    """Drop the checkpoint files' pages from the page cache (clean pages only: written
    files are synced first)."""
    for file in sorted(path.glob("*.safetensors")):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_s(path: Path) -> float:
    """Seconds to read the checkpoint files' bytes (1 MiB reads): the I/O under the weights' load."""
    t = time.perf_counter()
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - t


def child(model_path: str, do_evict: bool, first_token: bool, lazy_grammar: bool = False) -> dict[str, float]:
    """Build the engine as a replica does, each phase timed; run in a fresh process."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 -- the imports are the phase
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401 -- lazy modules: imported on first access

    from worker.structured.grammar import llguidance_module

    import worker.engine.build as build
    import worker.runner.model_runner as model_runner
    from cluster.config import KVServeConfig
    from worker.api import load_tokenizer
    from worker.engine.async_engine import AsyncEngine
    from worker.structured.compiler import GrammarCompiler

    llguidance_module()  # a grammar's imports: the two compiles below compare the tokenizer's build only
    out: dict[str, float] = {"imports": time.perf_counter() - t0}
    if do_evict:
        evict(Path(model_path))
    config = KVServeConfig.from_dict({"model": {"path": model_path}, "engine": ENGINE}).engine_config()
    timed = _instrument(build, model_runner, out)
    t = time.perf_counter()
    engine = build.build_engine(config)
    engine_total = time.perf_counter() - t
    out["runner_rest"] = timed["runner"] - out["weights"]  # KV allocation, CUDA graphs where present
    out["engine_rest"] = engine_total - timed["runner"] - out["config"]
    t = time.perf_counter()
    tokenizer = load_tokenizer(engine.model_path, False)  # AsyncEngine.from_config's
    out["tokenizer"] = time.perf_counter() - t
    compiler = engine.compiles.compiler
    if lazy_grammar:  # as before: a compiler of its own, as the replica had (it loads the tokenizer again)
        compiler = GrammarCompiler.for_model_path(engine.model_path, config_vocab(engine.model_path))
    else:  # from_config starts the build from the replica's tokenizer and does not wait for it
        compiler.prewarm(tokenizer)
    if not first_token:
        return out
    # The replica is ready here: two plain requests at once (with the background build, they
    # share the GIL with it), then the first grammar request, which waits for the rest of
    # the build (lazily: the whole build), then one more once the build is surely done.
    out["first_token"], out["second_request_first_token"] = _first_tokens(AsyncEngine(engine, tokenizer))
    out["grammar_first_compile_lazy" if lazy_grammar else "grammar_first_compile"] = _first_compile(compiler)
    out["grammar_second_compile"] = _first_compile(compiler, SCHEMA_2)
    return out


def config_vocab(path: Any) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def _instrument(build: Any, model_runner: Any, out: dict[str, float]) -> dict[str, float]:
    """Time load_hf_config, load_model and ModelRunner.__init__ where build_engine calls them."""
    timed: dict[str, float] = {}

    def timing(fn: Any, key: str, into: dict[str, float]) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into[key] = into.get(key, 0.0) + time.perf_counter() - t
        return wrapper

    build.load_hf_config = timing(build.load_hf_config, "config", out)
    model_runner.load_model = timing(model_runner.load_model, "weights", out)
    model_runner.ModelRunner.__init__ = timing(model_runner.ModelRunner.__init__, "runner", timed)
    return timed


def _first_tokens(engine: Any) -> tuple[float, float]:
    import asyncio

    from worker.api import SamplingParams

    async def ttft(prompt: list[int]) -> float:
        t = time.perf_counter()
        async for out in engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0)):
            if out.new_token_ids:
                return time.perf_counter() - t
        raise RuntimeError("no token")

    async def both() -> tuple[float, float]:
        try:
            return await ttft([5, 6, 7, 8, 9, 10, 11, 12]), await ttft([13, 14, 15, 16, 17, 18, 19, 20])
        finally:
            engine.shutdown()

    return asyncio.run(both())


def _first_compile(compiler: Any, schema: str = SCHEMA) -> float:
    """A grammar request's wait for its compiled matcher."""
    from worker.sampling_params import StructuredOutput

    t = time.perf_counter()
    compiler.submit(StructuredOutput("json_schema", schema)).result(timeout=120)
    return time.perf_counter() - t


def run_child(model_path: str, do_evict: bool, first_token: bool, lazy_grammar: bool = False) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.cold_start", "--child", model_path]
    cmd += ["--evict"] if do_evict else []
    cmd += ["--first-token"] if first_token else []
    cmd += ["--lazy-grammar"] if lazy_grammar else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_big_checkpoint(out: Path, megabytes: int, vocab_size: int = 128_256) -> Path:
    """A Llama of about `megabytes` MB in bfloat16 with random weights, saved by
    transformers (safetensors), and a byte-level BPE tokenizer of `vocab_size` tokens (a
    Llama 3 sized vocabulary: what the structured-output tokenizer is built from)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = write_tokenizer(out, vocab_size)
    hidden = 512
    per_layer = 4 * hidden * hidden + 3 * hidden * 1408
    layers = max(int((megabytes * 1e6 / 2 - 2 * vocab * hidden) / per_layer), 1)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=1408, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> int:
    """A byte-level BPE of `vocab_size` tokens, its merges drawn at random (no corpus to
    train on here); returns its size."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokens, merges, rng = [t for t in vocab if len(t) == 1], [], random.Random(0)
    while len(vocab) < vocab_size:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a) + len(b) > 10 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        tokens.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return len(vocab)


def serve_zero_to_first_token() -> tuple[float, float]:
    """kvserve's app on a new local Ray cluster, its pool at zero: (first token of a request
    that finds no replica, first token of the next one)."""
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.app import build_app
    from cluster.config import KVServeConfig
    from cluster.local_ray import start_local_ray
    from tests.integration.conftest import free_port

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port = free_port()
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "RAY_AUTH_MODE": "disabled"}})
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    config = KVServeConfig.from_dict({
        "engine": ENGINE, "ingress": {"num_cpus": 0.5},
        "workers": {"num_cpus": 1, "autoscaling": {
            "min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "scale_to_zero": True,
            "upscale_delay_s": 0.0, "downscale_delay_s": 60.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}},
    })
    serve.run(build_app(config), name="cold", route_prefix="/")
    try:
        # Nothing has asked the pool yet (not even for the model's facts): the first
        # request is what starts its replica.
        model = config.model.resolved_name()
        return _stream_ttft(port, model), _stream_ttft(port, model)
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()


def _stream_ttft(port: int, model: str) -> float:
    import httpx

    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "stream": True}
    t = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t
    raise RuntimeError("no token streamed")


def start_s(phases: dict[str, float]) -> float:
    """A replica's start until its first token: every phase but the later requests'."""
    return sum(v for k, v in phases.items() if k != "second_request_first_token" and not k.startswith("grammar_"))


def _print_phases(title: str, phases: dict[str, float]) -> None:
    print(f"{title}:")
    for name, seconds in phases.items():
        print(f"  {name:34s} {seconds:8.3f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--evict", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-token", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lazy-grammar", action="store_true", help=argparse.SUPPRESS)  # no prewarm (as before)
    parser.add_argument("--big-mb", type=int, default=300, help="size of the page-cache checkpoint")
    parser.add_argument("--no-serve", action="store_true", help="skip the Serve measurement")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.evict, args.first_token, args.lazy_grammar)))
        return
    from worker.default_model import default_model_path

    phases = run_child(default_model_path(), do_evict=False, first_token=True)
    _print_phases("replica start, the embedded default model, fresh process (CPU)", phases)
    with tempfile.TemporaryDirectory(prefix="kvserve-cold-") as tmp:
        t = time.perf_counter()
        big = write_big_checkpoint(Path(tmp) / "big", args.big_mb)
        size_mb = sum(f.stat().st_size for f in big.glob("*.safetensors")) / 1e6
        print(f"checkpoint: {size_mb:.0f} MB of safetensors, vocabulary {config_vocab(big)}, "
              f"written in {time.perf_counter() - t:.1f} s")
        evict(big)  # the eviction works here (a read after it is a disk read) and the cache serves the next
        read_cold, read_cached = raw_read_s(big), raw_read_s(big)
        print(f"raw read of the files: {read_cold:.3f} s after eviction, {read_cached:.3f} s from the page cache")
        cold = run_child(str(big), do_evict=True, first_token=True, lazy_grammar=True)
        before = run_child(str(big), do_evict=False, first_token=True, lazy_grammar=True)
        after = run_child(str(big), do_evict=False, first_token=True)
    _print_phases(f"first replica on the node ({size_mb:.0f} MB, pages evicted; no prewarm)", cold)
    _print_phases(f"second replica on the node ({size_mb:.0f} MB, page cache; no prewarm: before)", before)
    _print_phases(f"second replica on the node ({size_mb:.0f} MB, page cache; grammar tokenizer built in the "
                  "background from ready: after)", after)
    zero_ttft = warm_ttft = float("nan")
    if not args.no_serve:
        zero_ttft, warm_ttft = serve_zero_to_first_token()
        print(f"serve: request to a pool at zero -> first token {zero_ttft:.2f} s; "
              f"next request on the warm pool {warm_ttft:.3f} s")
    start = start_s(phases)
    print(f"RESULT cold_start_phases_s={start:.2f} serve_zero_to_first_token_s={zero_ttft:.2f} "
          f"serve_warm_first_token_s={warm_ttft:.3f} weights_cold_s={cold['weights']:.2f} "
          f"weights_page_cache_s={before['weights']:.2f} checkpoint_mb={size_mb:.0f} "
          f"start_before_s={start_s(before):.2f} start_after_s={start_s(after):.2f} "
          f"raw_read_cold_s={read_cold:.3f} raw_read_cached_s={read_cached:.3f} "
          f"first_token_before_s={before['first_token']:.3f} first_token_after_s={after['first_token']:.3f} "
          f"grammar_first_compile_lazy_s={before['grammar_first_compile_lazy']:.3f} "
          f"grammar_first_compile_background_s={after['grammar_first_compile']:.3f} "
          f"grammar_second_compile_s={after['grammar_second_compile']:.3f}")


if __name__ == "__main__":
    main()
