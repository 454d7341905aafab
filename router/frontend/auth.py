"""API keys and per-key limits of the ingress (HTTP `Authorization: Bearer KEY`, gRPC
metadata `authorization: Bearer KEY`).

Keys come from one environment variable (config `ingress.api_keys_env`, default
KVSERVE_API_KEYS; the Helm chart fills it from a Secret): comma-separated entries, each a
plaintext key or `sha256:<64 hex>` (the key's SHA-256, so that the plaintext need not be
stored anywhere). They are hashed when the ingress starts; only the digests are kept.
A presented key is hashed and compared with every stored digest by
`hmac.compare_digest` (no early exit: the time taken does not depend on which digest, if
any, matches, nor on how much of it matches). No keys configured: authentication is
off (the local default), and the ingress logs that once at start-up.

Per-key limits (concurrent requests, tokens per minute): router/frontend/key_limits.py.

Keys are identified in metrics and limits by `key_id`: the first 12 hex digits of the
digest (never the key).

Admin scope: a second variable (config `ingress.admin_api_keys_env`, default
KVSERVE_ADMIN_API_KEYS; same entry format) lists the admin keys. An admin key is also an
ordinary key. The operator endpoints (adapter load/unload, /reset_prefix_cache) take an
admin key only: 401 without a valid key, 403 with an ordinary one, and 403 too while no
keys are configured at all (auth off opens the request paths, never the operator ones).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass

from router import errors

logger = logging.getLogger(__name__)

DEFAULT_API_KEYS_ENV = "KVSERVE_API_KEYS"
DEFAULT_ADMIN_API_KEYS_ENV = "KVSERVE_ADMIN_API_KEYS"
_SHA256_PREFIX = "sha256:"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class ApiKeyConfigError(ValueError):
    """An entry of the API-key variable that is neither a key nor `sha256:<64 hex>`."""


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id_of(digest: bytes) -> str:
    return digest.hex()[:12]


def parse_key_digests(spec: str) -> list[bytes]:
    """`"key1, sha256:ab12..., key3"` -> the SHA-256 digests. Empty entries are skipped.
    Errors never quote the entry (it may be a secret)."""
    digests: list[bytes] = []
    for position, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lower().startswith(_SHA256_PREFIX):
            hex_digest = entry[len(_SHA256_PREFIX):].strip()
            if not _HEX64.match(hex_digest):
                raise ApiKeyConfigError(f"API key entry {position}: 'sha256:' must be followed by 64 hex digits")
            digests.append(bytes.fromhex(hex_digest))
        else:
            digests.append(hash_key(entry))
    return digests


@dataclass(frozen=True)
class Principal:
    """Who made a request: a key's id, or the anonymous caller when auth is off; `admin`
    when the key is one of the admin keys (never the anonymous caller)."""

    key_id: str
    admin: bool = False


ANONYMOUS = Principal("anonymous")


class ApiKeys:
    """The configured keys, as SHA-256 digests only: ordinary and admin ones."""

    def __init__(self, digests: list[bytes], admin_digests: list[bytes] | None = None) -> None:
        self._admin = frozenset(admin_digests or ())
        # Every key that authenticates, de-duplicated, order kept.
        self._digests = tuple(dict.fromkeys([*digests, *(admin_digests or ())]))

    @classmethod
    def from_env(cls, name: str | None, environ: dict[str, str] | None = None,
                 admin_name: str | None = None) -> ApiKeys:
        env = os.environ if environ is None else environ
        digests = parse_key_digests(env.get(name, "")) if name else []
        admin = parse_key_digests(env.get(admin_name, "")) if admin_name else []
        return cls(digests, admin)

    @property
    def num_admin(self) -> int:
        return len(self._admin)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, key: str) -> Principal | None:
        """The key's principal when it is one of the configured keys. Every digest is
        compared, in constant time each, whatever matches."""
        candidate = hash_key(key)
        found: bytes | None = None
        for digest in self._digests:
            if hmac.compare_digest(candidate, digest):
                found = digest
        return None if found is None else Principal(key_id_of(found), found in self._admin)

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this `Authorization` value (HTTP header or gRPC
        metadata). Auth off: ANONYMOUS. Raises APIError 401 otherwise."""
        if not self.enabled:
            return ANONYMOUS
        key = bearer_token(authorization)
        if key is None:
            raise unauthenticated("Missing API key: send it as 'Authorization: Bearer <key>'.")
        principal = self.match(key)
        if principal is None:
            raise unauthenticated("Incorrect API key provided.")
        return principal

    def log_startup(self, env_name: str | None) -> None:
        if self.enabled:
            logger.info("API key authentication on: %d key(s) from $%s, %d of them admin", len(self), env_name,
                        self.num_admin)
        else:
            logger.warning(
                "API key authentication OFF: no keys in $%s; every client may use this server",
                env_name or "(no api_keys_env)",
            )


def require_admin(principal: Principal) -> None:
    """The operator endpoints' check (after authentication): 403 unless an admin key."""
    if not principal.admin:
        raise errors.APIError(403, "This endpoint needs an admin API key (ingress.admin_api_keys_env).",
                              "permission_error", None, "insufficient_scope")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def grpc_authorization(metadata: list[tuple[str, str | bytes]] | None) -> str | None:
    """The `authorization` entry of gRPC invocation metadata."""
    return grpc_metadata_value(metadata, "authorization")


def grpc_metadata_value(metadata: list[tuple[str, str | bytes]] | None, name: str) -> str | None:
    """The first `name` entry of gRPC invocation metadata (keys arrive lower-case)."""
    for key, value in metadata or ():
        if key.lower() == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def unauthenticated(message: str) -> errors.APIError:
    return errors.APIError(401, message, "invalid_request_error", None, "invalid_api_key")
