"""A streamed chat answer as the Messages API's event sequence:

    message_start (the message, empty, with its input usage)
    per block: content_block_start, content_block_delta ... (thinking_delta for a
               thinking block, text_delta, or input_json_delta for a tool_use block),
               content_block_stop
    message_delta (stop_reason, stop_sequence, the final usage), message_stop

Each event is `event: <type>` + `data: <json>`. A block is closed before the next opens.
"""
from __future__ import annotations

from typing import Any

from router.frontend.openai_api import protocol as p
from router.frontend.openai_api.sse import sse_data
from router.frontend.messages_api import translate as t


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\n{sse_data({'type': kind, **fields})}"


class MessageEvents:
    """Turns the chat chunks of one choice into Messages events."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._index = -1  # the open block's index; -1: none yet
        self._open: str | None = None  # its type
        self._calls = 0
        self.started = False  # message_start sent

    def start(self, usage: dict[str, Any]) -> list[str]:
        self.started = True
        message = t.message_body(self.message_id, self.model, [], None, None, {**usage, "output_tokens": 0})
        return [event("message_start", message=message)]

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[str]:
        out: list[str] = []
        for choice in chunk.choices:
            if choice.delta.reasoning_content:
                if self._open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(event("content_block_delta", index=self._index,
                                  delta={"type": "thinking_delta", "thinking": choice.delta.reasoning_content}))
            if choice.delta.content:
                if self._open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                out.append(event("content_block_delta", index=self._index,
                                  delta={"type": "text_delta", "text": choice.delta.content}))
            for call in choice.delta.tool_calls or ():
                if call.id is not None:
                    self._calls += 1
                    out += self._begin("tool_use", {"type": "tool_use", "id": call.id, "name": call.function.name or "", "input": {}})
                if call.function.arguments:
                    out.append(event("content_block_delta", index=self._index,
                                     delta={"type": "input_json_delta", "partial_json": call.function.arguments}))
        return out

    def _begin(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._end()
        self._index += 1
        self._open = kind
        return out + [event("content_block_start", index=self._index, content_block=block)]

    def _end(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", index=self._index)]

    def finish(self, finish_reason: str | None, matched: str | int | None, usage: dict[str, Any]) -> list[str]:
        reason, sequence = t.stop_reason(finish_reason, matched, self._calls > 0)
        return self._end() + [
            event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage),
            event("message_stop"),
        ]
