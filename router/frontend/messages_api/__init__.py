"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): a translation onto the chat-completions path."""
