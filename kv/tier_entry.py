"""One disk-tier entry's bytes: how a block's KV is written to a file and checked on read.

    b"KVTIER02" | u32 header length | header (JSON object) | payload | HMAC-SHA256 (32 bytes)
        header: fingerprint (model and KV layout), block hash, shape, payload length
        mac:    HMAC-SHA256 under the store's key over everything before it

The MAC is both the checksum (a corrupt or truncated file fails it) and the store's
authentication: an entry written without the key (or with another) fails it too, so a
writer that can reach a shared directory but does not hold its key cannot plant KV. A
store without a key (a private local disk) uses the empty key: the MAC is then only a
checksum. Every check of the header is explicit (its type, every field's type and value):
a malformed entry raises ValueError, never anything else, so that the caller can treat
every bad entry the same way (a miss, deleted and logged).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch

MAGIC = b"KVTIER02"
MAC_BYTES = 32
_PREFIX = len(MAGIC) + 4


def _mac(key: bytes, data: bytes | memoryview) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def encode_entry(fingerprint: dict[str, object], block_hash: int, kv: torch.Tensor, key: bytes = b"") -> bytes:
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "fingerprint": fingerprint,
        "block_hash": f"{block_hash:016x}",
        "shape": list(kv.shape),
        "nbytes": len(payload),
    }).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + _mac(key, body)


def decode_entry(data: bytes, fingerprint: dict[str, object], block_hash: int,
                 shape: tuple[int, ...], dtype: torch.dtype, key: bytes = b"") -> torch.Tensor:
    """The entry's KV, or ValueError naming the first check that failed."""
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a KV tier entry (bad magic)")
    if len(data) < _PREFIX + MAC_BYTES:
        raise ValueError("truncated entry")
    body, mac = memoryview(data)[:-MAC_BYTES], data[-MAC_BYTES:]
    # The MAC first: nothing an unauthenticated writer put in the header is even parsed.
    if not hmac.compare_digest(_mac(key, body), mac):
        raise ValueError("authentication failed (corrupt, truncated, or written without this store's key)")
    (header_len,) = struct.unpack("<I", data[len(MAGIC) : _PREFIX])
    if _PREFIX + header_len > len(body):
        raise ValueError("header longer than the entry")
    try:
        header = json.loads(bytes(body[_PREFIX : _PREFIX + header_len]))
    except (ValueError, UnicodeDecodeError):
        raise ValueError("unreadable header") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a {type(header).__name__}, not an object")
    if header.get("fingerprint") != fingerprint:
        raise ValueError(f"foreign entry: {header.get('fingerprint')} != {fingerprint}")
    if header.get("block_hash") != f"{block_hash:016x}":
        raise ValueError("entry is for another block")
    entry_shape = header.get("shape")
    if not isinstance(entry_shape, list) or [int(d) for d in shape] != entry_shape:
        raise ValueError(f"entry has shape {entry_shape!r}, expected {list(shape)}")
    payload = body[_PREFIX + header_len :]
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    nbytes = header.get("nbytes")
    if type(nbytes) is not int or nbytes != len(payload) or nbytes != expected:
        raise ValueError(f"payload of {len(payload)} bytes, header says {nbytes!r}, the shape needs {expected}")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
