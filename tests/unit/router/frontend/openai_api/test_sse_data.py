"""An SSE event stays one line for any line reader: text with the separators that
str.splitlines() (httpx's aiter_lines) also breaks on comes out escaped, and decodes back."""
from __future__ import annotations

import json

from router.frontend.openai_api.formatting import sse_data


def test_line_separators_in_text_are_escaped() -> None:
    text = "a\u2028b\x85c\u2029d é\u4e2d"
    event = sse_data({"choices": [{"text": text}]})
    assert event.endswith("\n\n") and len(event.strip().splitlines()) == 1
    assert json.loads(event[len("data: "):])["choices"][0]["text"] == text
    assert "é\u4e2d" in event  # other UTF-8 stays as it is
