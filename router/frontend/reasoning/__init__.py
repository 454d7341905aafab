"""Reasoning output: the model's thinking apart from its answer (reasoning_content, reasoning items, thinking blocks)."""
