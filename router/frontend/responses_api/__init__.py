"""OpenAI's Responses API (/v1/responses): a translation onto the chat-completions path."""
