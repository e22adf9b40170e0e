"""Whose prefix cache a request shares: its cache salt, from the client and its tenant.

The engine shares prefix-cache blocks only between requests of the same salt (``engine.
block_manager``), and ``cached_tokens`` in usage reports those hits, so a salt is a tenant
boundary: one tenant cannot learn from a hit whether another sent a prompt. A client may set
vLLM's ``cache_salt``. With API keys configured, the router also salts every request by its
tenant (``pdserve.router.tenants.Tenant.salt``, a hash of the tenant's name): tenants never
share blocks, whatever salts they choose, and a tenant's keys share its one cache. The
combined salt is set here, in the router, before the request leaves it, so the workers' block
hashes and the router's KV index (prefix routing) read the same one. No key travels to the
workers or into their logs.
"""

from __future__ import annotations

import hashlib


def request_salt(client_salt: str, tenant: str) -> str:
    """The salt a request runs under: the client's within its tenant's (either alone when the
    other is empty), combined by a hash, so no client salt reaches another tenant's blocks."""
    if not tenant:
        return client_salt
    if not client_salt:
        return tenant
    return hashlib.sha256(f"{tenant}\0{client_salt}".encode()).hexdigest()[:32]
