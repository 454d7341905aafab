"""What a benchmark asks the server before the run: the models it serves, and how its
tokenizer counts the words prompts are made of (the server has no /tokenize)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cluster.bench.client import get_json, post_json
from cluster.bench.stream import auth_headers, completions_url, error_of, request_body
from cluster.workload.text_prompts import WORDS, BenchRequest, PromptCalibration


async def fetch_models(client: Any, base_url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return list((await get_json(client, base + "/models", auth_headers(api_key))).get("data") or [])


async def calibrate_prompt_tokens(
    client: Any,
    base_url: str,
    model: str,
    endpoint: str = "completions",
    api_key: str | None = None,
    chunk_words: int = 68,
) -> PromptCalibration:
    """What the server's tokenizer makes of the word pool (the server has no /tokenize):
    prompt tokens of every pool word once (in chunks of `chunk_words`, one request each,
    one token out, not streamed) and of the first chunk twice. Prompts draw words
    uniformly from the pool, so the pool's mean is their expected tokens per word; the
    doubled chunk separates the per-prompt overhead (BOS, a chat template)."""
    url = completions_url(base_url, endpoint)
    headers = auth_headers(api_key)

    async def prompt_tokens(words: Sequence[str]) -> int:
        body = request_body(BenchRequest(-1, " ".join(words), len(words), 1), model, endpoint)
        del body["stream"], body["stream_options"]
        status, raw = await post_json(client, url, body, headers)
        if status != 200:
            try:
                code, message = error_of(json.loads(raw))
            except ValueError:
                code, message = None, None
            raise ValueError(f"HTTP {status}" + (f" ({code}: {message})" if code or message else ""))
        return int(json.loads(raw)["usage"]["prompt_tokens"])

    chunks = [WORDS[i : i + chunk_words] for i in range(0, len(WORDS), chunk_words)]
    counts = [await prompt_tokens(chunk) for chunk in chunks]
    overhead = 2 * counts[0] - await prompt_tokens(chunks[0] + chunks[0])
    ratio = (sum(counts) - len(chunks) * overhead) / len(WORDS)
    if ratio <= 0:
        raise ValueError(f"calibration measured {counts} prompt tokens for chunks of {chunk_words} words")
    return PromptCalibration(tokens_per_word=ratio, overhead_tokens=max(0.0, float(overhead)))
