"""The KV tier below the prefix cache (docs/kv_tier.md): evicted prefix blocks kept in a
directory that the workers of a host share, and brought back, verified, on a prefix hit."""
