"""KV by head between tensor-parallel sizes: what a transfer costs when the prefill pool's
size P and the decode pool's D differ (``pdserve/kv_transfer/sharding.py``), against P = D.

Each prefill rank is a holder process over its heads of a block-first cache; each decode rank
an agent in this process over its own. A timed transfer starts every decode rank's reads (one
per rank pair: whole blocks at P = D; otherwise over NIXL the holder's whole blocks into staging,
then the heads put in place, and over tcp the rows' slices in one stream) of the same scattered
blocks and polls all of them every 0.5 ms, as a decode worker does, until every one is done; GB/s is the whole model's KV for those blocks (all heads) over
that time, median over repetitions, and every read is checked against the unsharded cache.

    .venv/bin/python benchmarks/kv_transfer.py --by-head --sizes 8,32,128  # 1:1 2:1 1:2 2:2 4:1 1:4
    .venv/bin/python benchmarks/kv_transfer.py --by-head --pairs 1:2 --sizes 8 --reps 2 --backends tcp

Default block: a Llama-3-8B-shaped KV (8 KV heads of 128 dims) of 16 layers, 16 tokens, bf16:
16 x 2 x 8 x 128 x 2 bytes x 16 tokens = 1 MiB a block, all ranks together.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from pdserve.engine.attention.kv_cache import host_zeros
from pdserve.kv_transfer import TransferState, create_agent
from pdserve.kv_transfer.metadata import publish
from pdserve.kv_transfer.sharding import KVShard
from pdserve.kv_transfer.source import KVSource
from pdserve.protos import kv_transfer_pb2

BLOCK_SIZE, LAYERS, HEADS, HEAD_DIM = 16, 16, 8, 128
BLOCK_BYTES = BLOCK_SIZE * LAYERS * 2 * HEADS * HEAD_DIM * 2  # a block, all ranks together


def _shard(rank: int, size: int, groups: int = 1) -> KVShard:
    return KVShard.of_rank(rank, size, num_kv_heads=HEADS, head_bytes=HEAD_DIM * 2, rows_per_token=2 * LAYERS,
                           block_size=BLOCK_SIZE, dtype="bfloat16", checksum_groups=groups)


def _rank_cache(num_blocks: int, shard: KVShard, fill: bool, device: str = "cpu") -> torch.Tensor:
    """Rank ``shard``'s cache, on huge pages on the host; with ``fill``, head h of block b holds
    (b + h) % 251."""
    shape = (num_blocks, BLOCK_SIZE, LAYERS, 2, shard.head_count, HEAD_DIM * 2)
    cache = host_zeros(shape, torch.uint8) if device == "cpu" else torch.zeros(shape, dtype=torch.uint8, device=device)
    if fill:
        heads = torch.arange(shard.head_start, shard.head_stop)
        cache.copy_(((torch.arange(num_blocks)[:, None] + heads[None, :]) % 251).to(torch.uint8)
                    [:, None, None, None, :, None].expand(shape))
    return cache


def _holder_main(conn, backend: str, num_blocks: int, shard: dict, device: str = "cpu") -> None:
    shard = KVShard(**shard)
    agent = create_agent(backend, f"bench-prefill-tp{shard.tp_rank}", _rank_cache(
        num_blocks, shard, True, device).view(torch.bfloat16), shard=shard)
    conn.send(agent.local_metadata().SerializeToString())
    conn.recv()  # "stop"
    agent.close()


def _check(agent, remote: list[int], local: list[int]) -> None:
    heads = torch.arange(agent.shard.head_start, agent.shard.head_stop)
    want = ((torch.tensor(remote)[:, None] + heads[None, :]) % 251).to(torch.uint8)
    got = agent.cache.view(torch.uint8)[local][:, 0, 0, 0, :, 0].cpu()
    if not torch.equal(got, want):
        raise RuntimeError(f"decode rank {agent.shard.tp_rank}: wrong bytes")


def _transfer(ranks, sources, remote: list[int], local: list[int]) -> tuple[float, int]:
    """Seconds for every decode rank's reads together, and their descriptors a side."""
    start = time.perf_counter()
    handles = [(agent, h) for agent, source in zip(ranks, sources)
               for h in source.start(agent, remote, local, 0, len(remote), lease_token="bench", last=False)]
    deadline = time.monotonic() + 120
    while not all(agent.poll(h).is_terminal for agent, h in handles):  # as a decode worker polls: all of them
        if time.monotonic() > deadline:
            raise RuntimeError("benchmark reads not done in 120 s")
        time.sleep(0.0005)
    for agent, h in handles:
        if h.state != TransferState.DONE:
            raise RuntimeError(f"benchmark read failed: {h.error}")
    return time.perf_counter() - start, sum(h.descriptors for _, h in handles)


def bench_pair(backend: str, prefill_tp: int, decode_tp: int, sizes: list[int], reps: int,
               gen: torch.Generator, device: str = "cpu") -> dict[int, tuple[float, int]]:
    """{blocks per read: (GB/s of the whole KV, descriptors a side over all pairs)} for one pair of
    sizes, every cache on ``device`` (one GPU holds them all there)."""
    num_blocks = 2 * max(sizes)
    groups = max(1, decode_tp // prefill_tp)
    ctx = mp.get_context("spawn")
    holders, conns = [], []
    for r in range(prefill_tp):
        conn, child = ctx.Pipe()
        holders.append(ctx.Process(target=_holder_main, args=(child, backend, num_blocks,
                                                               _shard(r, prefill_tp, groups).__dict__, device)))
        holders[-1].start()
        conns.append(conn)
    ranks = [create_agent(backend, f"bench-decode-tp{s}", _rank_cache(num_blocks, _shard(s, decode_tp), False,
                                                                       device).view(torch.bfloat16),
                          shard=_shard(s, decode_tp)) for s in range(decode_tp)]
    try:
        published = publish([kv_transfer_pb2.AgentMetadata.FromString(c.recv()) for c in conns])
        sources = [KVSource.connect(agent, published) for agent in ranks]
        out = {}
        for n in sizes:
            remote = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            local = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            _transfer(ranks, sources, remote, local)  # warm-up: connect, fault pages in
            for agent in ranks:
                _check(agent, remote, local)
            timed = [_transfer(ranks, sources, remote, local) for _ in range(reps)]
            seconds = statistics.median(t for t, _ in timed)
            out[n] = (n * BLOCK_BYTES / seconds / 1e9, timed[0][1])
        return out
    finally:
        for agent in ranks:
            agent.close()
        for conn, proc in zip(conns, holders):
            conn.send("stop")
            proc.join(10)


def run(backends: list[str], pairs: list[tuple[int, int]], sizes: list[int], reps: int) -> None:
    """Print GB/s and descriptors per transfer for each backend, pair of sizes and read size."""
    gen = torch.Generator().manual_seed(0)
    print(f"\nKV by head: {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} dims x {BLOCK_SIZE} tokens, bf16 "
          f"({_shard(0, 1).block_bytes / 2**20:.2f} MiB a block, all ranks)")
    print(f"{'backend':8} {'P:D':>5} " + " ".join(f"{n:>9} blk" for n in sizes) + "   descriptors a side")
    for backend in backends:
        for p, d in pairs:
            res = bench_pair(backend, p, d, sizes, reps, gen)
            print(f"{backend:8} {f'{p}:{d}':>5} " + " ".join(f"{res[n][0]:>8.2f} GB/s" for n in sizes)
                  + "   " + ", ".join(str(res[n][1]) for n in sizes))
