"""What both kinds of ``pdserve worker`` process share, whichever role they serve
(``worker_cli`` for a prefill or decode worker, ``worker_router`` for the router): the engine
and internal-plane settings read from the resolved values, and the wait for SIGTERM.

A module of its own so that the two entry modules need nothing of each other.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any


def engine_config(v: dict[str, Any]):
    """The engine's config from the resolved settings of ``pdserve worker`` (a deployment's
    workers are a disaggregated cluster's: a decode worker's local prefill is capped by default,
    as ``pdserve serve`` caps it, ``DISAGGREGATED_MIXED_PREFILL_TOKENS``)."""
    from pdserve.engine.config import (DISAGGREGATED_MIXED_PREFILL_TOKENS, CacheConfig, EngineConfig,
                                       SchedulerConfig)
    from pdserve.cluster.serve_config import mixed_step_target_s

    mixed = v["mixed_prefill_tokens"]
    return EngineConfig(model=v["model"], dtype=v["dtype"], max_model_len=v["max_model_len"],
                        cuda_graphs=v["cuda_graphs"], tensor_parallel_size=v["tensor_parallel_size"],
                        cache=CacheConfig(block_size=v["block_size"],
                                          memory_budget_bytes=int(v["kv_cache_gib"] * (1 << 30))),
                        scheduler=SchedulerConfig(
                            mixed_prefill_tokens=DISAGGREGATED_MIXED_PREFILL_TOKENS if mixed is None else mixed,
                            mixed_step_target_s=mixed_step_target_s(v)))


def internal_tls(v: dict[str, Any]):
    """The internal plane's certificate (``--tls-cert/--tls-key/--tls-ca``), checked to name
    the process's role; None without one."""
    from pdserve.wire import tls

    return tls.check_role(tls.load(v["tls_cert"], v["tls_key"], v["tls_ca"], prefix="tls"), v["role"], "tls_cert")


async def stop_signal() -> None:
    """Return once this process gets SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
