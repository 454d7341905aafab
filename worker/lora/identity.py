"""An adapter's identity is its content: the SHA-256 of its files (adapter_config.json and
adapter_model.safetensors), read with their sizes checked first.

The reference that names an adapter to the workers (GenerateRequest.lora_path, the
registry's path) is `<directory>#sha256=<hex>` once the digest is known: the prefix-cache
root (worker/api.py lora_cache_key) then changes when the files do, and a worker that
reads files whose digest differs from the reference refuses them (LoRAAdapterError), so
neither old weights under a new identity nor new weights under an old one are served.
A reference without a digest (a configured adapter the ingress cannot read) is a plain
directory.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.api import LoRAAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1024**2
_DIGEST_MARK = "#sha256="


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's two files, read whole, and the digest of both."""

    config: bytes
    weights: bytes
    digest: str


def make_ref(path: str, digest: str) -> str:
    return f"{path}{_DIGEST_MARK}{digest}"


def split_ref(ref: str) -> tuple[str, str | None]:
    """(directory, digest or None) of a reference."""
    path, mark, digest = ref.rpartition(_DIGEST_MARK)
    return (path, digest) if mark else (ref, None)


def read_bounded(file: Path, max_bytes: int, what: str) -> bytes:
    """The file's bytes, its size checked (stat) before it is read; errors name no path."""
    try:
        size = os.stat(file).st_size
        if size > max_bytes:
            raise LoRAAdapterError(f"the adapter's {what} is {size} bytes; this server reads at most {max_bytes}")
        with open(file, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise LoRAAdapterError(f"the adapter has no {what} (or cannot read it)") from None
    if len(data) > max_bytes:  # grew between stat and read
        raise LoRAAdapterError(f"the adapter's {what} is larger than {max_bytes} bytes")
    return data


def read_adapter_files(ref: str, max_bytes: int, check_config: Callable[[bytes], object] | None = None) -> AdapterFiles:
    """Read a reference's files (config and weights each at most `max_bytes`); a digest in
    the reference must match what was read. `check_config` sees the config before the
    weights are read (a bad config is refused first)."""
    path, expected = split_ref(ref)
    directory = Path(path)
    config = read_bounded(directory / CONFIG_FILE, min(max_bytes, MAX_CONFIG_BYTES), CONFIG_FILE)
    if check_config is not None:
        check_config(config)
    weights = read_bounded(directory / WEIGHTS_FILE, max_bytes, WEIGHTS_FILE)
    digest = content_digest(config, weights)
    if expected is not None and digest != expected:
        raise LoRAAdapterError("the adapter's files changed since it was loaded; unload it and load it again")
    return AdapterFiles(config, weights, digest)


def content_digest(config: bytes, weights: bytes) -> str:
    h = hashlib.sha256()
    for part in (config, weights):  # length-prefixed: no two splits of one byte string collide
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def confine(path: str, roots: tuple[str, ...]) -> str:
    """`path` resolved (realpath: `..` and symlinks followed), when inside one of `roots`
    (each resolved too); else LoRAAdapterError naming no path."""
    if not os.path.isabs(path):
        raise LoRAAdapterError("lora_path must be an absolute path")
    resolved = os.path.realpath(path)
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([resolved, real_root]) == real_root:
            return resolved
    raise LoRAAdapterError("lora_path is not inside a configured adapter root (lora.adapter_roots)")
