"""A streamed chat answer as the Responses API's event sequence:

    response.created, response.in_progress
    per reasoning:  output_item.added, reasoning_text.delta ..., reasoning_text.done,
                    output_item.done
    per text item:  output_item.added, content_part.added, output_text.delta ...,
                    output_text.done, content_part.done, output_item.done
    per tool call:  output_item.added, function_call_arguments.delta ...,
                    function_call_arguments.done, output_item.done
    response.completed (or response.incomplete when the answer was cut)

Each event is `event: <type>` + `data: <json>` with a `sequence_number` counting from 0.
An item is closed before the next one opens, so the output indices only grow.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from router.frontend.openai_api import protocol as p
from router.frontend.openai_api.sse import sse_data
from router.frontend.responses_api import translate as t


class ResponseEvents:
    """Turns the chat chunks of one choice into Responses events, keeping the output."""

    def __init__(self, skeleton: Callable[[str, list[dict[str, Any]], dict[str, Any] | None, str | None], dict[str, Any]]) -> None:
        # skeleton(status, output, usage, finish_reason) -> the Response object
        self._skeleton = skeleton
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # the chat delta's call index -> its item

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\n{sse_data(body)}"

    def start(self) -> list[str]:
        response = self._skeleton("in_progress", [], None, None)
        return [self._event("response.created", response=response), self._event("response.in_progress", response=response)]

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[str]:
        out: list[str] = []
        for choice in chunk.choices:
            if choice.delta.reasoning_content:
                out += self._reasoning_delta(choice.delta.reasoning_content)
            if choice.delta.content:
                out += self._text_delta(choice.delta.content)
            for call in choice.delta.tool_calls or ():
                out += self._call_delta(call)
        return out

    def _text_delta(self, delta: str) -> list[str]:
        out: list[str] = []
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            item = t.message_item(t.new_id("msg"), None, "in_progress")
            out += self._add(item)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                   content_index=0, part=t.text_part("")))
        self._text.append(delta)
        out.append(self._event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                               content_index=0, delta=delta, logprobs=[]))
        return out

    def _reasoning_delta(self, delta: str) -> list[str]:
        out: list[str] = []
        if self._open is None or self._open["type"] != "reasoning":
            out += self._close()
            out += self._add(t.reasoning_item(t.new_id("rs"), None, "in_progress"))
        self._text.append(delta)
        out.append(self._event("response.reasoning_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                               content_index=0, delta=delta))
        return out

    def _call_delta(self, call: p.DeltaToolCall) -> list[str]:
        out: list[str] = []
        if call.id is not None:
            out += self._close()
            item = t.call_item(t.new_id("fc"), call.id, call.function.name or "", "", "in_progress")
            self._calls[call.index] = item
            out += self._add(item)
        item = self._calls.get(call.index)
        if item is not None and call.function.arguments:
            item["arguments"] += call.function.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=call.function.arguments))
        return out

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        out: list[str] = []
        if item["type"] == "message":
            text = "".join(self._text)
            self._text = []
            item["content"] = [t.text_part(text)]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                   part=t.text_part(text)))
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            self._text = []
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """The events that close the open item, and the final Response object (its own
        event comes from `done`, once the caller has stored it)."""
        out = self._close()
        if not self.output:  # an empty answer is still one (empty) message, as unstreamed
            out += self._add(t.message_item(t.new_id("msg"), None, "in_progress"))
            out += self._close()
        return out, self._skeleton("completed", self.output, usage, finish_reason)

    def done(self, response: dict[str, Any]) -> str:
        """response.completed, or response.incomplete when the answer was cut."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def error(self, body: dict[str, Any]) -> str:
        error = body.get("error", {})
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
