"""Leases bound to their blocks, between a real prefill worker and real decode workers (tiny
model, tcp KV backend, gRPC servers in this process). Every refusal happens before a byte of
KV moves; a decode worker that cannot take a request leaves the lease held for the next one."""

import asyncio

import grpc
import pytest

from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer import TransferState, create_agent
from pdserve.protos import worker_pb2
from tests.factories import make_engine, random_prompts
from tests.helpers.lease_workers import PROMPT, SAMPLING, cluster, decode, prefill_one, stats
from pdserve.wire.failure import Failure, failure_of

pytestmark = pytest.mark.slow


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_a_full_decode_worker_leaves_the_lease_held_for_the_next_one(tiny_llama_dir):
    model_dir = tiny_llama_dir[0]
    expected = make_engine(model_dir).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                                        ignore_eos=True))[0].token_ids

    async def run():
        async with cluster(model_dir, decode_blocks=(6, 64)) as (prefill, p_stub, decoders, d_stubs):
            full = decoders[0]  # 4 of its 6 blocks taken: the 3-block prompt does not fit now
            await full.call(full.engine.add_prefilled, "filler", list(range(3, 53)), 5,
                            SamplingParams(max_tokens=1))
            pre = await prefill_one(p_stub)
            error = await refused(decode(d_stubs[0], pre))
            held = await stats(p_stub)
            tokens = await decode(d_stubs[1], pre)
            while (await stats(p_stub)).num_held_leases:  # the read's notification frees it
                await asyncio.sleep(0.05)
            return error, held, [pre.first_token_id] + tokens, await stats(d_stubs[1])

    error, held, tokens, reader = asyncio.run(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert held.num_held_leases == 1 and held.num_blocks_used == 3  # old code: released, then read freed blocks
    assert tokens == expected
    assert reader.kv_transfers == 1 and reader.num_blocks_used == 0


def test_forged_unknown_and_replayed_claims_are_refused_before_any_byte_moves(tiny_llama_dir):
    async def run():
        async with cluster(tiny_llama_dir[0]) as (prefill, p_stub, decoders, d_stubs):
            pre = await prefill_one(p_stub)
            other = await prefill_one(p_stub, rid="client-b#0", prompt=random_prompts(1, [40], seed=12)[0])
            forged = worker_pb2.KVHandle()
            forged.CopyFrom(pre.kv)
            forged.block_ids.append(other.kv.block_ids[0])  # another client's block
            guessed = worker_pb2.KVHandle()
            guessed.CopyFrom(pre.kv)
            guessed.lease_token = "guessed-token"
            errors = [await refused(decode(d_stubs[0], pre, kv=forged, rid="x#1")),
                      await refused(decode(d_stubs[0], pre, kv=guessed, rid="x#2"))]
            reader = await stats(d_stubs[0])
            claim = worker_pb2.ClaimRequest(lease_token=other.kv.lease_token, block_ids=other.kv.block_ids)
            await p_stub.Claim(claim, timeout=5)
            replay = await refused(p_stub.Claim(claim, timeout=5))
            return errors, reader, replay, await stats(p_stub)

    errors, reader, replay, holder = asyncio.run(run())
    for e in errors:
        assert e.code() == grpc.StatusCode.UNAVAILABLE and failure_of(e) is Failure.KV_TRANSFER
    assert "blocks_mismatch" in errors[0].details() and "unknown_token" in errors[1].details()
    assert reader.kv_transfer_bytes == 0 and reader.kv_transfers == 0 and reader.num_blocks_used == 0
    assert replay.code() == grpc.StatusCode.FAILED_PRECONDITION and "already_claimed" in replay.details()
    assert holder.num_held_leases == 2 and holder.num_blocks_used == 6  # refusals changed nothing


def test_an_expired_lease_cannot_be_claimed(tiny_llama_dir):
    async def run():
        async with cluster(tiny_llama_dir[0], lease_seconds=0.2) as (prefill, p_stub, decoders, d_stubs):
            pre = await prefill_one(p_stub)
            while (await stats(p_stub)).num_held_leases:
                await asyncio.sleep(0.05)
            return await refused(p_stub.Claim(worker_pb2.ClaimRequest(
                lease_token=pre.kv.lease_token, block_ids=pre.kv.block_ids), timeout=5)), await stats(p_stub)

    error, holder = asyncio.run(run())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert holder.leases_expired == 1 and holder.num_blocks_used == 0


def test_the_tcp_holder_serves_only_blocks_of_a_claimed_lease(tiny_llama_dir):
    async def run():
        async with cluster(tiny_llama_dir[0]) as (prefill, p_stub, decoders, d_stubs):
            pre = await prefill_one(p_stub)
            meta = await p_stub.GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=5)
            with create_agent("tcp", "intruder", decoders[0].engine.kv_cache) as agent:
                peer = agent.add_remote(meta)
                token = pre.kv.lease_token.encode()
                ids = list(pre.kv.block_ids)
                unclaimed = agent.wait(agent.start_read(peer, ids, [0, 1, 2], notify=token), 10)
                await p_stub.Claim(worker_pb2.ClaimRequest(lease_token=pre.kv.lease_token, block_ids=ids), timeout=5)
                outside = agent.wait(agent.start_read(peer, [ids[0], 60], [0, 1], notify=token), 10)
                return unclaimed, outside, agent.stats.snapshot()

    unclaimed, outside, moved = asyncio.run(run())
    assert unclaimed is TransferState.FAILED and outside is TransferState.FAILED
    assert moved.bytes == 0 and moved.failures == 2


def test_an_abort_naming_a_request_id_does_not_free_its_held_kv(tiny_llama_dir):
    async def run():
        async with cluster(tiny_llama_dir[0]) as (prefill, p_stub, decoders, d_stubs):
            pre = await prefill_one(p_stub)
            found = await p_stub.Abort(worker_pb2.WorkerAbortRequest(request_id="client-a#0"), timeout=5)
            after = await stats(p_stub)
            tokens = await decode(d_stubs[0], pre)
            return found, after, tokens

    found, after, tokens = asyncio.run(run())
    assert not found.found and after.num_held_leases == 1 and after.num_blocks_used == 3
    assert len(tokens) == 5  # the rightful decode worker still reads it


def test_a_decode_call_the_router_abandons_before_the_claim_frees_the_held_kv_at_once(tiny_llama_dir):
    """A router that dies (or gives up) after the prefill answered but before the decode
    worker claimed the lease: the KV is freed when the call is cancelled, not when the lease
    (an hour here) runs out."""
    import threading

    async def run():
        async with cluster(tiny_llama_dir[0], lease_seconds=3600.0) as (prefill, prefill_stub, decoders, stubs):
            pre = await prefill_one(prefill_stub)
            hold = threading.Event()
            busy = asyncio.wrap_future(decoders[0].thread.call(hold.wait, 60))  # before the claim, it waits here
            call = asyncio.ensure_future(decode(stubs[0], pre))
            while not decoders[0].requests():
                await asyncio.sleep(0.01)
            held = (await stats(prefill_stub)).num_held_leases
            call.cancel()  # the router's connection drops
            hold.set()
            await busy
            for _ in range(100):
                after = await stats(prefill_stub)
                if not after.num_held_leases:
                    break
                await asyncio.sleep(0.05)
            return held, after

    held, after = asyncio.run(run())
    assert held == 1
    assert after.num_held_leases == 0 and after.num_blocks_used == 0


def test_unclaimed_kv_of_a_router_that_stopped_polling_is_freed_long_before_its_lease_ends(tiny_llama_dir):
    """A router that dies between a prefill's answer and the decode worker's claim is the only
    holder of the lease token: nobody would release the KV until the lease ran out (30 s by
    default, 120 s in the fault test that caught it). Leases name the router incarnation that
    asked; one that stops polling Stats for ``owner_timeout_s`` is dead, and its unclaimed
    leases go (OWNER_LOST). A live router's lease stays, and so does a claimed one (its reader
    releases it, or it expires)."""
    prompts = [random_prompts(1, [40], seed=s)[0] for s in (21, 22, 23)]

    async def run():
        async with cluster(tiny_llama_dir[0], lease_seconds=60.0, owner_timeout_s=1.0) as (prefill, p_stub, _, _):
            dead = await prefill_one(p_stub, rid="d#0", prompt=prompts[0], router_id="dead-router")
            live = await prefill_one(p_stub, rid="l#0", prompt=prompts[1], router_id="live-router")
            claimed = await prefill_one(p_stub, rid="c#0", prompt=prompts[2], router_id="dead-router")
            await p_stub.Claim(worker_pb2.ClaimRequest(lease_token=claimed.kv.lease_token,
                                                       block_ids=claimed.kv.block_ids), timeout=5)
            held = await stats(p_stub)
            for _ in range(30):  # 3 s: the live router polls, the dead one is silent
                await p_stub.Stats(worker_pb2.StatsRequest(router_id="live-router"), timeout=5)
                await asyncio.sleep(0.1)
            after = await stats(p_stub)
            refusal = await refused(p_stub.Claim(worker_pb2.ClaimRequest(
                lease_token=dead.kv.lease_token, block_ids=dead.kv.block_ids), timeout=5))
            await p_stub.Claim(worker_pb2.ClaimRequest(lease_token=live.kv.lease_token,
                                                       block_ids=live.kv.block_ids), timeout=5)
            return held, after, refusal, prefill.leases.released_by

    held, after, refusal, released_by = asyncio.run(run())
    assert (held.num_held_leases, held.num_blocks_used) == (3, 9)
    assert (after.num_held_leases, after.num_blocks_used) == (2, 6)  # the dead router's unclaimed lease went
    assert released_by["owner_lost"] == 1 and released_by["expired"] == 0
    assert "unknown_token" in refusal.details()


def test_a_stream_is_no_longer_waited_for_once_its_kv_is_here_or_it_is_gone(tiny_llama_dir):
    """The decode worker holds a step for a stream whose KV is on its way (decode_worker.worker
    HOLD_SHARE); once the KV lands, or the decode ends before it does, nothing is left to hold for."""
    async def run():
        async with cluster(tiny_llama_dir[0]) as (prefill, pstub, decoders, dstubs):
            pre = await prefill_one(pstub)
            assert len(await decode(dstubs[0], pre)) == SAMPLING.max_tokens - 1
            done = dict(decoders[0]._arriving)
            forged = worker_pb2.KVHandle()
            forged.CopyFrom(pre.kv)
            forged.lease_token = "forged"
            await refused(decode(dstubs[0], pre, kv=forged, rid="client-b#0"))  # the claim is refused
            return done, dict(decoders[0]._arriving), decoders[0].thread.call(decoders[0]._hold_for_arrivals).result(5)

    done, refused_after, hold = asyncio.run(run())
    assert done == {} and refused_after == {} and hold is None
