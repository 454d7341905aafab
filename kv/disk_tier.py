"""The disk KV tier: one file per full prefix block, named by its chain hash.

    <directory>/<block hash, 16 hex digits>.kv
        b"KVTIER01" | u32 header length | header (JSON) | payload (the block's KV bytes)
        header: fingerprint (model and KV layout), block hash, shape, dtype, payload
                length, blake2b-128 of the payload

Content-addressed: two writers of one hash write the same bytes, so a directory can be
shared by replicas of one model (the shared store, `shared=True`). Every write goes to a
temporary file in the same directory and is renamed over the final name (atomic on
POSIX), so a reader sees a whole entry or none; a half-written file left by a crash has
a temporary name and is never read.

An entry is served only when every check passes: magic, header, fingerprint (another
model's or another layout's KV is foreign), block hash, length (a truncated file) and
checksum (a corrupt one). A failed entry is deleted and reported as a miss: the caller
recomputes it. A write that fails (a full disk, a read-only or vanished directory) turns
writing off with one log line; the tiers above keep working and reads go on.

Bounded: `capacity_bytes` over this process's view of the entries, least recently used
first out. In a shared directory other replicas add entries this process does not know:
when its own count passes the bound it rescans the directory and deletes the oldest by
modification time (a read refreshes it) until the whole directory is below a low-water
mark under the bound.
Thread-safe: the engine thread looks up, a background thread reads and writes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from kv.kv_cache import KVCacheSpec
from kv.kv_events import DISK, KVEventLog
from kv.transfer import dtype_name

logger = logging.getLogger(__name__)

MAGIC = b"KVTIER01"
# A shared directory, once over its bound, is cut to this share of it: each cut rescans
# the directory, so it must make room for many writes, not one.
SHARED_LOW_WATER = 0.9
SUFFIX = ".kv"


def layout_fingerprint(spec: KVCacheSpec, model_id: str) -> dict[str, object]:
    """What must match for an entry's KV to be valid here: the model and the KV layout."""
    fingerprint: dict[str, object] = {
        "model": model_id,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "block_size": spec.block_size,
        "dtype": dtype_name(spec.dtype),
    }
    if spec.latent:  # keys of the K/V layouts stay what they were
        fingerprint["latent"] = True
    return fingerprint


def fingerprint_key(fingerprint: dict[str, object]) -> str:
    """A directory name per model and layout: replicas of other models sharing one volume
    keep to their own subdirectory (the same tokens give the same chain hash everywhere)."""
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=8).hexdigest()


def entry_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def encode_entry(fingerprint: dict[str, object], block_hash: int, kv: torch.Tensor) -> bytes:
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "fingerprint": fingerprint,
        "block_hash": f"{block_hash:016x}",
        "shape": list(kv.shape),
        "nbytes": len(payload),
        "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(data: bytes, fingerprint: dict[str, object], block_hash: int,
                 shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The entry's KV, or ValueError naming the first check that failed."""
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a KV tier entry (bad magic)")
    start = len(MAGIC) + 4
    if len(data) < start:
        raise ValueError("truncated header")
    (header_len,) = struct.unpack("<I", data[len(MAGIC) : start])
    try:
        header = json.loads(data[start : start + header_len])
    except ValueError:
        raise ValueError("unreadable header") from None
    if header.get("fingerprint") != fingerprint:
        raise ValueError(f"foreign entry: {header.get('fingerprint')} != {fingerprint}")
    if header.get("block_hash") != f"{block_hash:016x}" or tuple(header.get("shape", ())) != tuple(shape):
        raise ValueError("entry is for another block or shape")
    payload = data[start + header_len :]
    if len(payload) != header.get("nbytes"):
        raise ValueError(f"truncated payload ({len(payload)} of {header.get('nbytes')} bytes)")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b"):
        raise ValueError("checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class DiskTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, spec: KVCacheSpec,
                 model_id: str, shared: bool = False) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.spec = spec
        self.fingerprint = layout_fingerprint(spec, model_id)
        self.shared = shared
        self.block_shape = (spec.num_layers, spec.num_planes, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.writable = True
        self.num_dropped = 0  # entries that failed a check (deleted, recomputed)
        self.num_written = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._num_bytes = 0
        # Entries gained and lost, for the router's index (kv/kv_events.py); set on a
        # replica's local disk only, recorded under the lock so that they keep its order.
        self.events: KVEventLog | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._stop_writing(e)

    # -- lookups (engine thread) ---------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            if block_hash in self._entries:
                return True
        # Another replica may have stored it (a stat: only on a miss of this process's view).
        return self.shared and (self.directory / entry_name(block_hash)).is_file()

    def knows(self, block_hash: int) -> bool:
        """In this process's view (no file-system call)."""
        with self._lock:
            return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` entries of this process's view, most recently used first."""
        with self._lock:
            out = []
            for block_hash in reversed(self._entries):
                out.append(block_hash)
                if len(out) >= limit:
                    break
            return out

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    # -- reads and writes (any thread) -------------------------------------------------------
    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV, (layers, 2, block_size, Hkv, D), or None when it is missing or
        failed a check (then it is deleted)."""
        path = self.directory / entry_name(block_hash)
        try:
            data = path.read_bytes()
        except OSError:  # gone (evicted by another replica) or unreadable: a miss
            self._forget(block_hash)
            return None
        try:
            kv = decode_entry(data, self.fingerprint, block_hash, self.block_shape, self.spec.dtype)
        except ValueError as e:
            logger.warning("KV tier entry %s dropped (%s); its block will be recomputed", path, e)
            self.num_dropped += 1
            self._forget(block_hash)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if block_hash not in self._entries:
                self._add(block_hash, len(data))
            self._entries.move_to_end(block_hash)
        if self.shared:  # recency other replicas see: a rescan orders by modification time
            try:
                os.utime(path)
            except OSError:
                pass
        return kv

    def put(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Store one block (layers, 2, block_size, Hkv, D); False when writing is off or fails."""
        if not self.writable:
            return False
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return True
        data = encode_entry(self.fingerprint, block_hash, kv)
        path = self.directory / entry_name(block_hash)
        tmp = self.directory / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._stop_writing(e)
            return False
        with self._lock:
            self._add(block_hash, len(data))
            self.num_written += 1
            over = self._num_bytes > self.capacity_bytes
        if over:
            self._shrink()
        return True

    def clear(self) -> None:
        with self._lock:
            hashes = list(self._entries)
        for block_hash in hashes:
            self._forget(block_hash)
            (self.directory / entry_name(block_hash)).unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------
    def _add(self, block_hash: int, nbytes: int) -> None:
        """Under the lock."""
        old = self._entries.pop(block_hash, None)
        if old is None and self.events is not None:
            self.events.stored(block_hash, DISK)
        old = old or 0
        self._entries[block_hash] = nbytes
        self._num_bytes += nbytes - old

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            nbytes = self._entries.pop(block_hash, None)
            if nbytes is not None:
                self._num_bytes -= nbytes
                if self.events is not None:
                    self.events.removed(block_hash, DISK)

    def _shrink(self) -> None:
        """Delete least recently used entries until the directory fits its bound."""
        target = self.capacity_bytes
        if self.shared:
            self._scan()  # others' entries count too; oldest first by mtime
            target = int(self.capacity_bytes * SHARED_LOW_WATER)
        while True:
            with self._lock:
                if self._num_bytes <= target or not self._entries:
                    return
                block_hash, nbytes = self._entries.popitem(last=False)
                self._num_bytes -= nbytes
                if self.events is not None:
                    self.events.removed(block_hash, DISK)
            (self.directory / entry_name(block_hash)).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Rebuild the view from the directory (entries written before this process started,
        or by other replicas), oldest modification first."""
        found = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                    continue
                try:
                    block_hash = int(entry.name[: -len(SUFFIX)], 16)
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, block_hash, stat.st_size))
        found.sort()
        with self._lock:
            self._entries.clear()
            self._num_bytes = 0
            for _, block_hash, size in found:
                self._add(block_hash, size)

    def _stop_writing(self, error: OSError) -> None:
        if self.writable:
            logger.warning("KV tier directory %s is not writable (%s): blocks stop moving down to it; "
                           "the tiers above keep serving", self.directory, error)
        self.writable = False
