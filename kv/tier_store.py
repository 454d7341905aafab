"""Housekeeping of a disk-tier directory tree, beside the entries themselves (kv/disk_tier.py).

    <root>/<fingerprint key>/          one store per model and KV layout (0700)
        <block hash>.kv                entries (0600)
        .<name>.<uuid>.tmp             a write in progress; left behind by a crash
        .store.json                    which model path, weights (model id) and fingerprint it holds

- Leftover temporary files older than `TMP_MAX_AGE_S` are deleted when a store opens (a
  younger one may be another writer's write in progress).
- A sibling store of the same model path with other weights (another model id) is the KV
  of weights replaced since: it can never be served again and is deleted when a store
  opens. Other siblings (other models, or another KV layout of the same weights, which a
  deployment beside this one may be using) are left alone unless unused for
  `STALE_STORE_AGE_S`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
TMP_MAX_AGE_S = 600.0
STALE_STORE_AGE_S = 7 * 24 * 3600.0
STORE_FILE = ".store.json"


def remove_leftover_tmp(directory: Path, max_age_s: float = TMP_MAX_AGE_S) -> int:
    """Delete temporary files older than `max_age_s`; returns how many."""
    now, removed = time.time(), 0
    with os.scandir(directory) as it:
        for entry in it:
            if not (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)):
                continue
            try:
                if now - entry.stat().st_mtime >= max_age_s:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue
    if removed:
        logger.info("KV tier %s: %d leftover temporary files deleted", directory, removed)
    return removed


def claim_store(directory: Path, model_path: str | None, model_id: str, fingerprint_key: str) -> None:
    """Record what `directory` holds, then delete its stale siblings (the module docstring)."""
    record = {"model_path": model_path, "model_id": model_id, "fingerprint_key": fingerprint_key}
    tmp = directory / f".{STORE_FILE}.{os.getpid()}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, directory / STORE_FILE)
    now = time.time()
    for sibling in directory.parent.iterdir():
        if sibling == directory or not sibling.is_dir() or not _looks_like_store(sibling):
            continue
        try:
            theirs = json.loads((sibling / STORE_FILE).read_text())
            replaced = (isinstance(theirs, dict) and model_path is not None and theirs.get("model_path") == model_path
                        and theirs.get("model_id") != model_id)
            # A store in use gains entries: its directory's modification time moves.
            last_used = max((sibling / STORE_FILE).stat().st_mtime, sibling.stat().st_mtime)
            unused = now - last_used >= STALE_STORE_AGE_S
        except (OSError, ValueError):
            continue
        if replaced or unused:
            logger.info("KV tier: deleting the stale store %s (%s)", sibling,
                        "the model's weights were replaced" if replaced else "unused")
            shutil.rmtree(sibling, ignore_errors=True)


def _looks_like_store(path: Path) -> bool:
    name = path.name
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name) and (path / STORE_FILE).is_file()
