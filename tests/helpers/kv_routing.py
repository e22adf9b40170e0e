"""Two real prefill workers and a real decode worker (tiny float32 model, tcp KV backend), each
behind its gRPC server in this process, under a router pool that polls only when told, and the
shared-prefix prompts sent through them (tests/prefill_worker/test_kv_routing.py,
tests/router/test_tenant_cache.py)."""

import contextlib

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.router.pool import WorkerPool
from tests.factories import decode_worker_config, make_engine, prefill_worker_config, random_prompts

BLOCK = 16
SYSTEM = random_prompts(1, [3 * BLOCK], seed=21)[0]  # a shared prefix of 3 full blocks
QUESTIONS = random_prompts(3, [7, 9, 5], seed=22)


@contextlib.asynccontextmanager
async def cluster(model_dir, prefill_blocks: int):
    """Two prefill workers and a decode worker, and a router pool over them that polls only
    when the test says (``pool.refresh``), so the test decides how stale the index is."""
    prefills = [PrefillWorker(prefill_worker_config(worker_id=f"prefill-{i}", kv_transfer_backend="tcp"),
                              engine=make_engine(model_dir, num_blocks=prefill_blocks, block_size=BLOCK))
                for i in range(2)]
    decode = DecodeWorker(decode_worker_config(kv_transfer_backend="tcp"), engine=make_engine(model_dir, num_blocks=64))
    servers = [await start_prefill(p.config, p) for p in prefills] + [await start_decode(decode.config, decode)]
    pool = WorkerPool()
    for s in servers[:2]:
        pool.add("prefill", s.address)
    pool.add("decode", servers[2].address)
    await pool.refresh()
    try:
        yield pool, dict(zip((s.address for s in servers), prefills))
    finally:
        await pool.close()
        for s in servers:
            await s.stop()
