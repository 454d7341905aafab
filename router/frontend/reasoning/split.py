"""A chat choice's output split into reasoning and content before anything else reads it:
the tool-call parsers and the formatters see only the content. One parser per streamed
choice; the whole text of an unstreamed one goes through a fresh parser."""
from __future__ import annotations

from dataclasses import replace

from router.frontend.reasoning.choose import ReasoningFactory, ReasoningParser
from worker.api import RequestOutput


class ReasoningSplitter:
    def __init__(self, factory: ReasoningFactory) -> None:
        self._factory = factory
        self._parsers: dict[int, ReasoningParser] = {}

    def split(self, index: int, out: RequestOutput) -> tuple[RequestOutput, str]:
        """The output with only its content as text_delta, and this step's reasoning."""
        parser = self._parsers.setdefault(index, self._factory())
        reasoning, content = parser.feed(out.text_delta) if out.text_delta else ("", "")
        if out.finished:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return (out if content == out.text_delta else replace(out, text_delta=content)), reasoning

    def split_whole(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a finished choice's text."""
        return self._factory().parse(text)
