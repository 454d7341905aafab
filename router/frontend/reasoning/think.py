"""The `<think>` format (Qwen3, DeepSeek-R1, QwQ and their kin): the model thinks between
`<think>` and `</think>`, then answers. Whole (`parse`) or streamed (`feed` ... `finish`),
the text splits into (reasoning, content) the same way:

- The chat template may open the block itself (its generation prompt ends with `<think>`,
  as DeepSeek-R1's does): the output starts inside it (`starts_inside`).
- Otherwise an output that starts (after whitespace) with `<think>` opens it; any other
  output is all content (a Qwen3 told `enable_thinking: false`).
- Inside, everything up to the first `</think>` is reasoning, everything after it content.
  A block never closed (cut by max_tokens) is all reasoning.

Streaming holds back only what may be the start of a tag, so text flows as it comes.
"""
from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkParser:
    """Stateful per choice."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._state = "inside" if starts_inside else "start"  # start | inside | content
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of this delta; what may be a tag's start waits."""
        text, self._held = self._held + delta, ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self._state, text = "inside", stripped[len(OPEN):]
            elif OPEN.startswith(stripped):  # "", "<", "<th", ...: not known yet
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "content":
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            self._state = "content"
            return text[:end], text[end + len(CLOSE):]
        keep = _partial_suffix(text, CLOSE)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "inside" else ("", held)

    def parse(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
