"""One tool call's JSON object, fed in pieces, as OpenAI stream deltas: the call's id and
name as soon as the name is known, then its `arguments` text fragment by fragment, never
the object's closing brace or the format's closing tag.

    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    <----------- head: buffered -----------><-- args: -->< tail: dropped
                 (name delta when it ends)   streamed

The head must name the call first (`name`, then `arguments` or `parameters`), which is
how Hermes/Qwen and Llama 3.x write calls. Any other shape (arguments first, arguments
as a JSON string) is buffered until the object closes and goes out whole, in one delta.
The streamed arguments are the model's own text, so they parse to the same JSON as the
non-streamed call's (which is re-serialised); tests compare the parsed values.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from router.frontend.tool_calling.calls import CallDelta, call_from_json, new_call_id

# The head of a call object up to the start of its arguments value.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass
class CallStream:
    """The JSON lexer state of one call object and what of it has gone out."""

    index: int
    id: str = field(default_factory=new_call_id)
    mode: str = "head"  # head | args | other | tail | closed
    text: list[str] = field(default_factory=list)  # the object so far (the whole-parse fallback)
    named: bool = False
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    args_begun: bool = False
    opened: bool = False  # the object's `{` has been seen

    def feed(self, piece: str) -> tuple[list[CallDelta], str | None]:
        """The deltas this piece completes, and once the object has closed, the text after
        it (None while it is open)."""
        deltas: list[CallDelta] = []
        fragment: list[str] = []
        for k, ch in enumerate(piece):
            self.text.append(ch)
            was_in_string = self.in_string
            self._lex(ch)
            if self.mode == "head":
                if ch == ":" and not was_in_string and self.depth == 1:
                    match = _HEAD.fullmatch("".join(self.text))
                    if match is not None:
                        self.named, self.mode = True, "args"
                        deltas.append(CallDelta(self.index, self.id, json.loads(f'"{match.group(1)}"')))
            elif self.mode == "args":
                if not self.args_begun:
                    if ch.isspace():
                        continue
                    if ch != "{":  # a string or other value: only the whole object tells
                        self.mode = "other"
                        continue
                    self.args_begun = True
                fragment.append(ch)
                if self.depth == 1:  # the arguments object has closed
                    self.mode = "tail"
            if self.depth == 0 and self.opened:
                if fragment:
                    deltas.append(CallDelta(self.index, arguments="".join(fragment)))
                    fragment = []
                deltas += self._close()
                return deltas, piece[k + 1 :]
        if fragment:
            deltas.append(CallDelta(self.index, arguments="".join(fragment)))
        return deltas, None

    def whole(self) -> tuple[str, str] | None:
        """(name, arguments JSON) parsed from the object so far, None when it is no call."""
        try:
            call = call_from_json(json.loads("".join(self.text)))
        except json.JSONDecodeError:
            return None
        return (call.name, call.arguments) if call is not None else None

    @property
    def sent_anything(self) -> bool:
        return self.named

    def end(self) -> list[CallDelta]:
        """The text ended before the object closed (a close tag, EOS): what can still go
        out. A call never named is parsed whole (None of it may be a call: `named` says)."""
        if self.mode == "closed":
            return []
        return self._close()

    def _close(self) -> list[CallDelta]:
        mode, self.mode = self.mode, "closed"
        if mode in ("tail", "args"):  # arguments streamed (all, or as far as they came)
            return []
        whole = self.whole()
        if whole is None:
            return []
        name, arguments = whole
        if mode == "head":  # never named: it goes out whole
            self.named = True
            return [CallDelta(self.index, self.id, name), CallDelta(self.index, arguments=arguments)]
        return [CallDelta(self.index, arguments=arguments)]  # "other": named, arguments now

    def _lex(self, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
            self.opened = True
        elif ch in "}]":
            self.depth -= 1


@dataclass
class CallListStream:
    """A list of call objects with separators between them, fed in pieces: Llama 3's
    `{...}; {...}` (after `<|python_tag|>`) or a forced `required` choice's JSON array
    `[{...}, {...}]`. Each object streams through its own CallStream as it comes."""

    skip: str  # characters between (and around) the objects
    prefix: str = ""  # a marker that may lead the list (held back while partial)
    num_calls: int = 0  # calls named so far (the next call's index)
    _pending: str = ""
    _call: CallStream | None = None

    def feed(self, piece: str) -> list[CallDelta]:
        self._pending += piece
        deltas: list[CallDelta] = []
        while self._pending:
            if self._call is None:
                text = self._pending.lstrip().removeprefix(self.prefix).lstrip(self.skip)
                if not text or (self.prefix and self.prefix.startswith(text)):
                    self._pending = text
                    break
                self._call, self._pending = CallStream(self.num_calls), text
            more, rest = self._call.feed(self._pending)
            deltas += more
            self._pending = rest or ""
            if rest is None:
                break
            self._end_call()
        return deltas

    def end(self) -> list[CallDelta]:
        """The text has ended: what the open call can still send."""
        if self._call is None:
            return []
        deltas = self._call.end()
        self._end_call()
        return deltas

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call is not None and call.named:
            self.num_calls += 1
