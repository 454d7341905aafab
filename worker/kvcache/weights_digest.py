"""A checkpoint's identity for the KV tiers: a digest of its config and weights' contents.

KV written to a disk tier outlives the process; it may be served only to the same weights.
Names and sizes do not say that (weights replaced in place with the same shapes keep
both), so every weight file's bytes are hashed (blake2b). Hashing a large checkpoint
takes a while, so each file's digest is cached with its size and modification time:

    <model dir>/.kvserve-weights-digest.json     beside the files, when that is writable
    <tier root>/.weights-digest-<path key>.json  else in a tier's root (a persistent volume
                                                 outlives the pod), only with the store's key
    $XDG_CACHE_HOME/kvserve/weights-digest/<path key>.json   else here
        {"files": {name: [size, mtime_ns, digest]}, "mac": HMAC-SHA256 of "files" (tier roots)}
    <path key>: blake2b of the model directory's resolved path

A cache in a tier root is authenticated with the store's key, as its entries are: a writer
of the store's volume who lacks the key cannot make new weights pass for old ones. The
model directory and the local cache directory are trusted as the weights themselves are.

A file whose size and modification time match its cached line is not read again; any
other file is. (A writer that keeps both while changing the bytes defeats the cache: that
is a deliberate forgery, not a deployment, and the digest is then recomputed by deleting
the cache file.)
"""
from __future__ import annotations

import hashlib
import hmac
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


def _cache_paths(model_dir: Path, tier_roots: list[Path], key: bytes) -> list[tuple[Path, bytes | None]]:
    """Where the cache may live, in order, each with the key its MAC needs (None: no MAC)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path_key = hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=16).hexdigest()
    paths: list[tuple[Path, bytes | None]] = [(model_dir / CACHE_NAME, None)]
    if key:
        paths += [(root / f".weights-digest-{path_key}.json", key) for root in tier_roots]
    return paths + [(home / "kvserve" / "weights-digest" / f"{path_key}.json", None)]


def _mac(key: bytes, files: dict[str, list]) -> str:
    return hmac.new(key, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _read_cache(paths: list[tuple[Path, bytes | None]]) -> dict[str, list]:
    for path, key in paths:
        try:
            data = json.loads(path.read_text())
            files = data.get("files")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(files, dict):
            continue
        if key is not None and not hmac.compare_digest(str(data.get("mac")), _mac(key, files)):
            logger.warning("weights digest cache %s fails its MAC: ignored", path)
            continue
        return files
    return {}


def _write_cache(paths: list[tuple[Path, bytes | None]], files: dict[str, list]) -> None:
    for path, key in paths:
        data = {"files": files} if key is None else {"files": files, "mac": _mac(key, files)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
            os.replace(tmp, path)
            return
        except OSError:
            continue
    logger.info("weights digest: no writable cache for %s; it is recomputed at every start", paths[0][0].parent)


def model_id_of(path: str | Path | None, tier_roots: list[Path] | None = None, key: bytes = b"") -> str:
    """A stable name for a checkpoint's contents: its config and its weight files' bytes
    (replicas reading one model from different paths agree). `tier_roots` and `key`: the
    tiers' directories, where the digests may be cached under the store's key."""
    if path is None:
        return "unknown"
    path = Path(path)
    model_dir = path if path.is_dir() else path.parent
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    cache_paths = _cache_paths(model_dir, tier_roots or [], key)
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
