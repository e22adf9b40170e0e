"""Different tensor-parallel sizes on the two pools, end to end in this process: a real prefill
worker of TP P and a real decode worker of TP D (each rank after 0 a child process; rank 0
creates every rank's KV agent over its share of the one shared cache file), behind their gRPC
servers, with the real request run as the router, over real NIXL and tcp, at (P, D) = (2, 1)
and (1, 2), the whole prompt at once and streamed chunk by chunk (both on one pair of workers).

Checked: float32 greedy tokens equal transformers; no transfer fails or fails its checksums;
each decode rank's cache holds, for every prompt token, exactly its heads of the prefill
worker's KV (byte for byte, read from both engines' caches in this process), and that KV
equals what a local TP-D engine computes for the same prompt (to float32 rounding: the ranks'
all-reduces add partial sums in another order than one rank's matmul, so layers past the first
may differ in the last bits); every lease ends and every block is freed on both sides."""

import asyncio
import contextlib
import functools

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.request_run import RequestRun
from tests.factories import (assert_greedy_matches, decode_worker_config, make_engine, make_tp_engine,
                             prefill_worker_config, random_prompts)
from tests.helpers.kv_layout import by_token
from tests.helpers.worker_servers import serving
from tests.metrics.metrics_helpers import LetterTokenizer

pytestmark = pytest.mark.slow

BLOCK, CHUNK, BLOCKS, MAX_TOKENS = 16, 32, 64, 8
PROMPT = random_prompts(1, [70], seed=5)[0]  # 5 blocks, the last partly filled; 3 chunks when streamed


def engine(model_dir, tp: int, **kwargs):
    kwargs = dict(num_blocks=BLOCKS, enable_prefix_cache=False, **kwargs)
    return make_engine(model_dir, **kwargs) if tp == 1 else make_tp_engine(model_dir, tp, **kwargs)


@contextlib.asynccontextmanager
async def workers(model_dir, backend: str, prefill_tp: int, decode_tp: int):
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend, reader_tp=decode_tp),
                            engine=engine(model_dir, prefill_tp, max_num_batched_tokens=CHUNK))
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend=backend), engine=engine(model_dir, decode_tp))
    try:
        async with serving(prefill, [decoder]) as pool:
            yield prefill, decoder, pool
    finally:
        prefill.engine.close()
        decoder.engine.close()


def record_reads(decoder: DecodeWorker) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(the holder's block ids, this worker's) of every transfer the decode worker starts."""
    reads, start_read = [], decoder._start_read

    def recording(request_id, kv, peer, local, *args):
        if not reads or reads[-1][0] != tuple(kv.block_ids):
            reads.append((tuple(kv.block_ids), tuple(local.block_ids)))
        return start_read(request_id, kv, peer, local, *args)

    decoder._start_read = recording
    return reads


def prompt_kv(caches, block_ids, heads: slice | None = None) -> torch.Tensor:
    """The prompt's KV in ``caches`` (a worker's rank caches), token by token: (T, layers, 2, heads, hd),
    every rank's heads side by side."""
    tokens = by_token(torch.cat([c[list(block_ids)] for c in caches], dim=-2))[:len(PROMPT)]
    return tokens if heads is None else tokens[..., heads, :]


@functools.cache
def local_kv(model_dir, tp: int) -> tuple[torch.Tensor, ...]:
    """Each rank's prompt KV as a TP-``tp`` engine computes the prompt itself; computed once per
    size for the module's tests (at TP 2 it costs a rank's process), which only read it."""
    e = engine(model_dir, tp)
    try:
        e.add_request("local", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), hold_kv=True)
        while e.has_runnable():  # the prompt's prefill, then it is HELD
            e.step()
        ids = e.held_block_ids("local")
        return tuple(prompt_kv([c], ids).clone() for c in e.rank_caches)
    finally:
        e.close()


async def generate(pool, rid: str, stream_kv: bool) -> list[int]:
    model = ModelInfo("tiny", config=None, max_model_len=4096, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, list(PROMPT), params), model, pool,
                     RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0))
    return [t for resp in [r async for r in run.responses()] for t in resp.token_ids]


async def settle(*workers) -> None:
    for _ in range(200):
        if not workers[0].leases and all(w.engine.blocks.num_free_blocks == BLOCKS for w in workers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"stranded: {len(workers[0].leases)} leases, "
                         f"{[w.engine.blocks.num_free_blocks for w in workers]} blocks free")


def wipe(*workers) -> None:
    """Zero every rank cache of idle ``workers``: what the next request leaves there is its own
    KV, never what an earlier request on the same workers wrote into the same blocks."""
    for w in workers:
        for cache in w.engine.rank_caches:
            cache.zero_()


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_kv_moves_by_head_between_pools_of_different_tp(tiny_llama_dir, prefill_tp, decode_tp, backend):
    """The whole prompt at once, then streamed chunk by chunk, on the same two workers (one start
    of their ranks for both), each request checked in full; the caches are zeroed in between."""
    model_dir, hf_model = tiny_llama_dir

    async def main():
        async with workers(model_dir, backend, prefill_tp, decode_tp) as (prefill, decoder, pool):
            reads, out = record_reads(decoder), {}
            for stream_kv in (False, True):
                mode = "streamed" if stream_kv else "whole"
                wipe(prefill, decoder)
                reads.clear()
                before = decoder.agent.stats.snapshot().transfers
                tokens = await generate(pool, f"r-{mode}", stream_kv)
                await settle(prefill, decoder)
                assert len(reads) == 1, mode
                # Freed, not yet reused: the prompt's KV on both sides is still where it was read.
                holder = prompt_kv(prefill.engine.rank_caches, reads[0][0])
                per_rank = holder.shape[-2] // decode_tp
                moved = [prompt_kv([c], reads[0][1]) for c in decoder.engine.rank_caches]
                for s, kv in enumerate(moved):
                    assert torch.equal(kv, holder[..., s * per_rank:(s + 1) * per_rank, :]), f"{mode}: decode rank {s}"
                stats = [prefill.agent.stats.snapshot(), decoder.agent.stats.snapshot()]
                assert sum(t.failures + t.verify_failures for t in stats) == 0, mode
                assert stats[1].transfers - before >= max(prefill_tp, decode_tp), mode  # a read per rank pair
                out[mode] = tokens, [kv.clone() for kv in moved]
            return out

    for mode, (tokens, moved) in asyncio.run(main()).items():
        assert_greedy_matches(hf_model, PROMPT, tokens, MAX_TOKENS, what=mode)
        for s, (kv, local) in enumerate(zip(moved, local_kv(model_dir, decode_tp))):
            torch.testing.assert_close(kv, local, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode}: decode rank {s}: {m}")
