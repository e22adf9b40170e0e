"""KV by head between tensor-parallel sizes with the caches on the check's device (run it with
``pytest -m cuda tests/gpu/test_kv_by_head_on_device.py``): NIXL reads the holder's blocks whole
into VRAM staging and puts the heads in place (cuda_ipc between processes,
pdserve/kv_transfer/staged.py), the tcp backend stages rows through the host, and checksums of a
CUDA cache's row groups are summed on the host. Each prefill rank is an agent in its own process
over its heads of one seeded cache, each decode rank an agent here; after the transfer each
decode rank holds the unsharded cache sliced by its heads, every pair verified, and a changed
byte fails the pair that read it. ``PDSERVE_CHECK_DEVICE=cpu`` runs it on the CPU (proving the
test, not CUDA). Written where no GPU was at hand: not yet run on one."""

import sys
from pathlib import Path

import pytest
import torch

from pdserve.kv_transfer import TransferState, create_agent
from pdserve.kv_transfer.metadata import publish
from pdserve.kv_transfer.sharding import KVShard
from pdserve.kv_transfer.source import KVSource
from pdserve.protos import kv_transfer_pb2
from tests.gpu.smol import holder_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_transfer"))
from tp_helpers import ROWS_PER_TOKEN, full_cache, rank_cache, tp_shard  # noqa: E402

pytestmark = pytest.mark.cuda

NUM_BLOCKS, SEED = 8, 77
REMOTE, LOCAL = [5, 2, 7], [0, 3, 1]
_CTX = holder_context()  # spawn on CUDA


def _holder(conn, backend: str, device: str, shard: dict) -> None:
    """A prefill rank: its heads of the seeded cache on ``device``, read until told to stop;
    "flip" changes a byte of one block, as a fault in its memory would."""
    shard = KVShard(**shard)
    cache = rank_cache(full_cache(NUM_BLOCKS, SEED), shard.tp_rank, shard.tp_size).to(device)
    agent = create_agent(backend, f"dev-prefill{shard.tp_size}-tp{shard.tp_rank}", cache, shard=shard)
    conn.send((agent.local_metadata().SerializeToString(), agent.block_checksums(REMOTE)))
    while (cmd := conn.recv()) != "stop":
        cache.view(NUM_BLOCKS, -1).view(torch.uint8)[cmd[0], cmd[1]] ^= 0xFF
        conn.send("flipped")
    agent.close()


class Prefill:
    def __init__(self, backend: str, device: torch.device, size: int, groups: int):
        self.conns, self.procs = [], []
        for r in range(size):
            conn, child = _CTX.Pipe()
            proc = _CTX.Process(target=_holder, args=(child, backend, str(device), tp_shard(r, size, groups).__dict__),
                                daemon=True)
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        answers = [c.recv() for c in self.conns]
        self.published = publish([kv_transfer_pb2.AgentMetadata.FromString(m) for m, _ in answers])
        # The worker's sums: each block's groups, rank by rank (RankRead.checksums reads them so).
        self.sums = tuple(s for b in range(len(REMOTE)) for _, sums in answers for s in sums[b * groups:(b + 1) * groups])

    def flip(self, rank: int, block: int, offset: int) -> None:
        self.conns[rank].send((block, offset))
        assert self.conns[rank].recv() == "flipped"

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            conn.send("stop")
            proc.join(20)


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_each_decode_rank_reads_its_heads_from_device_memory(device, backend, prefill_tp, decode_tp):
    prefill = Prefill(backend, device, prefill_tp, max(1, decode_tp // prefill_tp))
    ranks = [create_agent(backend, f"dev-decode{decode_tp}-tp{s}", rank_cache(full_cache(4), s, decode_tp).to(device),
                          shard=tp_shard(s, decode_tp)) for s in range(decode_tp)]
    try:
        want_full = full_cache(NUM_BLOCKS, SEED)
        for s, agent in enumerate(ranks):
            source = KVSource.connect(agent, prefill.published)
            tail = 2 * ROWS_PER_TOKEN * agent.shard.row_bytes  # the last block holds 2 tokens
            handles = source.start(agent, REMOTE, LOCAL, 0, len(REMOTE), lease_token="t", last=True,
                                   last_block_bytes=tail, sums=None)
            assert all(agent.wait(h, timeout_s=30) == TransferState.DONE for h in handles), [h.error for h in handles]
            got, want = agent.cache.cpu(), rank_cache(want_full, s, decode_tp)
            assert torch.equal(got[LOCAL[:-1]], want[REMOTE[:-1]]) and torch.equal(got[LOCAL[-1], :2], want[REMOTE[-1], :2])
        prefill.flip(prefill_tp - 1, REMOTE[0], 40)  # a byte of the last prefill rank's heads
        failed = []
        for agent in ranks:
            source = KVSource.connect(agent, prefill.published)
            handles = source.start(agent, REMOTE, LOCAL, 0, len(REMOTE), lease_token="t", last=False, sums=prefill.sums)
            failed += [h.verify_failed for h in handles if agent.wait(h, timeout_s=30) is TransferState.FAILED]
        assert failed == [True]  # the one pair that read the changed byte, and only it
    finally:
        for agent in ranks:
            agent.close()
        prefill.stop()
