"""Tool-call parsers: model output text -> (content, tool calls), whole or streamed.

Two formats here, chosen per model (IngressSettings.tool_call_parser, or from the chat
template's text when "auto": router/frontend/tool_calling/registry.py, which also has the
DeepSeek-V3 and Mistral formats of families.py):
  hermes       Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
               any number of them, with free text around them (the text is content).
  llama3_json  Llama 3.x: the whole message is a JSON call `{"name": ..., "parameters":
               {...}}` (optionally after `<|python_tag|>`), several separated by `;`.

Two ways to read an output: `parse(text)` whole (non-streamed responses), and
`stream(delta)` ... `stream_end()` for streamed ones. Streaming keeps free text flowing,
holds back only what may be the start of a call, and streams each call as OpenAI does:
a first delta with id, type and name as soon as the name is known, then `arguments` in
fragments as the model writes them (router/frontend/tool_calling/call_stream.py), never the wrapper.
"""
from __future__ import annotations

import json

from router.frontend.tool_calling.call_stream import CallListStream, CallStream
from router.frontend.tool_calling.calls import CallDelta, ParsedCall, call_from_json, new_call_id


class ToolParser:
    """Stateful per choice: `feed(delta)` while streaming, then `finish()`; or `parse`."""

    name = ""
    # The format's markers are special tokens: the output is detokenized with them kept.
    keeps_special_tokens = False

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more

    # -- streaming: content and call deltas. This default sends each call when complete
    # (name, then its arguments whole); the model formats override it with fragments.
    num_streamed_calls = 0

    def stream(self, delta: str) -> tuple[str, list[CallDelta]]:
        content, calls = self.feed(delta)
        return content, self._whole_deltas(calls)

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        content, calls = self.finish()
        return content, self._whole_deltas(calls)

    def _whole_deltas(self, calls: list[ParsedCall]) -> list[CallDelta]:
        deltas = []
        for call in calls:
            index = self.num_streamed_calls
            self.num_streamed_calls += 1
            deltas += [CallDelta(index, call.id, call.name), CallDelta(index, arguments=call.arguments)]
        return deltas


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        content, calls = [], []
        while True:
            start = self._buf.find(self.OPEN)
            if start < 0:
                # Hold back a tail that may be the beginning of "<tool_call>".
                keep = _partial_suffix(self._buf, self.OPEN)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._buf[:start])
            end = self._buf.find(self.CLOSE, start)
            if end < 0:
                self._buf = self._buf[start:]
                break
            body = self._buf[start + len(self.OPEN) : end]
            self._buf = self._buf[end + len(self.CLOSE) :]
            call = _parse_call(body)
            if call is None:  # not a call after all: it stays text, as vLLM's parser leaves it
                content.append(f"{self.OPEN}{body}{self.CLOSE}")
            else:
                calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if buf.startswith(self.OPEN):  # the model stopped before closing the tag
            call = _parse_call(buf[len(self.OPEN) :])
            if call is not None:
                return "", [call]
        return buf, []


    # -- streaming -------------------------------------------------------------------
    _stream_buf = ""
    _call: CallStream | None = None
    _call_text = ""

    def stream(self, delta: str) -> tuple[str, list[CallDelta]]:
        self._stream_buf += delta
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            buf = self._stream_buf
            if self._call is None:
                start = buf.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(buf, self.OPEN)
                    content.append(buf[: len(buf) - keep])
                    self._stream_buf = buf[len(buf) - keep :]
                    break
                content.append(buf[:start])
                buf = self._stream_buf = buf[start + len(self.OPEN) :]
                self._call, self._call_text = CallStream(self.num_streamed_calls), ""
            end = buf.find(self.CLOSE)
            body = buf[:end] if end >= 0 else buf[: len(buf) - _partial_suffix(buf, self.CLOSE)]
            self._stream_buf = buf[len(body) :]
            self._call_text += body
            if self._call.mode != "closed":
                deltas += self._call.feed(body)[0]  # text after the object inside the tag: dropped
            if end < 0:
                break
            self._stream_buf = self._stream_buf[len(self.CLOSE) :]
            content.append(self._end_call(deltas))
        return "".join(content), deltas

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        content, deltas = self.stream("")
        buf, self._stream_buf = self._stream_buf, ""
        if self._call is None:
            return content + buf, deltas
        self._call_text += buf
        if self._call.mode != "closed":
            deltas += self._call.feed(buf)[0]
        rest = self._end_call(deltas, closed=False)
        return content + rest, deltas

    def _end_call(self, deltas: list[CallDelta], closed: bool = True) -> str:
        """The call's tag has ended: its last deltas join `deltas`; a body that was no call
        comes back as the text it was (content), as the whole parse leaves it."""
        call, self._call = self._call, None
        assert call is not None
        deltas += call.end()
        if call.named:
            self.num_streamed_calls += 1
            return ""
        return f"{self.OPEN}{self._call_text}{self.CLOSE if closed else ''}"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # "text" | "calls", decided by the first characters

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        if self._mode == "text":
            return delta, []
        self._buf += delta
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (head[0] == "<" and self.PYTHON_TAG.startswith(head[: len(self.PYTHON_TAG)])
                            and len(head) < len(self.PYTHON_TAG)):
                return "", []
            self._mode = "calls" if head.startswith(("{", self.PYTHON_TAG)) else "text"
            if self._mode == "text":
                buf, self._buf = self._buf, ""
                return buf, []
        return "", []  # calls: parsed whole at the end (the JSON is not complete before)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return buf, []
        text = buf.strip().removeprefix(self.PYTHON_TAG)
        calls = []
        for part in _split_top_level(text, ";"):
            call = _parse_call(part)
            if call is None:
                return buf, []  # not calls after all: all of it is content
            calls.append(call)
        return "", calls


    # -- streaming: each object of the `;`-separated list streams as it comes ----------
    _list: CallListStream | None = None
    _all_text = ""

    def stream(self, delta: str) -> tuple[str, list[CallDelta]]:
        if self._mode != "calls":
            content, _ = self.feed(delta)
            if self._mode != "calls":
                return content, []
            delta, self._buf = self._buf, ""  # the head decided it: calls from here on
            self._list = CallListStream(skip=" \t\r\n;", prefix=self.PYTHON_TAG)
        assert self._list is not None
        self._all_text += delta
        deltas = self._list.feed(delta)
        self.num_streamed_calls = self._list.num_calls
        return "", deltas

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        if self._list is None:
            content, _ = self.finish()
            return content, []
        deltas = self._list.end()
        self.num_streamed_calls = self._list.num_calls
        if self.num_streamed_calls == 0:  # no call after all: all of it is content
            return self._all_text, deltas
        return "", deltas


class BufferedParser(ToolParser):
    """An output whose grammar forced a tool call: nothing streams as content; the whole
    text is parsed when it ends. Text that does not parse (cut by max_tokens) comes back
    as content, as vLLM returns it."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        try:
            calls = self._calls(json.loads(buf))
        except json.JSONDecodeError:
            return buf, []
        return ("", calls) if calls else (buf, [])

    def _calls(self, value: object) -> list[ParsedCall]:
        raise NotImplementedError


class JsonArrayParser(BufferedParser):
    """The output of a `required` tool choice: a JSON array of {"name", "parameters"}
    objects (its grammar guarantees it parses), as vLLM forces it."""

    name = "json_array"

    def _calls(self, value: object) -> list[ParsedCall]:
        calls = [call_from_json(item) for item in value] if isinstance(value, list) else []
        return [] if any(c is None for c in calls) else [c for c in calls if c is not None]

    # Streaming: each array element streams as it comes (the schema puts "name" first).
    _list: CallListStream | None = None

    def stream(self, delta: str) -> tuple[str, list[CallDelta]]:
        self._buf += delta
        if self._list is None:
            self._list = CallListStream(skip=" \t\r\n[,]")
        deltas = self._list.feed(delta)
        self.num_streamed_calls = self._list.num_calls
        return "", deltas

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        deltas = self._list.end() if self._list is not None else []
        self.num_streamed_calls = self._list.num_calls if self._list is not None else 0
        buf, self._buf = self._buf, ""
        return ("", deltas) if self.num_streamed_calls else (buf, deltas)


class NamedParser(BufferedParser):
    """The output of a named tool choice: the function's arguments as JSON."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def _calls(self, value: object) -> list[ParsedCall]:
        return [ParsedCall(self.function, json.dumps(value, ensure_ascii=False))]

    def stream(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The whole output is the arguments (its grammar says so): the name goes out at
        once, then every piece of text as an arguments fragment."""
        deltas = []
        if self.num_streamed_calls == 0:
            self.num_streamed_calls = 1
            deltas.append(CallDelta(0, new_call_id(), self.function))
        if delta:
            deltas.append(CallDelta(0, arguments=delta))
        return "", deltas

    def stream_end(self) -> tuple[str, list[CallDelta]]:
        return "", []


def parser_for_template(chat_template: str | None) -> str:
    """The parser a model's chat template implies (Llama 3.x templates mention ipython /
    <|python_tag|>; Hermes, Qwen and kvserve-tiny write <tool_call>)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _parse_call(body: str) -> ParsedCall | None:
    try:
        return call_from_json(json.loads(body.strip()))
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on `sep` outside JSON strings and brackets."""
    parts, depth, in_str, escape, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
