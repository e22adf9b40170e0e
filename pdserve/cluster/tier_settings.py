"""The KV tier's settings of ``pdserve serve`` and ``pdserve worker`` (``--kv-offload-bytes``,
``--kv-offload-dir``), and how they become the engine's ``KVTierConfig`` (``kv_tier_config``),
checked before anything starts.

Every prefill, decode and elastic worker gets the same tier: its workers of one host share the
directory, so a prefix that one evicted is found by the others (docs/kv_tier.md). The engine
refuses a tier it cannot serve; the same refusals are made here, at start, naming the flag.
"""

from __future__ import annotations

import os

from pdserve.cluster.setting import ByteSize, Setting, SettingsError


def tier_settings() -> tuple[Setting, ...]:
    """The two settings; both off (None) by default."""
    return (
        Setting("kv_offload_bytes", ByteSize, None,
                "a KV tier below each worker's prefix cache: prefix blocks evicted from KV memory are kept, up to "
                "this many bytes over all the workers of a host that share it (e.g. 8GiB, or plain bytes), and "
                "come back, verified, when a prompt matches them (docs/kv_tier.md; needs the prefix cache and "
                "--tensor-parallel-size 1; default: off)", minimum=1),
        Setting("kv_offload_dir", str, None,
                "the KV tier's directory, shared by the workers of a host (default: /dev/shm/pdserve-kv-tier "
                "next to a GPU, host memory; $TMPDIR/pdserve-kv-tier on a CPU host); needs --kv-offload-bytes"),
    )


def kv_tier_config(offload_bytes: int | None, offload_dir: str | None, *, tensor_parallel_size: int,
                   prefix_cache: bool):
    """The engine's ``KVTierConfig`` (None without ``--kv-offload-bytes``). ``SettingsError``
    naming the flag for a directory without a size, a worker of more than one rank, or no prefix
    cache (the tier holds the prefix cache's blocks). A relative directory is made absolute:
    workers start where Ray puts them."""
    from pdserve.engine.config import KVTierConfig

    if offload_bytes is None:
        if offload_dir is not None:
            raise SettingsError("--kv-offload-dir needs --kv-offload-bytes (the tier's bound; or "
                                "PDSERVE_KV_OFFLOAD_BYTES)")
        return None
    if tensor_parallel_size > 1:
        raise SettingsError(f"kv_offload_bytes (--kv-offload-bytes): the KV tier serves workers of "
                            f"tensor_parallel_size 1 only, got {tensor_parallel_size}")
    if not prefix_cache:
        raise SettingsError("kv_offload_bytes (--kv-offload-bytes): the KV tier keeps the prefix cache's blocks; "
                            "it needs --enable-prefix-caching")
    if offload_dir is not None and not offload_dir.strip():
        raise SettingsError("kv_offload_dir (--kv-offload-dir): an empty path")
    return KVTierConfig(offload_bytes=int(offload_bytes),
                        offload_dir=None if offload_dir is None else os.path.abspath(offload_dir))
