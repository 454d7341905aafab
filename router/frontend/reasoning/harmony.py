"""gpt-oss's harmony format, read from the output text (decoded with its special tokens):

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>

The chat template's generation prompt ends with `<|start|>assistant`, so the output
begins in a message's header. Each message's header names its channel and, for a tool
call, its recipient (`to=functions.NAME`, before or after the channel). The `analysis`
channel is reasoning; `final` and the other channels' text is content; a call to a
function leaves the content as one canonical segment,
`<|start|>to=functions.NAME<|message|>ARGS<|call|>`, which the harmony tool-call parser
(router/frontend/tool_calling/families.py) reads. Bodies stream as they come; only what
may be the start of a marker waits.

openai-harmony's own StreamableParser reads token ids of the o200k_harmony vocabulary,
which it downloads on first use; this reader needs nothing beyond the text.
"""
from __future__ import annotations

import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
CALL_OPEN, CALL_CLOSE = "<|start|>to=", "<|call|>"
_RECIPIENT = re.compile(r"to=(\S+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-size:]):
                best = size
                break
    return best


class HarmonyParser:
    """Stateful per choice: feed(delta) -> (reasoning, content), then finish()."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_header = True
        self._channel = ""
        self._recipient: str | None = None
        self._args: list[str] = []  # a call's body, sent whole when it ends

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._in_header:
                end = self._buf.find(MESSAGE)
                if end < 0:
                    break
                self._open(self._buf[:end])
                self._buf = self._buf[end + len(MESSAGE):]
                continue
            ends = [(i, m) for m in ENDS if (i := self._buf.find(m)) >= 0]
            if not ends:
                keep = _partial_suffix(self._buf, ENDS)
                self._body(self._buf[:len(self._buf) - keep], reasoning, content)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker = min(ends)
            self._body(self._buf[:at], reasoning, content)
            self._buf = self._buf[at + len(marker):]
            self._close(content)
        return "".join(reasoning), "".join(content)

    def _open(self, header: str) -> None:
        header = header.removeprefix(START)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient else None
        self._in_header = False

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._args.append(text)
        elif self._channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)

    def _close(self, content: list[str]) -> None:
        if self._recipient is not None:
            content.append(f"{CALL_OPEN}{self._recipient}{MESSAGE}{''.join(self._args).strip()}{CALL_CLOSE}")
        self._args, self._recipient, self._channel, self._in_header = [], None, "", True

    def finish(self) -> tuple[str, str]:
        """An output cut inside a body: its text so far (a cut call's arguments stay out)."""
        buf, self._buf = self._buf, ""
        if self._in_header:
            return "", ""
        reasoning: list[str] = []
        content: list[str] = []
        self._body(buf, reasoning, content)
        self._args, self._recipient = [], None
        return "".join(reasoning), "".join(content)

    def parse(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
