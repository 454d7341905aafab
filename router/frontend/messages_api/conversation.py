"""The session an Anthropic conversation is, when the client names none.

Messages clients send the whole conversation every turn and no id for it; what stays the
same from turn to turn is its beginning: the model, the system prompt and the first
message. Those, with the API key's id (two keys never share a session), name the session,
so that later turns go where the earlier turns' KV is and a finished turn's KV is kept
through the tool pause before the next (kv/retention.py). An `x-session-id` header or
`metadata.user_id` takes precedence.
"""
from __future__ import annotations

import hashlib
import json

from router.frontend.messages_api.protocol import Conversation


def conversation_session(key_id: str, req: Conversation) -> str:
    first = req.messages[0].model_dump(mode="json", exclude_none=True)
    beginning = json.dumps([key_id, req.model, req.system, first], sort_keys=True, separators=(",", ":"))
    return "conv:" + hashlib.sha256(beginning.encode("utf-8", "surrogatepass")).hexdigest()[:32]
