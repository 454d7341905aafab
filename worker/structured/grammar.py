"""A StructuredOutput spec -> an llguidance grammar, and its validation.

Torch-free and tokenizer-free, so the ingress can run it too (an invalid schema is a
400 there, before a worker sees the request). llguidance is the grammar engine: MIT
licensed, a Rust core whose compile is lazy (milliseconds, no per-vocabulary
precomputation), a CPU mask fast enough to compute on the host every step, and no torch
needed for anything but the optional torch helpers (which the sampler does not use).
"""
from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the spec's type only: sampling_params imports this module to validate
    from worker.sampling_params import StructuredOutput

# A JSON object with any properties (OpenAI's response_format json_object).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON layout: no free whitespace (as vLLM's disable_any_whitespace). With flexible
# whitespace a weak model can emit newlines until max_tokens and never finish the value;
# a schema may still opt in through llguidance's "x-guidance" keyword.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec that does not compile (an invalid schema, regex or grammar)."""


def llguidance_module() -> Any:
    try:
        import llguidance  # llguidance: the ingress imports this module; fails with the install hint
    except ImportError as e:  # pragma: no cover - the dependency is in pyproject.toml
        raise RuntimeError("structured outputs need llguidance: pip install 'llguidance>=1.9'") from e
    return llguidance


@functools.lru_cache(maxsize=512)
def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for a spec; raises GrammarError. Cached by
    the spec: the same schema sent by many requests is checked once."""
    try:
        return _grammar_of(so)
    except RecursionError:  # the schema check walks the schema recursively
        raise GrammarError(f"the {so.kind.replace('_', ' ')} is nested too deeply") from None


def _grammar_of(so: StructuredOutput) -> str:
    ll = llguidance_module()
    matcher = ll.LLMatcher
    if so.kind == "json_object":
        grammar = matcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
    elif so.kind == "json_schema":
        grammar = matcher.grammar_from_json_schema(_check_schema(so.spec), defaults=_JSON_OPTIONS)
    elif so.kind == "regex":
        grammar = matcher.grammar_from_regex(so.spec)
    elif so.kind == "choice":
        grammar = matcher.grammar_from_lark(_choice_lark(so.spec))
    else:  # grammar: Lark, or GBNF (llama.cpp's, which vLLM also takes) converted to Lark
        text = so.spec
        if "::=" in text:
            # llguidance: the ingress imports this module; only GBNF needs it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as e:
                raise GrammarError(f"invalid GBNF grammar: {e}") from None
        grammar = matcher.grammar_from_lark(text)
    error = matcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {so.kind.replace('_', ' ')}: {error}")
    return grammar


def _check_schema(text: str) -> dict[str, Any]:
    """Parse and check a JSON schema against its meta-schema (jsonschema's check is
    stricter than llguidance's about keyword types)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object (or a boolean)")
    import jsonschema  # jsonschema: the ingress imports this module; only a JSON schema needs it

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise GrammarError(f"invalid JSON schema: {e.message}") from None
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})


def _choice_lark(text: str) -> str:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    # Lark string literals take JSON escapes.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(so: StructuredOutput) -> None:
    """Raise GrammarError when the spec does not compile."""
    grammar_of(so)
