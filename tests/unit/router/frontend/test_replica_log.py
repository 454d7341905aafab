"""The ingress writes its start-up lines at once, whatever Serve's log buffer holds back."""
from __future__ import annotations

import logging
import logging.handlers

from router.frontend.ingress import flush_replica_log


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_buffered_lines_reach_the_file_handler_on_flush() -> None:
    serve_logger = logging.getLogger("ray.serve")
    saved = serve_logger.handlers[:]
    target = Collect()
    # As Serve's throughput mode sets a replica up: a memory handler in front of the file.
    buffered = logging.handlers.MemoryHandler(capacity=1000, target=target, flushLevel=logging.ERROR)
    serve_logger.handlers = [buffered]
    try:
        serve_logger.warning("API key authentication OFF")
        assert target.messages == []  # held back: a warning is below the flush level
        flush_replica_log()
        assert target.messages == ["API key authentication OFF"]
    finally:
        serve_logger.handlers = saved
