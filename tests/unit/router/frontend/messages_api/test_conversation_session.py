"""A Messages conversation without a session id is one session across its turns: named
by its key, model, system prompt and first message; another key, system or first message
is another session."""
from __future__ import annotations

from router.frontend.messages_api.conversation import conversation_session
from router.frontend.messages_api.protocol import MessagesRequest


def _req(messages: list[dict], system: str | None = "be brief") -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "system": system, "messages": messages})


def test_turns_of_one_conversation_share_a_session() -> None:
    first = [{"role": "user", "content": "list the files"}]
    later = first + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]},
    ]
    session = conversation_session("key-a", _req(first))
    assert session.startswith("conv:") and len(session) == 37
    assert conversation_session("key-a", _req(later)) == session
    assert conversation_session("key-b", _req(later)) != session
    assert conversation_session("key-a", _req(later, system="be long")) != session
    assert conversation_session("key-a", _req([{"role": "user", "content": "other"}])) != session
