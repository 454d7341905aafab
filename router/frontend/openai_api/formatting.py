"""Engine outputs -> OpenAI response bodies and SSE chunks: the outgoing half of
router/frontend/openai_api/convert.py (which re-exports it). Choices are merged over the engine's
per-choice RequestOutputs; nothing here does I/O."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.frontend.openai_api.sse import SSE_DONE, sse_data  # noqa: F401  (SSE_DONE: convert.py re-exports it)
from router.frontend.openai_api import protocol as p
from router.frontend.openai_api.logprobs import (TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs,
                                                 end_offset, joined_logprobs, prompt_logprobs_body)
from router.frontend.tool_calling import chat_tools
from router.frontend.reasoning.choose import ReasoningFactory
from router.frontend.reasoning.split import ReasoningSplitter
from worker.api import RequestOutput, TokenLogprob


# -- engine outputs -> bodies -------------------------------------------------------------
@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # from the first output

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, out: RequestOutput) -> None:
        if out.text_delta:
            self.text_parts.append(out.text_delta)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def usage_of(states: list[ChoiceState], prompt_lengths: list[int]) -> p.Usage:
    prompt_tokens = sum(prompt_lengths)
    completion_tokens = sum(s.num_output_tokens for s in states)
    cached: dict[int, int] = {}
    for s in states:
        cached[s.prompt_index] = max(cached.get(s.prompt_index, 0), s.num_cached_tokens)
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(cached.values())),
    )


class _Formatter:
    """What both endpoints' formatters share: the response's identity and what was asked."""

    def __init__(
        self, request_id: str, model: str, texts: TokenTexts, want_logprobs: bool, prompt_logprobs: int | None
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.texts = texts
        self.want_logprobs = want_logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's k, None when not asked

    def _plain_event(self, obj: str, choice: dict[str, Any], out: RequestOutput) -> str:
        """sse() of a chunk with one choice and no logprobs, built as the dict sse() would
        make of it (same keys, same order): a stream's every chunk, without building and
        dumping its models."""
        if out.finished:
            if out.finish_reason is not None:
                choice["finish_reason"] = out.finish_reason
            if out.stop_reason is not None:
                choice["stop_reason"] = out.stop_reason
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        return sse_data(body)


class CompletionFormatter(_Formatter):
    """Builds /v1/completions bodies and chunks."""

    def __init__(
        self, request_id: str, model: str, texts: TokenTexts, want_logprobs: bool, prompt_logprobs: int | None = None
    ) -> None:
        super().__init__(request_id, model, texts, want_logprobs, prompt_logprobs)
        self._offsets: dict[int, int] = {}
        # echo: each choice's prompt text, by choice index (OpenAI's `echo` puts it before
        # the completion; streamed as the choice's first chunk, as vLLM does).
        self.echo: dict[int, str] = {}
        # echo + logprobs: each choice's prompt ids and the top-k its echoed tokens carry.
        self.echo_token_ids: dict[int, list[int]] = {}
        self.echo_k = 0

    def set_echo(self, texts: dict[int, str], prompt_token_ids: dict[int, list[int]], logprobs: int | None) -> None:
        self.echo = texts
        if logprobs is not None:
            self.echo_token_ids, self.echo_k = prompt_token_ids, logprobs

    def start_chunks(self, indices: list[int]) -> list[p.BaseModel]:
        # With logprobs the echo waits for the first output: its logprobs come with it.
        return [
            p.CompletionChunk(id=self.request_id, created=self.created, model=self.model,
                              choices=[p.CompletionChoice(index=i, text=self.echo[i])])
            for i in indices if self.echo.get(i) and i not in self.echo_token_ids
        ]

    def _echoed(self, index: int, entries: list[TokenLogprob | None] | None) -> p.CompletionLogprobs:
        ids = self.echo_token_ids[index]
        return echo_logprobs(ids, entries or [None] * len(ids), self.texts, self.echo_k)

    def delta_event(self, index: int, out: RequestOutput) -> str | None:
        """sse(delta_chunk(index, out)), or None when there is no chunk."""
        if self.want_logprobs:
            chunk = self.delta_chunk(index, out)
            return None if chunk is None else sse(chunk)
        if not out.text_delta and not out.finished:
            return None
        return self._plain_event("text_completion", {"index": index, "text": out.text_delta}, out)

    def delta_chunk(self, index: int, out: RequestOutput) -> p.CompletionChunk | None:
        if not out.text_delta and not out.finished and not (self.want_logprobs and out.logprobs):
            return None
        logprobs = None
        text = out.text_delta
        if self.want_logprobs:
            first = index not in self._offsets
            prefix = self._echoed(index, out.prompt_logprobs) if first and index in self.echo_token_ids else None
            # As vLLM: offsets run on over the echoed tokens' texts.
            offset = self._offsets.get(index, end_offset(prefix) if prefix is not None else 0)
            logprobs = completion_logprobs(out.logprobs or [], self.texts, offset)
            self._offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
            if prefix is not None:
                logprobs, text = joined_logprobs(prefix, logprobs), self.echo[index] + text
        choice = p.CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None,
        )
        return p.CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, state: ChoiceState) -> p.CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        if state.index not in self.echo_token_ids:
            return completion_logprobs(state.logprobs, self.texts, 0)
        echoed = self._echoed(state.index, state.prompt_logprobs)
        return joined_logprobs(echoed, completion_logprobs(state.logprobs, self.texts, end_offset(echoed)))

    def usage_chunk(self, usage: p.Usage) -> p.CompletionChunk:
        return p.CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, states: list[ChoiceState], usage: p.Usage) -> p.CompletionResponse:
        choices = [
            p.CompletionChoice(
                index=s.index,
                text=self.echo.get(s.index, "") + s.text,
                logprobs=self._logprobs(s),
                prompt_logprobs=prompt_logprobs_body(s.prompt_logprobs, self.texts, self.prompt_logprobs),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in sorted(states, key=lambda s: s.index)
        ]
        return p.CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)


class ChatFormatter(_Formatter):
    """Builds /v1/chat/completions bodies and chunks."""

    def __init__(
        self, request_id: str, model: str, texts: TokenTexts, want_logprobs: bool, tool_mode: chat_tools.ToolMode | None = None,
        prompt_logprobs: int | None = None, reasoning: ReasoningFactory | None = None,
    ) -> None:
        super().__init__(request_id, model, texts, want_logprobs, prompt_logprobs)
        # Tool calling: one parser per streamed choice (it counts the calls it has sent).
        self.tool_mode = tool_mode
        self._parsers: dict[int, chat_tools.ToolParser] = {}
        # Reasoning (router/frontend/reasoning/): split off first; the rest sees the content only.
        self._reasoning = ReasoningSplitter(reasoning) if reasoning is not None else None

    def _chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def start_chunks(self, indices: list[int]) -> list[p.BaseModel]:
        """OpenAI opens each choice with a delta that carries only the role."""
        return [self._chunk([p.ChatChunkChoice(index=i, delta=p.ChatDelta(role="assistant", content=""))]) for i in indices]

    def delta_event(self, index: int, out: RequestOutput) -> str | None:
        """sse(delta_chunk(index, out)), or None when there is no chunk."""
        if self.want_logprobs or self.tool_mode is not None or self._reasoning is not None:
            chunk = self.delta_chunk(index, out)
            return None if chunk is None else sse(chunk)
        if not out.text_delta and not out.finished:
            return None
        delta = {"content": out.text_delta} if out.text_delta or not out.finished else {}
        return self._plain_event("chat.completion.chunk", {"index": index, "delta": delta}, out)

    def delta_chunk(self, index: int, out: RequestOutput) -> p.ChatCompletionChunk | None:
        if self._reasoning is None:
            return self._content_chunk(index, out)
        out, reasoning = self._reasoning.split(index, out)
        chunk = self._content_chunk(index, out)
        if reasoning and chunk is None:
            chunk = self._chunk([p.ChatChunkChoice(index=index, delta=p.ChatDelta())])
        if reasoning and chunk is not None:
            chunk.choices[0].delta.reasoning_content = reasoning
        return chunk

    def _content_chunk(self, index: int, out: RequestOutput) -> p.ChatCompletionChunk | None:
        if self.tool_mode is not None:
            return self._tool_delta_chunk(index, out)
        if not out.text_delta and not out.finished and not (self.want_logprobs and out.logprobs):
            return None
        choice = p.ChatChunkChoice(
            index=index,
            delta=p.ChatDelta(content=out.text_delta) if out.text_delta or not out.finished else p.ChatDelta(),
            logprobs=chat_logprobs(out.logprobs or [], self.texts) if self.want_logprobs else None,
            finish_reason=out.finish_reason if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None,
        )
        return self._chunk([choice])

    def _tool_delta_chunk(self, index: int, out: RequestOutput) -> p.ChatCompletionChunk | None:
        """Text flows as content until a call may start; complete calls go out as
        tool_calls deltas; finish_reason "tool_calls" when the choice made any."""
        assert self.tool_mode is not None
        parser = self._parsers.setdefault(index, self.tool_mode.new_parser())
        content, calls = parser.stream(out.text_delta) if out.text_delta else ("", [])
        if out.finished:
            rest, more = parser.stream_end()
            content, calls = content + rest, calls + more
        tool_calls = chat_tools.delta_tool_calls(calls)
        want_logprobs = self.want_logprobs and bool(out.logprobs)
        if not content and not tool_calls and not out.finished and not want_logprobs:
            return None
        finish_reason = out.finish_reason if out.finished else None
        if finish_reason == "stop" and parser.num_streamed_calls:
            finish_reason = self.tool_mode.finish_reason
        delta = p.ChatDelta(content=content or None, tool_calls=tool_calls or None)
        choice = p.ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=chat_logprobs(out.logprobs or [], self.texts) if self.want_logprobs else None,
            finish_reason=finish_reason,
            stop_reason=out.stop_reason if out.finished else None,
        )
        return self._chunk([choice])

    def _message(self, state: ChoiceState) -> tuple[p.ChatResponseMessage, str | None]:
        reasoning, text = self._reasoning.split_whole(state.text) if self._reasoning is not None else (None, state.text)
        if self.tool_mode is None:
            return p.ChatResponseMessage(content=text, reasoning_content=reasoning), state.finish_reason
        content, calls = self.tool_mode.new_parser().parse(text)
        if not calls:
            return p.ChatResponseMessage(content=content, reasoning_content=reasoning), state.finish_reason
        reason = self.tool_mode.finish_reason if state.finish_reason == "stop" else state.finish_reason
        return p.ChatResponseMessage(content=content or None, tool_calls=chat_tools.tool_calls_of(calls),
                                     reasoning_content=reasoning), reason

    def usage_chunk(self, usage: p.Usage) -> p.ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, states: list[ChoiceState], usage: p.Usage) -> p.ChatCompletionResponse:
        choices = []
        for s in sorted(states, key=lambda s: s.index):
            message, finish_reason = self._message(s)
            choices.append(p.ChatChoice(
                index=s.index,
                message=message,
                logprobs=chat_logprobs(s.logprobs, self.texts) if self.want_logprobs else None,
                finish_reason=finish_reason,
                stop_reason=s.stop_reason,
            ))
        # One prompt for every choice: vLLM puts its logprobs at the top level.
        prompt = next((s.prompt_logprobs for s in states if s.prompt_logprobs is not None), None)
        return p.ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs_body(prompt, self.texts, self.prompt_logprobs),
        )


def sse(obj: p.BaseModel | dict[str, Any]) -> str:
    """One server-sent event. Chunks leave out null fields as OpenAI's stream does, except
    a choice's `finish_reason` and `logprobs`, which OpenAI always sends."""
    if isinstance(obj, p.BaseModel):
        data = obj.model_dump(exclude_none=True)
        for choice in data.get("choices", ()):
            choice.setdefault("logprobs", None)
            choice.setdefault("finish_reason", None)
        obj = data
    return sse_data(obj)


