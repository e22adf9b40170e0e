"""A prefill worker restarted on the same address (a Kubernetes container restart keeps the
pod IP and the fixed internal port): the decode worker reads from the new incarnation, at
most one transfer after the restart fails, and the tokens equal the engine's. The old decode
worker kept the first incarnation's NIXL peer for that address forever, and every transfer
from it failed. Real workers (tiny model, NIXL) behind real gRPC servers in this process."""

import asyncio
import dataclasses
import gc

import grpc
import pytest

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2_grpc
from tests.factories import decode_worker_config, make_engine, prefill_worker_config
from tests.helpers.lease_workers import PROMPT, decode, prefill_one
from pdserve.wire.grpc_util import aio_channel

pytestmark = pytest.mark.slow
AFTER_RESTART = 3


def test_a_prefill_worker_restarted_on_the_same_port_is_read_again(tiny_llama_dir):
    model_dir = tiny_llama_dir[0]
    expected = make_engine(model_dir).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                                        ignore_eos=True))[0].token_ids
    config = prefill_worker_config(worker_id="prefill-0", kv_transfer_backend="nixl")

    async def outcome(p_stub, d_stub, rid):
        pre = await prefill_one(p_stub, rid=rid)
        try:
            return [pre.first_token_id] + await decode(d_stub, pre, rid=rid)
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    async def run():
        prefill = await start_prefill(config, PrefillWorker(config, engine=make_engine(model_dir, num_blocks=64)))
        config_again = dataclasses.replace(config, port=int(prefill.address.rsplit(":", 1)[1]))
        d_config = decode_worker_config(worker_id="decode-0", kv_transfer_backend="nixl")
        decoder = await start_decode(d_config, DecodeWorker(d_config, engine=make_engine(model_dir, num_blocks=64)))
        try:
            async with aio_channel(prefill.address) as p_ch, aio_channel(decoder.address) as d_ch:
                p_stub, d_stub = worker_pb2_grpc.PrefillWorkerStub(p_ch), worker_pb2_grpc.DecodeWorkerStub(d_ch)
                before = await outcome(p_stub, d_stub, "before#0")
                await prefill.stop()  # the first incarnation ends: its agent and its cache with it
                gc.collect()
                prefill = await start_prefill(config_again, PrefillWorker(
                    config_again, engine=make_engine(model_dir, num_blocks=64)))
                after = [await outcome(p_stub, d_stub, f"after-{i}#0") for i in range(AFTER_RESTART)]
                return before, after
        finally:
            await prefill.stop()
            await decoder.stop()

    before, after = asyncio.run(run())
    assert before == expected
    assert after[0] in (expected, grpc.StatusCode.UNAVAILABLE)  # the failure that makes it look again
    assert after[1:] == [expected] * (AFTER_RESTART - 1), after
