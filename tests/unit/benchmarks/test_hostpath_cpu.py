"""benchmarks.hostpath's CPU accounting: per process, only processes alive at both
readings, only this driver's own cluster."""
from __future__ import annotations

import subprocess
import sys

from benchmarks.hostpath_serve import cpu_seconds, cpu_spent, process_kinds


def test_a_process_that_exits_between_readings_is_not_counted() -> None:
    kinds = {1: "proxy", 2: "proxy", 3: "worker"}
    # pid 2 exited: its CPU must not turn into a negative share.
    assert cpu_spent(kinds, {1: 1.0, 2: 5.0, 3: 2.0}, {1: 1.5, 3: 4.0}) == {"proxy": 0.5, "worker": 2.0}


def test_only_descendants_are_measured() -> None:
    import psutil

    sleeper = f"{sys.executable} -c 'import time; time.sleep(30)  # ray::ProxyActor'"
    child = subprocess.Popen(["sh", "-c", sleeper])
    # Another cluster's proxy: a process this driver did not start (its parent shell exits).
    orphan_pid = int(subprocess.run(["sh", "-c", f"{sleeper} >/dev/null 2>&1 & echo $!"],
                                    capture_output=True, text=True, check=True).stdout)
    try:
        kinds = process_kinds()
        assert "proxy" in [kinds.get(p.pid) for p in psutil.Process(child.pid).children()] + [kinds.get(child.pid)]
        assert orphan_pid not in kinds
        assert set(cpu_seconds(kinds)) == set(kinds)
    finally:
        child.kill()
        child.wait()
        psutil.Process(orphan_pid).kill()
