"""Per-sequence grammar state: the compile future, then the request's own matcher.

Torch-free (the scheduler advances it). Lifecycle: created at add_request with the
compile future; `start()` when the future is done (the request then enters the
scheduler); `accept(token)` for every sampled token, on the step thread. Preemption
keeps the output tokens, so the matcher stays valid across a recompute. A migrated
request (router/frontend/migration.py) starts its matcher past the output the client
already has (`replay`): the grammar continues where the dead replica's stopped.
"""
from __future__ import annotations

import time

import logging
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class GrammarState:
    __slots__ = ("_future", "_deadline", "_replay", "matcher")

    def __init__(self, future: Future[Any], deadline: float | None = None, replay: tuple[int, ...] = ()) -> None:
        self._future = future
        # Tokens already output under this grammar (a resumed request): consumed at start().
        self._replay = replay
        # time.monotonic() by which the compile must have finished; past it the request
        # fails (start() says so) instead of waiting on a compile that may never end.
        self._deadline = deadline
        self.matcher: Any = None  # an llguidance LLMatcher, once started

    @property
    def ready(self) -> bool:
        """Compiled, failed, or past its deadline: start() can answer."""
        return self._future.done() or (self._deadline is not None and time.monotonic() >= self._deadline)

    @property
    def future(self) -> Future[Any]:
        return self._future

    def start(self) -> str | None:
        """Take a private copy of the compiled matcher; the compile error, if any."""
        if self._deadline is not None and not self._future.done():  # past it (ready)
            return "the structured-output grammar did not compile within the time limit"
        error = self._future.exception()
        if error is not None:
            return str(error)
        self.matcher = self._future.result().deep_copy()
        if self._replay and not self.matcher.consume_tokens(list(self._replay)):
            return f"the resumed output does not match the structured-output grammar: {self.matcher.get_error()}"
        return None

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; True when the grammar has terminated (the output
        is complete and only EOS could follow)."""
        m = self.matcher
        if not m.consume_token(token_id):
            # Only a token outside the mask gets here (an EOS forced by the engine, say);
            # the output cannot continue under the grammar, so it ends.
            logger.warning("token %d rejected by the grammar: %s", token_id, m.get_error())
            return True
        return m.is_stopped()
