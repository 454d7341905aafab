"""FakeEngineWorker (tests/integration/fake_engine_worker.py) whose start-up takes as long as
a file says: a model load slower than the ingress's cold-start bound, switched on by the
test once the first replica is up (a replica started before the file exists starts at once)."""
from __future__ import annotations

import os
import time

from tests.integration.fake_engine_worker import FakeEngineWorker


class SlowStartWorker(FakeEngineWorker):
    def __init__(self, startup_file: str, max_num_seqs: int = 4, step_s: float = 0.01,
                 drain_timeout_s: float = 5.0) -> None:
        if os.path.exists(startup_file):
            with open(startup_file) as f:
                time.sleep(float(f.read()))  # the stand-in for loading weights: the replica is not ready meanwhile
        super().__init__(max_num_seqs=max_num_seqs, step_s=step_s, drain_timeout_s=drain_timeout_s)
