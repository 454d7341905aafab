"""Server-sent events as the OpenAI API streams them: one `data:` line of JSON per event,
and the closing `[DONE]`."""
from __future__ import annotations

import json

SSE_DONE = "data: [DONE]\n\n"

# Characters a line reader that splits like str.splitlines() (httpx's aiter_lines among them)
# takes for line ends, which json.dumps(ensure_ascii=False) leaves raw inside strings: escaped,
# so that one SSE event stays one line whatever text a model produces.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(obj: object) -> str:
    """One SSE `data:` event of `obj` as JSON (UTF-8 kept, line separators escaped)."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"
