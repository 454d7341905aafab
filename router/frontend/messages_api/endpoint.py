"""POST /v1/messages and /v1/messages/count_tokens: read the body, run the conversation as
a chat completion (router/frontend/openai_api/chat_call.py), answer as an Anthropic Message,
whole or streamed. Every error leaves in Anthropic's shape (router/frontend/messages_api/errors.py).
The API key comes as `x-api-key` (Anthropic's header) or as the bearer token."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from router import errors
from router.frontend.auth import Principal
from router.frontend.messages_api import translate as t
from router.frontend.messages_api.errors import error_body
from router.frontend.messages_api.events import MessageEvents, event
from router.frontend.messages_api.protocol import CountTokensRequest, MessagesRequest
from router.frontend.openai_api import convert
from router.frontend.openai_api.chat_call import ChatCall, start_chat
from router.frontend.openai_api.http_body import parse
from router.frontend.pipeline import RequestPipeline
from router.frontend.messages_api.conversation import conversation_session
from router.routing import client_session_id

logger = logging.getLogger(__name__)


def authorization_of(headers: Mapping[str, str]) -> str | None:
    """The bearer token, else Anthropic's `x-api-key` as one."""
    bearer = headers.get("authorization")
    if bearer is not None:
        return bearer
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None


@dataclass(frozen=True)
class Turn:
    req: MessagesRequest
    call: ChatCall
    message_id: str


class MessagesEndpoint:
    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline

    async def start(self, principal: Principal, body: dict[str, Any], num_bytes: int, arrival: float,
                    session_header: str | None) -> Turn:
        """Validate and start the chat call (inside the intake slot)."""
        req = parse(MessagesRequest, body)
        chat = t.chat_request(req, req.stream)
        session = client_session_id(session_header, chat.user) or conversation_session(principal.key_id, req)
        call = await start_chat(self.pipeline, principal, chat, num_bytes, arrival, session, req.model)
        return Turn(req, call, t.new_id("msg"))

    async def respond(self, turn: Turn) -> Response:
        if turn.req.stream:
            return StreamingResponse(self._events(turn), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answer, usage = await turn.call.whole()
        choice = answer.choices[0]
        blocks = t.content_blocks(choice.message)
        reason, sequence = t.stop_reason(choice.finish_reason, choice.stop_reason, bool(choice.message.tool_calls))
        body = t.message_body(turn.message_id, turn.call.formatter.model, blocks, reason, sequence, t.usage_body(usage))
        return JSONResponse(body)

    async def _events(self, turn: Turn) -> AsyncIterator[str]:
        call = turn.call
        events = MessageEvents(turn.message_id, call.formatter.model)
        finish: str | None = None
        matched: str | int | None = None
        state: convert.ChoiceState | None = None
        try:
            async for chunk, finished, state in call.chunks():
                if not events.started:  # at the first output: its cached-token count is known
                    for text in events.start(t.usage_body(call.usage([state]))):
                        yield text
                if chunk is not None:
                    for text in events.chunk(chunk):
                        yield text
                    matched = chunk.choices[0].stop_reason if chunk.choices else matched
                finish = finished or finish
            for text in events.finish(finish, matched, t.usage_body(call.usage([state] if state else []))):
                yield text
        except errors.APIError as e:
            yield event("error", error=error_body(e)["error"])
        except Exception as e:  # a bug: still end the stream in a way clients understand
            logger.exception("messages stream %s failed", call.stream.request_id)
            yield event("error", error=error_body(errors.internal(f"The request failed: {type(e).__name__}."))["error"])
        finally:
            call.stream.close()

    async def count_tokens(self, principal: Principal, body: dict[str, Any], num_bytes: int) -> JSONResponse:
        req = parse(CountTokensRequest, body)
        await self.pipeline.lora.refresh(req.model)
        self.pipeline.lora.resolve(req.model)  # the base model or a known adapter; else 404
        chat = t.chat_request(req)
        tokenizer = self.pipeline.tokenizer
        ids = await self.pipeline.tokenizer_work(principal, num_bytes, lambda: convert.encode_chat(tokenizer, chat))
        return JSONResponse({"input_tokens": len(ids)})
