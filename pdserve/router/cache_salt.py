"""Whose prefix cache a request shares: its cache salt, from the client and its API key.

The engine shares prefix-cache blocks only between requests of the same salt (``engine.
block_manager``), and ``cached_tokens`` in usage reports those hits, so a salt is a tenant
boundary: one tenant cannot learn from a hit whether another sent a prompt. A client may set
vLLM's ``cache_salt``. With an API key configured, the router also salts every request by a
hash of the key the caller presented: callers with different keys never share blocks, whatever
salts they choose. Only a hash travels to the workers (and into their logs); never the key.
"""

from __future__ import annotations

import hashlib

_KEY_DOMAIN = b"pdserve cache salt of an API key\0"


def key_salt(authorization: str | None) -> str:
    """The salt of the caller's key, from its ``authorization`` value (``Bearer <key>``, as the
    auth layer checked it); "" when it presented none."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return ""
    return hashlib.sha256(_KEY_DOMAIN + key.encode()).hexdigest()[:32]


def request_salt(client_salt: str, tenant: str) -> str:
    """The salt a request runs under: the client's within its key's tenant (either alone when
    the other is empty), combined by a hash, so no client salt reaches another key's blocks."""
    if not tenant:
        return client_salt
    if not client_salt:
        return tenant
    return hashlib.sha256(f"{tenant}\0{client_salt}".encode()).hexdigest()[:32]
