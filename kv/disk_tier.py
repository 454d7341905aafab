"""The disk KV tier: one file per full prefix block, named by its chain hash.

    <directory>/<block hash, 16 hex digits>.kv     (0600, in a 0700 directory)
        the entry format: kv/tier_entry.py (a header, the KV bytes, an HMAC-SHA256)

Content-addressed: two writers of one hash write the same bytes, so a directory can be
shared by replicas of one model (the shared store, `shared=True`). Every write goes to a
temporary file in the same directory and is renamed over the final name (atomic on
POSIX), so a reader sees a whole entry or none; a temporary file left by a crash is never
read, and deleted when a store next opens (kv/tier_store.py).

An entry is served only when every check passes: magic, the MAC under the store's `key`
(a corrupt or truncated entry, or one written without the key), the header's type and
fields, the fingerprint (another model's or layout's KV is foreign), block hash, shape and
length. Any failed entry is deleted, logged and reported as a miss: the caller recomputes
it. `get` never raises. A write that fails (a full disk, a read-only or vanished
directory) turns writing off with one log line; the tiers above keep working, reads go
on, and writing is tried again after a back-off (`retry_after_s`, doubling to
`MAX_RETRY_S`): a disk with room again takes writes again.

Bounded: `capacity_bytes` over the directory. A private directory (this process's) is
counted exactly, least recently used first out. A shared directory is measured: other
replicas add entries this process does not see, so every writer rescans the directory
(oldest modification first; a read refreshes it) whenever its own writes since its last
scan reach a quarter of the room that scan left, and when over the bound deletes the
oldest entries until the whole directory is below a low-water mark under it. So the
bound holds whatever the number of writers: each one measures, none trusts its own count.

No file-system call runs on the engine thread: `in` and `knows` read this process's view
only. A shared store's view learns other replicas' entries from `refresh`, which the tier
manager runs on its I/O thread.
Thread-safe: the engine thread looks up, a background thread reads and writes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from kv.kv_cache import KVCacheSpec
from kv.kv_events import DISK, KVEventLog
from kv.tier_entry import decode_entry, encode_entry
from kv.tier_store import TMP_SUFFIX, remove_leftover_tmp
from kv.transfer import dtype_name

logger = logging.getLogger(__name__)

# A shared directory, once over its bound, is cut to this share of it: each cut rescans
# the directory, so it must make room for many writes, not one.
SHARED_LOW_WATER = 0.9
# A shared writer rescans once its own writes since its last scan reach this share of the
# room that scan left (other writers fill the rest meanwhile).
SHARED_RESCAN_SHARE = 0.25
SUFFIX = ".kv"
RETRY_AFTER_S = 5.0
MAX_RETRY_S = 300.0


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


class DiskTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, spec: KVCacheSpec,
                 model_id: str, shared: bool = False, key: bytes = b"", retry_after_s: float = RETRY_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what the write back-off is timed by (a test's own clock steps it)."""
        self._clock = clock
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.spec = spec
        self.fingerprint = layout_fingerprint(spec, model_id)
        self.shared = shared
        self._key = key
        self.block_shape = (spec.num_layers, spec.num_planes, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.writable = True
        self._retry_after_s = retry_after_s
        self._backoff_s = retry_after_s
        self._retry_at = 0.0  # clock time of the next write attempt while not writable
        self.num_dropped = 0  # entries that failed a check (deleted, recomputed)
        self.num_written = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._num_bytes = 0
        self._written_since_scan = 0  # bytes this process wrote since its last scan
        self._room_at_scan = capacity_bytes  # what the last scan left under the bound
        # Entries gained and lost, for the router's index (kv/kv_events.py); set on a
        # replica's local disk only, recorded under the lock so that they keep its order.
        self.events: KVEventLog | None = None
        try:
            self._open_directory()
            remove_leftover_tmp(self.directory)
            self._scan()
        except OSError as e:
            self._stop_writing(e)

    # -- lookups (engine thread: no file-system call) ---------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._entries

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

    @property
    def accepts_writes(self) -> bool:
        """Writing is on, or off and due to be tried again."""
        return self.writable or self._clock() >= self._retry_at

    # -- reads and writes (the I/O thread) ---------------------------------------------------
    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV, (layers, 2, block_size, Hkv, D), or None when it is missing or
        failed a check (then it is deleted). Never raises."""
        path = self.directory / entry_name(block_hash)
        try:
            data = path.read_bytes()
        except OSError:  # gone (evicted by another replica) or unreadable: a miss
            self._forget(block_hash)
            return None
        try:
            kv = decode_entry(data, self.fingerprint, block_hash, self.block_shape, self.spec.dtype, self._key)
        except Exception as e:  # every bad entry alike: decode_entry raises ValueError by design
            logger.warning("KV tier entry %s dropped (%s); its block will be recomputed", path, e)
            self.num_dropped += 1
            self._forget(block_hash)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
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
        if not self.writable and not self._may_retry():
            return False
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return True
        data = encode_entry(self.fingerprint, block_hash, kv, self._key)
        path = self.directory / entry_name(block_hash)
        tmp = self.directory / f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._stop_writing(e)
            return False
        self._writing_again()
        with self._lock:
            self._add(block_hash, len(data))
            self.num_written += 1
            self._written_since_scan += len(data)
            over = self._num_bytes > self.capacity_bytes
            rescan = self.shared and self._written_since_scan >= SHARED_RESCAN_SHARE * self._room_at_scan
        if over or rescan:
            self._shrink()
        return True

    def refresh(self) -> None:
        """Re-read the directory into this process's view (a shared store: what other
        replicas wrote); the I/O thread only."""
        try:
            self._scan()
        except OSError as e:
            logger.debug("KV tier %s: rescan failed (%s)", self.directory, e)

    def clear(self) -> None:
        with self._lock:
            hashes = list(self._entries)
        for block_hash in hashes:
            self._forget(block_hash)
            try:
                (self.directory / entry_name(block_hash)).unlink(missing_ok=True)
            except OSError:
                pass

    # -- internals -------------------------------------------------------------------------
    def _open_directory(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # mkdir's mode is masked, and an old one may be wider

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
            self.refresh()  # others' entries count too; oldest first by mtime
            if self._num_bytes <= self.capacity_bytes:
                return
            target = int(self.capacity_bytes * SHARED_LOW_WATER)
        while True:
            with self._lock:
                if self._num_bytes <= target or not self._entries:
                    self._room_at_scan = max(self.capacity_bytes - self._num_bytes, 0)
                    return
                block_hash, nbytes = self._entries.popitem(last=False)
                self._num_bytes -= nbytes
                if self.events is not None:
                    self.events.removed(block_hash, DISK)
            try:
                (self.directory / entry_name(block_hash)).unlink(missing_ok=True)
            except OSError:
                pass

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
            self._written_since_scan = 0
            self._room_at_scan = max(self.capacity_bytes - self._num_bytes, 0)

    def _may_retry(self) -> bool:
        """Writing is off: True once its back-off has passed (the directory is made again)."""
        if self._clock() < self._retry_at:
            return False
        try:
            self._open_directory()
        except OSError as e:
            self._stop_writing(e)
            return False
        return True

    def _writing_again(self) -> None:
        if not self.writable:
            logger.warning("KV tier directory %s takes writes again", self.directory)
        self.writable = True
        self._backoff_s = self._retry_after_s

    def _stop_writing(self, error: OSError) -> None:
        if self.writable:
            logger.warning("KV tier directory %s is not writable (%s): blocks stop moving down to it "
                           "(tried again in %.0f s); the tiers above keep serving",
                           self.directory, error, self._backoff_s)
        else:
            self._backoff_s = min(self._backoff_s * 2, MAX_RETRY_S)
        self.writable = False
        self._retry_at = self._clock() + self._backoff_s
