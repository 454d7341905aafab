"""One chat-completions call on the request pipeline, for the API front ends that
translate onto chat (router/frontend/responses_api/, router/frontend/messages_api/): start
it as /v1/chat/completions does, and read it back whole or chunk by chunk."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.frontend.generation import GenerationStream
from router.frontend.openai_api import convert
from router.frontend.openai_api import protocol as p
from router.frontend.openai_api.structured import has_grammar
from router.frontend.pipeline import RequestPipeline
from router.frontend.auth import Principal
from router.frontend.tool_calling.chat_tools import tool_mode
from router.frontend.reasoning.choose import reasoning_factory


@dataclass(frozen=True)
class ChatCall:
    stream: GenerationStream
    formatter: convert.ChatFormatter

    async def whole(self) -> tuple[p.ChatCompletionResponse, p.Usage]:
        """The finished answer (the stream closes, and settles, when done or on error)."""
        states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in self.stream.inputs}
        async for event in self.stream:
            states[event.index].add(event.output)
        usage = self.usage(list(states.values()))
        return self.formatter.response(list(states.values()), usage), usage

    async def chunks(self) -> AsyncIterator[tuple[p.ChatCompletionChunk | None, str | None, convert.ChoiceState]]:
        """(chat chunk or None, finish reason once finished, the choice's state so far) per
        engine output. The caller closes the stream (self.stream.close()) when it stops."""
        states = {inp.index: convert.ChoiceState(inp.index, inp.prompt_index) for inp in self.stream.inputs}
        async for event in self.stream:
            state = states[event.index]
            state.add(event.output)
            chunk = self.formatter.delta_chunk(event.index, event.output)
            finish = chunk.choices[0].finish_reason if chunk is not None and chunk.choices else None
            yield chunk, finish, state

    def usage(self, states: list[convert.ChoiceState]) -> p.Usage:
        return convert.usage_of(states, [len(self.stream.inputs[0].prompt_token_ids)])


async def start_chat(
    pipeline: RequestPipeline, principal: Principal, req: p.ChatCompletionRequest, num_bytes: int,
    arrival: float, session_id: str | None, model_name: str,
) -> ChatCall:
    """Admit, tokenize (the chat template), charge and start `req` as the chat endpoint does."""
    tokenizer, max_n, parser = pipeline.tokenizer, pipeline.settings.max_n, pipeline.settings.tool_call_parser
    await pipeline.lora.refresh(req.model)  # the cluster's run-time adapters
    lora = pipeline.lora.resolve(req.model)
    stream = await pipeline.start(
        principal, req.n, num_bytes,
        lambda max_model_len: convert.chat_inputs(req, tokenizer, max_model_len, max_n, parser,
                                                  pipeline.settings.reasoning_parser),
        f"chatcmpl-{uuid.uuid4().hex}", arrival, session_id,
        stream=req.stream, lora=lora, offload=has_grammar(req), priority=req.priority,
    )
    mode = tool_mode(req, parser, getattr(tokenizer, "chat_template", None))
    # A grammar-held output (structured, a forced call) is all answer: nothing to split.
    reasoning = None if has_grammar(req) else reasoning_factory(pipeline.settings.reasoning_parser, tokenizer,
                                                                stream.inputs[0].prompt_token_ids)
    formatter = convert.ChatFormatter(stream.request_id, lora[0] if lora is not None else model_name,
                                      pipeline.texts, req.logprobs, mode, req.prompt_logprobs, reasoning)
    return ChatCall(stream, formatter)
