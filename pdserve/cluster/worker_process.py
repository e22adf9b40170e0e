"""One prefill or decode worker as a plain process that joins no router: ``python -m
pdserve.cluster.worker_process prefill --model DIR``. It prints ``listening on HOST:PORT`` once
it serves, and drains on SIGTERM (or SIGINT): health turns NOT_SERVING, new requests are
refused, in-flight ones get up to ``--drain-grace-s`` to finish, then it exits 0.

``pdserve worker --role`` (``pdserve.cluster.worker_cli``) is the one a Kubernetes Deployment
runs: it also joins a router's table and leaves it on SIGTERM. This entry serves a worker
whose address its caller passes on by hand (the drain tests do), with flags of its own for
the core pinning, block count and request bound.

Under Ray (``pdserve.cluster.actors.ServerActor``) the actor installs the same drain as its process's
SIGTERM handler in place of Ray's (which exits at once); this module's handler is for
processes that Ray does not own.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pdserve.cluster.settings import (DRAIN_GRACE_SECONDS, LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS, SettingsError,
                                      check_lease_outlives_transfer, flag_type, serve_settings)
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.kv_transfer import BACKENDS, DEFAULT_BACKEND
from pdserve.wire.logs import FORMATS, LEVELS, LogConfig, configure


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.cluster.worker_process", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--model", default="default", help="'default', a HF directory or a .gguf file")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--kv-transfer-backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: the memory budget's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the worker runs the model on")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--drain-grace-s", type=flag_type(DRAIN_GRACE_SECONDS, "--drain-grace-s"),
                   default=DRAIN_GRACE_SECONDS.default, help=DRAIN_GRACE_SECONDS.help)
    p.add_argument("--max-requests", type=int, default=1024,
                   help="requests held at once; past it RESOURCE_EXHAUSTED at once")
    p.add_argument(LEASE_SECONDS.flag, type=flag_type(LEASE_SECONDS), default=LEASE_SECONDS.default,
                   help=f"{LEASE_SECONDS.help} (prefill only)")
    p.add_argument(TRANSFER_TIMEOUT_SECONDS.flag, type=flag_type(TRANSFER_TIMEOUT_SECONDS),
                   default=TRANSFER_TIMEOUT_SECONDS.default, help=f"{TRANSFER_TIMEOUT_SECONDS.help} (decode only)")
    speculative = next(s for s in serve_settings() if s.name == "speculative_config")
    p.add_argument(speculative.flag, type=flag_type(speculative), default=None, metavar="JSON",
                   help=f"{speculative.help} (decode only)")
    for name in ("kv_offload_bytes", "kv_offload_dir"):
        tier = next(s for s in serve_settings() if s.name == name)
        p.add_argument(tier.flag, type=flag_type(tier), default=None, help=tier.help)
    p.add_argument("--cpus", default="", help="cores to pin to, e.g. 0,1 (default: any)")
    p.add_argument("--log-level", default=LogConfig.level, choices=LEVELS)
    p.add_argument("--log-format", default=LogConfig.format, choices=FORMATS)
    return p


def _config(args):
    from pdserve.cluster.tier_settings import kv_tier_config

    cache = CacheConfig(num_blocks=args.num_blocks)
    kv_tier = kv_tier_config(args.kv_offload_bytes, args.kv_offload_dir, tensor_parallel_size=args.tensor_parallel_size,
                             prefix_cache=cache.enable_prefix_cache)
    engine = EngineConfig(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                          cache=cache, kv_tier=kv_tier,
                          speculative=args.speculative_config if args.role == "decode" else None)
    common = dict(worker_id=args.worker_id or f"{args.role}-0", engine=engine, host=args.host, port=args.port,
                  kv_transfer_backend=args.kv_transfer_backend,
                  max_requests=args.max_requests,
                  cpus=tuple(int(c) for c in args.cpus.split(",") if c))
    if args.role == "prefill":
        from pdserve.prefill_worker.config import PrefillWorkerConfig

        return PrefillWorkerConfig(lease_seconds=args.lease_seconds, **common)
    from pdserve.decode_worker.worker import DecodeWorkerConfig

    return DecodeWorkerConfig(transfer_timeout_s=args.transfer_timeout_seconds, lease_seconds=args.lease_seconds, **common)


async def run(config, role: str, drain_grace_s: float) -> None:
    """Serve until SIGTERM or SIGINT, then drain (in-flight requests get ``drain_grace_s``)
    and return."""
    if role == "prefill":
        from pdserve.prefill_worker.server import start
    else:
        from pdserve.decode_worker.server import start
    running = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {running.address}", flush=True)
    await stop.wait()
    print(f"draining (grace {drain_grace_s:.0f} s)", flush=True)
    await running.drain(drain_grace_s)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_lease_outlives_transfer(args.lease_seconds, args.transfer_timeout_seconds)
        config = _config(args)
    except SettingsError as exc:
        parser.error(str(exc))
    configure(LogConfig(args.log_level, args.log_format), config.worker_id)
    asyncio.run(run(config, args.role, args.drain_grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())

