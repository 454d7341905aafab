"""KV export/import for prefill/decode disaggregation, and the transports that move it.

A prefill engine computes a prompt's KV and its first token, then copies the request's
blocks out of its paged cache into a `KVExport`: one compact tensor holding only the
request's blocks, in block order (padded to whole blocks), plus the layout facts a
receiver must match. A decode engine checks those facts against its own cache
(`check_compatible`), writes the tokens into blocks of its own pool and continues.

    paged cache (layers, 2, num_blocks, block_size, Hkv, D)
         gather by the request's block table [17, 3, 42]
    export.kv   (layers, 2, 3 * block_size, Hkv, D)      token i at row i
         scatter into the receiver's own blocks [5, 9, 11]

Only `export.num_tokens` rows are meaningful (the KV of the prompt); the rest of the
last block is padding. The first sampled token (`next_token_id`) has NO KV yet: the
decode side's sequence is prompt + that token with num_computed_tokens = len(prompt).

Transports move an export between processes behind `KVTransport`; the scheduler never
sees them. The default is Ray's object store (works on CPU and across nodes); a
GPU-direct transport (NCCL / NIXL) would implement the same four calls.
"""
from __future__ import annotations

import abc
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv.block_hash import ROOT_HASH

if TYPE_CHECKING:  # torch is imported where tensors are moved: a simulated-device replica never does
    import torch  # torch: the simulated engine (worker/sim/, cluster/sim/) imports this module

    from kv.kv_cache import KVCacheSpec

# The prefill side keeps an exported request's blocks this long when nobody acknowledges
# the transfer (the ingress went away, the decode replica died).
DEFAULT_PIN_TIMEOUT_S = 30.0


class KVTransferError(ValueError):
    """An export that cannot be imported here (layout mismatch, missing or expired handle)."""


class KVSourceLostError(KVTransferError):
    """The export is gone with the replica (or node) that made it: a failure of that
    replica, not of the request. The ingress resumes the request on the decode pool from
    its prompt and the tokens already sent (router/frontend/migration.py lists this name)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class KVExport:
    """One request's KV, detached from any block pool. `kv` is (num_layers, 2,
    num_blocks * block_size, num_kv_heads, head_dim), token i's K/V at row i."""

    request_id: str
    kv: torch.Tensor
    token_ids: list[int]  # the tokens whose KV `kv` holds (the prompt), len == num_tokens
    next_token_id: int | None  # sampled after them; its KV is not in `kv`
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_hashes: list[int] = field(default_factory=list)  # full blocks (kv.block_hash chain)
    # The chain's root: the request's extra keys (cache salt, LoRA adapter). KV computed
    # under one root is valid only for a request of the same root.
    hash_root: int = ROOT_HASH
    num_cached_tokens: int = 0  # prompt tokens the prefill side served from its prefix cache
    num_planes: int = 2  # K and V; 1 for MLA's latent rows (KVCacheSpec.num_planes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def check_compatible(self, spec: KVCacheSpec) -> None:
        """Raise KVTransferError naming every fact that differs from this cache's layout."""
        mine = {
            "block_size": spec.block_size,
            "dtype": dtype_name(spec.dtype),
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "num_planes": spec.num_planes,
        }
        theirs = {k: getattr(self, k) for k in mine}
        problems = [f"{k}: export has {theirs[k]}, this cache has {mine[k]}" for k in mine if theirs[k] != mine[k]]
        expected_shape = (
            self.num_layers, self.num_planes, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim,
        )
        if tuple(self.kv.shape) != expected_shape:
            problems.append(f"tensor shape {tuple(self.kv.shape)} != {expected_shape} (from the declared layout)")
        if dtype_name(self.kv.dtype) != self.dtype:
            problems.append(f"tensor dtype {dtype_name(self.kv.dtype)} != declared {self.dtype}")
        if self.num_tokens == 0:
            problems.append("the export holds no tokens")
        if problems:
            raise KVTransferError(
                f"KV export of request {self.request_id!r} does not fit this engine's KV cache: "
                + "; ".join(problems)
            )


def gather_blocks(kv_caches: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy blocks out of the paged cache (layers, 2, num_blocks, bs, H, D) into a
    contiguous (layers, 2, len(block_ids) * bs, H, D) tensor, in block-table order."""
    import torch  # torch: the simulated engine (worker/sim/, cluster/sim/) imports this module

    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches.device)
    picked = kv_caches.index_select(2, index)  # a copy: the blocks may be reused afterwards
    num_layers, two, num_blocks, block_size, heads, dim = picked.shape
    return picked.reshape(num_layers, two, num_blocks * block_size, heads, dim)


def scatter_blocks(kv_caches: torch.Tensor, block_ids: Sequence[int], kv: torch.Tensor) -> None:
    """Write an export's tensor into the given blocks of the paged cache (the inverse of
    `gather_blocks`). `kv` covers exactly len(block_ids) blocks."""
    import torch  # torch: the simulated engine (worker/sim/, cluster/sim/) imports this module

    from kv.kv_cache import raw_view  # torch-bound, as above

    num_layers, two, _, block_size, heads, dim = kv_caches.shape
    blocks = kv.to(device=kv_caches.device, dtype=kv_caches.dtype).reshape(
        num_layers, two, len(block_ids), block_size, heads, dim
    )
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches.device)
    raw_view(kv_caches).index_copy_(2, index, raw_view(blocks))


# -- transports ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVHandle:
    """What travels from the prefill replica through the ingress to the decode replica.
    Small: the data itself stays in the transport (object store, GPU memory...)."""

    request_id: str
    transport: str  # the KVTransport.name that made it
    ref: Any  # transport-specific (a Ray ObjectRef for the object store)
    num_tokens: int
    nbytes: int
    source_replica_id: str = ""  # where the blocks are pinned (release goes there)


class KVTransport(abc.ABC):
    """Moves KV exports between replicas. The prefill side calls `send` (and `release`
    once the decode side has the data or the transfer is given up); the decode side
    calls `receive`. Neither the engine nor the scheduler depends on which one runs."""

    name: str = "abstract"

    @abc.abstractmethod
    def send(self, export: KVExport, source_replica_id: str = "") -> KVHandle: ...

    @abc.abstractmethod
    async def receive(self, handle: KVHandle) -> KVExport: ...

    @abc.abstractmethod
    def release(self, handle_or_request_id: KVHandle | str) -> None:
        """Drop the sender's copy (idempotent)."""


class LocalKVTransport(KVTransport):
    """Within one process (tests, a mixed replica talking to itself)."""

    name = "local"

    def __init__(self) -> None:
        self._store: dict[Any, KVExport] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def send(self, export: KVExport, source_replica_id: str = "") -> KVHandle:
        with self._lock:
            key = (export.request_id, next(self._keys))
            self._store[key] = export
        return KVHandle(export.request_id, self.name, key, export.num_tokens, export.nbytes, source_replica_id)

    async def receive(self, handle: KVHandle) -> KVExport:
        with self._lock:
            export = self._store.get(handle.ref)
        if export is None:
            raise KVTransferError(f"the KV of request {handle.request_id!r} is no longer available")
        return export

    def release(self, handle_or_request_id: KVHandle | str) -> None:
        with self._lock:
            if isinstance(handle_or_request_id, KVHandle):
                self._store.pop(handle_or_request_id.ref, None)
            else:
                for key in [k for k in self._store if k[0] == handle_or_request_id]:
                    del self._store[key]

    def __len__(self) -> int:
        return len(self._store)


class RayObjectStoreTransport(KVTransport):
    """`ray.put` on the prefill side; the ObjectRef rides in the handle through the
    ingress (Ray tracks the borrowers); the decode side awaits it (never ray.get in async
    code). The prefill replica owns the object and keeps its ref until `release`."""

    name = "ray_object_store"

    def __init__(self) -> None:
        self._refs: dict[str, Any] = {}

    def send(self, export: KVExport, source_replica_id: str = "") -> KVHandle:
        import ray  # ray: only the Ray object-store transport needs it

        if export.kv.device.type != "cpu":
            export.kv = export.kv.cpu()  # the object store holds host memory
        ref = ray.put(export)
        self._refs[export.request_id] = ref
        return KVHandle(export.request_id, self.name, ref, export.num_tokens, export.nbytes, source_replica_id)

    async def receive(self, handle: KVHandle) -> KVExport:
        from ray.exceptions import ObjectLostError  # OwnerDiedError, ObjectFetchTimedOutError, ...

        try:
            export = await handle.ref
        except ObjectLostError as e:  # the prefill replica that owns it died (or its node)
            raise KVSourceLostError(f"the KV of request {handle.request_id!r} was lost with its prefill "
                                    f"replica: {type(e).__name__}") from e
        except Exception as e:
            raise KVTransferError(f"the KV of request {handle.request_id!r} could not be fetched: {e}") from e
        if not isinstance(export, KVExport):
            raise KVTransferError(f"the KV handle of request {handle.request_id!r} holds {type(export).__name__}")
        return export

    def release(self, handle_or_request_id: KVHandle | str) -> None:
        request_id = handle_or_request_id.request_id if isinstance(handle_or_request_id, KVHandle) else handle_or_request_id
        self._refs.pop(request_id, None)


TRANSPORTS: dict[str, type[KVTransport]] = {
    LocalKVTransport.name: LocalKVTransport,
    RayObjectStoreTransport.name: RayObjectStoreTransport,
}


def make_transport(name: str) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r} (known: {', '.join(TRANSPORTS)})")
    return TRANSPORTS[name]()
