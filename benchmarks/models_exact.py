"""Greedy exactness of every family the engine serves: benchmarks/models.py's
`families_exact=` figure.

For each family in worker/model/registry.py's table, each of its VARIANTS (tiny random
checkpoints written by transformers itself, from the builders the unit tests use in
tests/support/) runs one fixed set of greedy prompts through the engine in ONE mixed
batch (all requests added at once, a small token budget so that chunked prompt prefills
share steps with other requests' decodes, prefix-cache hits from a shared-prefix pair,
prompts and outputs crossing the sliding windows of the *_swa / gpt-oss / Gemma 3
variants), and compares each request token for token with transformers' greedy
`generate` run on that request alone. A family is exact when every request of every one
of its variants is. A family in the registry with no builder here counts as not exact.
"""
from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VOCAB = 512  # every tiny builder's default vocabulary
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 48  # below the prompts' sum: chunked prefills mix with decodes
PREFIX_LEN = 32

# family -> its checkpoint variants (tests/support builders' names); the first is the one
# the tiny settings run.
VARIANTS: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "llama3"),
    "mistral": ("mistral_swa", "mistral"),
    "qwen2": ("qwen2_swa", "qwen2"),
    "qwen3": ("qwen3",),
    "qwen3_moe": ("qwen3_moe", "qwen3_moe_norm"),
    "mixtral": ("mixtral_swa", "mixtral"),
    "gpt_oss": ("gpt_oss",),
    "deepseek_v3": ("ds_qlora", "ds_qproj", "ds_flat", "ds_yarn"),
    "gemma3": ("gemma3", "gemma3_capped"),
}


def make_checkpoint(variant: str, out: Path) -> Path:
    """Write the named tiny checkpoint to `out` with its test builder."""
    if variant in ("llama", "llama3", "mistral", "mistral_swa", "qwen2", "qwen2_swa", "qwen3"):
        from tests.support.tiny_models import make_tiny_model

        return make_tiny_model(variant, out)
    if variant.startswith(("qwen3_moe", "mixtral", "gpt_oss")):
        from tests.support.tiny_moe import make_tiny_moe

        return make_tiny_moe(variant, out)
    if variant.startswith("ds_"):
        from tests.support.tiny_deepseek import make_tiny_deepseek

        return make_tiny_deepseek(variant, out)
    if variant.startswith("gemma3"):
        from tests.support.tiny_gemma import make_tiny_gemma3  # the gemma branch's builder

        return make_tiny_gemma3(variant, out)
    raise ValueError(f"no tiny checkpoint builder for {variant!r}")


def prompt_set(tiny: bool = False) -> tuple[list[list[int]], list[int]]:
    """Fixed seeded prompts and their max_tokens: lengths around block boundaries, past a
    24-token window, a one-token prompt, and two prompts sharing a PREFIX_LEN prefix."""
    rng = random.Random(46)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]  # 0..2 are pad/bos/eos

    if tiny:
        prompts = [tokens(n) for n in (1, 17, 30)]
        return prompts, [6, 4, 6]
    prompts = [tokens(n) for n in (1, 2, 15, 16, 17, 33, 64, 90)]
    prefix = tokens(PREFIX_LEN)
    prompts += [prefix + tokens(n) for n in (5, 20)]
    return prompts, [32, 1, 12, 16, 24, 20, 40, 28, 16, 24]


@dataclass(frozen=True)
class VariantResult:
    family: str
    variant: str
    num_requests: int
    num_exact: int
    num_tokens: int  # output tokens compared
    detail: str  # the first divergence, or why the variant did not run

    @property
    def exact(self) -> bool:
        return self.num_requests > 0 and self.num_exact == self.num_requests


def engine_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Every prompt added at once to one engine, stepped until all finish."""
    from worker.api import SamplingParams
    from worker.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from worker.engine.build import build_engine

    engine = build_engine(EngineConfig(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=256),
        SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
    ))
    ids = [f"r{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt, n in zip(ids, prompts, max_tokens):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0))
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"engine failed {out.request_id}: {out.error}")
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[rid] for rid in ids]


def check_variant(family: str, variant: str, root: Path, tiny: bool) -> VariantResult:
    from tests.support.tiny_models import hf_greedy

    prompts, max_tokens = prompt_set(tiny)
    try:
        model_dir = make_checkpoint(variant, root / variant)
    except (ImportError, ValueError) as e:
        return VariantResult(family, variant, 0, 0, 0, f"no checkpoint: {e}")
    got = engine_greedy(model_dir, prompts, max_tokens)
    want = hf_greedy(model_dir, prompts, max_tokens)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    detail = ""
    if bad:
        g, w = got[bad[0]], want[bad[0]]
        at = next((k for k, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
        detail = f"request {bad[0]} diverges at output token {at}"
    num_tokens = sum(len(w) for w in want)
    return VariantResult(family, variant, len(prompts), len(prompts) - len(bad), num_tokens, detail)


def is_exact(results: list[VariantResult]) -> bool:
    return bool(results) and all(r.exact for r in results)


def served_families() -> list[str]:
    from worker.model.registry import MODEL_CLASSES

    return list(MODEL_CLASSES)


def families_exact(
    tiny: bool = False, families: list[str] | None = None, log: Callable[[str], None] = print
) -> dict[str, list[VariantResult]]:
    """Each served family's variant results (see the module docstring); `tiny` runs the
    first variant of each family on three short prompts."""
    results: dict[str, list[VariantResult]] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-models-") as tmp:
        for family in families or served_families():
            variants = VARIANTS.get(family, ())
            results[family] = [check_variant(family, v, Path(tmp), tiny) for v in variants[: 1 if tiny else None]]
            if not variants:
                results[family] = [VariantResult(family, "-", 0, 0, 0, "no tiny checkpoint builder")]
            for r in results[family]:
                log(f"  {family:<12} {r.variant:<15} {r.num_exact}/{r.num_requests} requests exact "
                    f"(expected {r.num_requests}/{r.num_requests}), {r.num_tokens} output tokens compared"
                    f"{'; ' + r.detail if r.detail else ''}")
    return results
