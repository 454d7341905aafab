"""Tool-call formats of the DeepSeek-V3 and Mistral families (the Hermes / Qwen and Llama 3
ones are in parsers.py). Text before the calls' marker is content; the calls are parsed
when their block ends (streamed, each call goes out whole then: ToolParser's default).

  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               ```json\\n{ARGS}\\n```<｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>
               (V3 / R1), or <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜> (V3.1)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 tokenizers), or
               [TOOL_CALLS]NAME[ARGS]{ARGS} once per call (v11+). [TOOL_CALLS] is a control
               token: the output keeps special tokens for this parser (ToolMode). Mistral's
               templates want 9-character alphanumeric call ids; its calls get such ids.

  harmony      gpt-oss: the harmony reasoning reader (router/frontend/reasoning/harmony.py)
               leaves each call as <|start|>to=functions.NAME<|message|>{ARGS}<|call|>.

A block that does not parse stays content, as the other parsers leave it.
"""
from __future__ import annotations

import json
import re
import secrets
import string

from router.frontend.tool_calling.calls import ParsedCall, call_from_json
from router.frontend.tool_calling.parsers import ToolParser, _partial_suffix


class _MarkedCallsParser(ToolParser):
    """Content until MARKER, then the calls' text, parsed whole by `_calls` at END (or at
    the output's end)."""

    MARKER = ""
    END: str | None = None
    # The end-of-sequence token's text, which an output decoded with special tokens ends
    # with: never content, never part of a call (held back until the output ends).
    TRAILER: str | None = None

    def __init__(self) -> None:
        self._buf = ""
        self._in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        if not self._in_calls:
            start = self._buf.find(self.MARKER)
            if start < 0:
                keep = max(_partial_suffix(self._buf, self.MARKER), self._trailer_suffix())
                content, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return content, []
            content, self._buf, self._in_calls = self._buf[:start], self._buf[start:], True
        else:
            content = ""
        if self.END is not None and self.END in self._buf:
            block, rest = self._buf.split(self.END, 1)
            self._buf, self._in_calls = "", False
            calls = self._calls(block[len(self.MARKER):])
            more, later = self.feed(rest) if rest else ("", [])
            return (content + more, calls + later) if calls else (content + block + self.END + more, later)
        return content, []

    def _trailer_suffix(self) -> int:
        if self.TRAILER is None:
            return 0
        return len(self.TRAILER) if self._buf.endswith(self.TRAILER) else _partial_suffix(self._buf, self.TRAILER)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if self.TRAILER is not None:
            buf = buf.removesuffix(self.TRAILER)
        if not self._in_calls:
            return buf, []
        self._in_calls = False
        calls = self._calls(buf[len(self.MARKER):])
        return ("", calls) if calls else (buf, [])

    def _calls(self, text: str) -> list[ParsedCall]:
        raise NotImplementedError


class DeepSeekV3Parser(_MarkedCallsParser):
    name = "deepseek_v3"
    MARKER = "<｜tool▁calls▁begin｜>"
    END = "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
    _FENCED = re.compile(r"\s*([^\n`]+?)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = []
        for kind, body in self._CALL.findall(text):
            if kind.strip() == "function":  # V3 / R1: the name, then the arguments fenced
                match = self._FENCED.match(body)
                if match is None:
                    return []
                name, arguments = match.group(1), match.group(2)
            else:  # V3.1: the name before the separator
                name, arguments = kind.strip(), body
            call = call_from_json({"name": name, "arguments": arguments.strip()})
            if call is None:
                return []
            calls.append(call)
        return calls


_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralParser(_MarkedCallsParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    TRAILER = "</s>"  # Mistral's EOS, in every tokenizer version
    keeps_special_tokens = True

    def _calls(self, text: str) -> list[ParsedCall]:
        text = text.strip()
        if text.startswith("["):  # a JSON array of calls
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return []
            found = [call_from_json(item) for item in items] if isinstance(items, list) else []
        else:  # NAME[ARGS]{...}, each call after its own [TOOL_CALLS]
            found = []
            for part in text.split(self.MARKER):
                name, sep, arguments = part.partition("[ARGS]")
                found.append(call_from_json({"name": name.strip(), "arguments": arguments.strip()}) if sep else None)
        if not found or any(c is None for c in found):
            return []
        return [ParsedCall(c.name, c.arguments, mistral_call_id()) for c in found if c is not None]


class HarmonyToolParser(_MarkedCallsParser):
    """gpt-oss's calls, as the harmony reasoning reader leaves them in the content."""

    name = "harmony"
    MARKER = "<|start|>to="
    END = "<|call|>"
    keeps_special_tokens = True

    def _calls(self, text: str) -> list[ParsedCall]:
        recipient, sep, arguments = text.partition("<|message|>")
        if not sep or not recipient.startswith("functions."):
            return []
        call = call_from_json({"name": recipient.removeprefix("functions."), "arguments": arguments.strip()})
        return [call] if call is not None else []
