"""The model-format tool-call parsers by name, and which one a chat template implies
(IngressSettings.tool_call_parser `auto`): each family's template names its own marker."""
from __future__ import annotations

from router.frontend.tool_calling import parsers
from router.frontend.tool_calling.families import DeepSeekV3Parser, HarmonyToolParser, MistralParser
from router.frontend.tool_calling.parsers import HermesParser, Llama3JsonParser, ToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "deepseek_v3": DeepSeekV3Parser, "mistral": MistralParser,
    "harmony": HarmonyToolParser,
}


def parser_for_template(chat_template: str | None) -> str:
    template = chat_template or ""
    if "<|channel|>" in template:  # gpt-oss
        return "harmony"
    if DeepSeekV3Parser.MARKER in template:
        return "deepseek_v3"
    if MistralParser.MARKER in template:
        return "mistral"
    return parsers.parser_for_template(chat_template)
