"""Structured outputs: specs -> grammars (grammar.py), compiled off the step thread
(compiler.py), per-sequence matcher state (state.py), batch token bitmasks (bitmask.py)."""
