"""A checkpoint's identity for the KV tiers: a digest of its config and weights' contents.

KV written to a disk tier outlives the process; it may be served only to the same weights.
Names and sizes do not say that (weights replaced in place with the same shapes keep
both), so every weight file's bytes are hashed (blake2b). Hashing a large checkpoint
takes a while, so each file's digest is cached with its size and modification time:

    <model dir>/.kvserve-weights-digest.json     beside the files, when that is writable
    $XDG_CACHE_HOME/kvserve/weights-digest/<blake2b of the resolved path>.json   otherwise
        {"files": {name: [size, mtime_ns, digest]}}

A file whose size and modification time match its cached line is not read again; any
other file is. (A writer that keeps both while changing the bytes defeats the cache: that
is a deliberate forgery, not a deployment, and the digest is then recomputed by deleting
the cache file.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_NAME = ".kvserve-weights-digest.json"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_CHUNK = 16 * 1024**2


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_paths(model_dir: Path) -> list[Path]:
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=16).hexdigest()
    return [model_dir / CACHE_NAME, home / "kvserve" / "weights-digest" / f"{key}.json"]


def _read_cache(paths: list[Path]) -> dict[str, list]:
    for path in paths:
        try:
            files = json.loads(path.read_text()).get("files")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(files, dict):
            return files
    return {}


def _write_cache(paths: list[Path], files: dict[str, list]) -> None:
    data = json.dumps({"files": files}, sort_keys=True)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(data)
            os.replace(tmp, path)
            return
        except OSError:
            continue
    logger.info("weights digest: no writable cache for %s; it is recomputed at every start", paths[0].parent)


def model_id_of(path: str | Path | None) -> str:
    """A stable name for a checkpoint's contents: its config and its weight files' bytes
    (replicas reading one model from different paths agree)."""
    if path is None:
        return "unknown"
    path = Path(path)
    model_dir = path if path.is_dir() else path.parent
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    cache_paths = _cache_paths(model_dir)
    cached = _read_cache(cache_paths)
    fresh: dict[str, list] = {}
    digest = hashlib.blake2b(digest_size=16)
    for p in files:
        if p.name == "config.json":
            digest.update(b"config.json:" + p.read_bytes())
        elif p.suffix in WEIGHT_SUFFIXES:
            stat = p.stat()
            line = cached.get(p.name)
            if not (isinstance(line, list) and len(line) == 3 and line[:2] == [stat.st_size, stat.st_mtime_ns]):
                logger.info("weights digest: hashing %s (%d bytes)", p, stat.st_size)
                line = [stat.st_size, stat.st_mtime_ns, _file_digest(p)]
            fresh[p.name] = line
            digest.update(f"{p.name}:{line[0]}:{line[2]}".encode())
    if fresh and fresh != cached:
        _write_cache(cache_paths, fresh)
    return digest.hexdigest()
