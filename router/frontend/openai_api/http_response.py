"""A started generation stream as OpenAI's HTTP response: server-sent events while it
runs, or one JSON body once it has finished. The formatter (router/frontend/openai_api/convert.py)
builds each chunk; this file decides only how they travel and where usage goes.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from router import errors
from router.frontend.openai_api import convert as convert
from router.frontend.openai_api import protocol as p
from router.frontend.generation import GenerationStream

logger = logging.getLogger(__name__)


async def respond(
    stream: GenerationStream,
    formatter: convert.CompletionFormatter | convert.ChatFormatter,
    req: p.CompletionRequest | p.ChatCompletionRequest,
) -> Response:
    """The started stream as server-sent events, or, once it has finished, one JSON body."""
    prompt_lengths = _prompt_lengths(stream.inputs)
    if req.stream:
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        events = _sse_events(stream, formatter, prompt_lengths, req.include_usage, continuous)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in stream.inputs}
    async for event in stream:  # closes (and settles) the stream when done or on error
        states[event.index].add(event.output)
    usage = convert.usage_of(list(states.values()), prompt_lengths)
    return JSONResponse(formatter.response(list(states.values()), usage).model_dump())


def echo_texts(prompt: Any, inputs: list[convert.EngineInput], tokenizer: Any) -> dict[int, str]:
    """Each choice's prompt as text for `echo`: a text prompt as sent, token ids decoded."""
    texts = [prompt] if isinstance(prompt, str) else list(prompt) if all(isinstance(x, str) for x in prompt) else None
    return {
        inp.index: texts[inp.prompt_index] if texts is not None else tokenizer.decode(inp.prompt_token_ids)
        for inp in inputs
    }


def _prompt_lengths(inputs: list[convert.EngineInput]) -> list[int]:
    lengths: dict[int, int] = {}
    for inp in inputs:
        lengths[inp.prompt_index] = len(inp.prompt_token_ids)
    return list(lengths.values())


async def _sse_events(
    stream: GenerationStream,
    formatter: convert.CompletionFormatter | convert.ChatFormatter,
    prompt_lengths: list[int],
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    """`data: {chunk}` events, an optional usage chunk, then `data: [DONE]`. An error
    after the first token can only be reported in the stream: an error event, then DONE."""
    states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in stream.inputs}
    try:
        for chunk in formatter.start_chunks(sorted(states)):
            yield convert.sse(chunk)
        async for event in stream:
            states[event.index].add(event.output)
            if include_usage and continuous_usage:
                chunk = formatter.delta_chunk(event.index, event.output)
                if chunk is not None:
                    chunk.usage = convert.usage_of(list(states.values()), prompt_lengths)
                    yield convert.sse(chunk)
                continue
            text = formatter.delta_event(event.index, event.output)
            if text is not None:
                yield text
        if include_usage:
            yield convert.sse(formatter.usage_chunk(convert.usage_of(list(states.values()), prompt_lengths)))
    except errors.APIError as e:
        yield convert.sse(e.body())
    except Exception as e:  # a bug: still end the stream in a way clients understand
        logger.exception("stream %s failed", stream.request_id)
        yield convert.sse(errors.internal(f"The request failed: {type(e).__name__}.").body())
    finally:
        stream.close()  # also on client disconnect (this generator is cancelled): settles
    yield convert.SSE_DONE
