"""Tool calling for chat: what the chat template sees and the output is held to
(chat_tools), the per-model parsers of the output (parsers), one call's JSON streamed as
OpenAI deltas (call_stream), and the call records they share (calls)."""
