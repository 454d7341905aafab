"""Engine logprobs -> OpenAI's logprob bodies: the legacy completion lists (with echo),
chat's per-token content, and vLLM's prompt logprobs; token texts cached per tokenizer."""
from __future__ import annotations

from typing import Any

from router.frontend.openai_api import protocol as p
from worker.api import TokenLogprob


class TokenTexts:
    """Token id -> its text, cached (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int) -> p.CompletionLogprobs:
    """OpenAI's legacy shape: parallel lists; `text_offset` counts from the choice's start."""
    out = p.CompletionLogprobs()
    for entry in entries:
        token = texts(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({texts(t): lp for t, lp in entry.top} if entry.top else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def prompt_logprobs_body(entries: list[TokenLogprob | None] | None, texts: TokenTexts, k: int | None) -> p.PromptLogprobs | None:
    """vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}} with the
    token itself and its top-k (the engine may have computed more; cut to this use's k)."""
    if entries is None or k is None:
        return None
    body: p.PromptLogprobs = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        row = {str(entry.token_id): p.PromptLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=texts(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1):
            row[str(token_id)] = p.PromptLogprob(logprob=logprob, rank=rank, decoded_token=texts(token_id))
        body.append(row)
    return body


def echo_logprobs(
    prompt_token_ids: list[int], entries: list[TokenLogprob | None], texts: TokenTexts, k: int
) -> p.CompletionLogprobs:
    """OpenAI's echo + logprobs: the prompt's tokens lead the legacy lists, the first
    with a null logprob (nothing precedes it); offsets count from the prompt's start."""
    out = p.CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_token_ids, entries):
        token = texts(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob if entry is not None else None)
        out.top_logprobs.append({texts(t): lp for t, lp in entry.top[:k]} if entry is not None and k else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def joined_logprobs(first: p.CompletionLogprobs, second: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def end_offset(logprobs: p.CompletionLogprobs) -> int:
    """The text offset just past the last token."""
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else 0


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> p.ChatLogprobs:
    content = []
    for entry in entries:
        token = texts(entry.token_id)
        content.append(
            p.TokenLogprobContent(
                token=token,
                logprob=entry.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    p.TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode())) for t, lp in entry.top
                ],
            )
        )
    return p.ChatLogprobs(content=content)
