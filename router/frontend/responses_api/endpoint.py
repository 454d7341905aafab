"""POST /v1/responses, GET and DELETE /v1/responses/{id}: read the body, load the
conversation a `previous_response_id` continues, run the turn as a chat completion
(router/frontend/openai_api/chat_call.py), answer as a Response (whole or streamed), and
store it when asked. The store is the caller's key's alone (router/frontend/responses_api/store.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from router import errors
from router.frontend.auth import Principal
from router.frontend.openai_api.chat_call import ChatCall, start_chat
from router.frontend.openai_api.http_body import parse
from router.frontend.pipeline import RequestPipeline
from router.frontend.responses_api import translate as t
from router.frontend.responses_api.events import ResponseEvents
from router.frontend.responses_api.items import chat_messages
from router.frontend.responses_api.protocol import ResponsesRequest
from router.frontend.responses_api.store import ResponseStore, StoredResponse
from router.routing import client_session_id

logger = logging.getLogger(__name__)


def not_found(response_id: str, param: str | None = None) -> errors.APIError:
    what = "Previous response" if param else "Response"
    return errors.APIError(404, f"{what} with id '{response_id[:80]}' not found.", "invalid_request_error", param,
                           "previous_response_not_found" if param else "not_found")


@dataclass(frozen=True)
class Turn:
    """A started turn: its request, its chat call, and how its Response is built and kept."""

    req: ResponsesRequest
    call: ChatCall
    skeleton: Callable[..., dict[str, Any]]  # (status, output, usage, finish_reason) -> Response
    save: Callable[[dict[str, Any]], Awaitable[None]]


class ResponsesEndpoint:
    def __init__(self, pipeline: RequestPipeline, store: ResponseStore) -> None:
        self.pipeline = pipeline
        self.store = store

    async def start(self, principal: Principal, body: dict[str, Any], num_bytes: int, arrival: float,
                    session_header: str | None) -> Turn:
        """Validate, load the conversation and start its chat call (inside the intake slot)."""
        req = parse(ResponsesRequest, body)
        history: list[dict[str, Any]] = []
        session = client_session_id(session_header, req.user)
        if req.previous_response_id is not None:
            previous = await self.store.get(req.previous_response_id, principal.key_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = previous.messages
            session = session or previous.response.get("_session") or req.previous_response_id
        response_id = t.new_id("resp")
        session = session or response_id  # a chain of continuations is one session
        chat = t.chat_request(req, history, req.stream)
        call = await start_chat(self.pipeline, principal, chat, num_bytes, arrival, session, req.model)
        tokenizer = self.pipeline.tokenizer

        def count(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)

        skeleton = partial(t.response_body, response_id, req, call.formatter.model, int(time.time()), count)
        # The stored conversation: what came before, this input, then this answer.
        save = partial(self._save, response_id, principal, req, history + chat_messages(req.input), session)
        return Turn(req, call, skeleton, save)

    async def respond(self, turn: Turn) -> Response:
        """The turn's answer: streamed events, or the whole Response once it has finished."""
        if turn.req.stream:
            events = self._events(turn.call, ResponseEvents(turn.skeleton), turn.save)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answer, usage = await turn.call.whole()
        choice = answer.choices[0]
        response = turn.skeleton("completed", t.output_items(choice.message), t.usage_body(usage), choice.finish_reason)
        await turn.save(response)
        return JSONResponse(response)

    async def _save(self, response_id: str, principal: Principal, req: ResponsesRequest,
                    turn: list[dict[str, Any]], session: str, response: dict[str, Any]) -> None:
        if not req.store:
            return
        messages = turn + chat_messages(response["output"])
        stored = await self.store.put(response_id, StoredResponse(principal.key_id, {**response, "_session": session}, messages))
        if not stored:
            response["store"] = False  # over the record bound: said, not silently dropped

    async def _events(self, call: ChatCall, events: ResponseEvents,
                      save: Callable[[dict[str, Any]], Awaitable[None]]) -> AsyncIterator[str]:
        finish: str | None = None
        state = None
        try:
            for text in events.start():
                yield text
            async for chunk, finished, state in call.chunks():
                if chunk is not None:
                    for text in events.chunk(chunk):
                        yield text
                finish = finished or finish
            usage = t.usage_body(call.usage([state] if state is not None else []))
            closing, response = events.finish(finish, usage)
            for text in closing:
                yield text
            await save(response)  # before the last event: it says whether it was stored
            yield events.done(response)
        except errors.APIError as e:
            yield events.error(e.body())
        except Exception as e:  # a bug: still end the stream in a way clients understand
            logger.exception("responses stream %s failed", call.stream.request_id)
            yield events.error(errors.internal(f"The request failed: {type(e).__name__}.").body())
        finally:
            call.stream.close()

    async def retrieve(self, principal: Principal, response_id: str) -> JSONResponse:
        record = await self.store.get(response_id, principal.key_id)
        if record is None:
            raise not_found(response_id)
        return JSONResponse(public(record.response))

    async def delete(self, principal: Principal, response_id: str) -> JSONResponse:
        if not await self.store.delete(response_id, principal.key_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def public(response: dict[str, Any]) -> dict[str, Any]:
    """A stored response without the store's own fields (underscored)."""
    return {k: v for k, v in response.items() if not k.startswith("_")}
