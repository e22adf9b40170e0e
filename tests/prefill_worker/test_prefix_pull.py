"""The reversed pull between two real workers: a conversation's first turn is prefilled and
decoded on a decode worker, whose prefix cache then holds it; the second turn goes to a prefill
worker that reads that prefix from the decode worker (``HoldPrefix``, then its own claim and
NIXL or tcp read, ``pdserve.prefill_worker.prefix_pull``) and computes only the new message;
the decode worker reads the answer's KV back and decodes. The default model (SmolLM2-135M) in
float32, both workers behind their gRPC servers in this process; transformers' greedy output
is the oracle.

And the fallbacks, which must cost time only: the holder or its lease gone before the read,
and a block whose bytes do not match its checksum. Either way the prefill worker computes the whole
prompt (no cached token), the tokens are the same, the holder's lease ends (nothing stranded
on either side), and no block of the failed read is ever found."""

import asyncio
import contextlib

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.loader import materialize
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from pdserve.router.attempts import LocalPrefill, RemotePrefill
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.request_run import RequestRun
from tests.factories import assert_greedy_matches, decode_worker_config, default_reference, load_reference, \
    make_engine, make_tp_engine, prefill_worker_config
from tests.helpers.certs import role_certs
from tests.helpers.prefix_pull import (ANSWER, BLOCK, MAX_TOKENS, NUM_BLOCKS, first_turn, second_turn, settled,
                                       still_held)
from tests.helpers.worker_servers import serving
from tests.metrics.metrics_helpers import LetterTokenizer

pytestmark = pytest.mark.slow

FIRST = ("The lighthouse keeper climbed the stairs every evening to light the lamp. One stormy night a ship "
         "appeared on the horizon, its sails torn, drifting toward the rocks below the cliff. Tell me what he saw.")
SECOND = " And what did he do next, in one sentence?"


@pytest.fixture(scope="module")
def model_dir():
    return materialize("default", progress=False)


@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers on the default model in float32: the process's one copy (default_reference)."""
    return default_reference()[0]


@pytest.fixture(scope="module")
def messages(model_dir) -> tuple[list[int], list[int]]:
    tokenizer = Tokenizer(model_dir)
    return tokenizer.encode(FIRST), tokenizer.encode(SECOND)


def engine(model_dir, tp: int):
    kwargs = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    return make_engine(model_dir, **kwargs) if tp == 1 else make_tp_engine(model_dir, tp, **kwargs)


@contextlib.asynccontextmanager
async def pair(model_dir, backend: str, prefill_tp: int = 1, decode_tp: int = 1, certs=None,
               holder_verifies: bool = True):
    """A prefill and a decode worker (prefix caches on) of those tensor-parallel sizes, each
    checksumming its blocks for the other's ranks (the decode worker only if ``holder_verifies``),
    and stubs to each; with ``certs`` (component -> certificate), each with its role's identity
    over mTLS, and the stubs the router's."""
    certs = certs or {}
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend, reader_tp=decode_tp,
                                                  tls=certs.get("prefill")), engine=engine(model_dir, prefill_tp))
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend=backend, reader_tp=prefill_tp,
                                                tls=certs.get("decode"), verify_kv=holder_verifies),
                           engine=engine(model_dir, decode_tp))
    try:
        async with serving(prefill, [decoder], router_tls=certs.get("router")) as pool:
            stubs = {c.role: c.stub for c in pool.workers.values()}
            yield prefill, decoder, stubs["prefill"], stubs["decode"], pool
    finally:
        prefill.engine.close()
        decoder.engine.close()


async def conversation(model_dir, messages, backend: str, spoil=None, end_hold: bool = False, tp=(1, 1),
                       certs=None, holder_verifies: bool = True):
    """Both turns; ``spoil`` may change the held prefix's handle before the prefill worker gets
    it; ``end_hold``: the hold is released before the prefill worker gets it (the lease is gone);
    ``tp``: the prefill and decode workers' tensor-parallel sizes; ``certs``: mTLS (``pair``);
    ``holder_verifies``: the decode worker's ``verify_kv`` (the prefill worker's is on)."""
    async with pair(model_dir, backend, *tp, certs=certs, holder_verifies=holder_verifies) as (
            prefill, decoder, p_stub, d_stub, _):
        answer1 = await first_turn(d_stub, messages[0])
        prompt = messages[0] + answer1 + messages[1]
        held = await d_stub.HoldPrefix(worker_pb2.HoldPrefixRequest(request_id="turn-2", prompt_token_ids=prompt,
                                                                    router_id="router-a"), timeout=10)
        prefix = worker_pb2.KVHandle()
        prefix.CopyFrom(held.kv)
        if spoil is not None:
            spoil(prefix)
        if end_hold:
            await d_stub.Release(release_request(held.kv.lease_token, ReleaseReason.ABORTED), timeout=5)
        answer, tokens = await second_turn(p_stub, d_stub, prompt, prefix)
        stats = await p_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
        holding = await still_held(decoder)
        # The router releases the hold after every prefill call (a no-op once the lease ended).
        await d_stub.Release(release_request(held.kv.lease_token, ReleaseReason.ABORTED), timeout=5)
        return prompt, held.kv, answer, tokens, stats, holding, await settled(prefill, decoder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return role_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize("backend, mtls", [("nixl", False), ("tcp", False), ("tcp", True)],
                         ids=["nixl", "tcp", "tcp-mtls"])
def test_the_prefill_worker_reads_the_prefix_from_the_decode_worker_and_computes_only_the_rest(
        model_dir, hf, messages, backend, mtls, certs):
    """Under mTLS too (each worker its role's certificate): the tcp block server of a decode
    worker serves the prefill worker that reads its held prefix. Old code: the reader wanted a
    prefill holder and a decode holder served only decode readers, so every such read failed
    and the prompt was computed whole (no cached token)."""
    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(
        conversation(model_dir, messages, backend, certs=certs if mtls else None))
    # The first turn's prompt and answer, less its last token (never computed), in full blocks.
    assert held.num_tokens == (len(messages[0]) + ANSWER - 1) // BLOCK * BLOCK and held.num_tokens >= 4 * BLOCK
    assert answer.num_cached_tokens == held.num_tokens  # read, not computed
    assert stats.kv_transfer_bytes > 0 and stats.kv_transfer_failures == 0
    assert stats.prefix_tokens_read == held.num_tokens and stats.prefix_reads_refused == 0
    assert_greedy_matches(hf, prompt, tokens, MAX_TOKENS, what=f"reversed pull over {backend}")
    assert holding == 0  # the read's notice ended the hold
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS


@pytest.mark.parametrize("tp, backend", [((2, 1), "nixl"), ((1, 2), "tcp")],
                         ids=["prefill-tp2-decode-tp1-nixl", "prefill-tp1-decode-tp2-tcp"])
def test_the_prefix_is_read_by_head_between_workers_of_different_tensor_parallel_sizes(tool_llama, messages, tp,
                                                                                       backend):
    """The reversed pull where one side runs two ranks (a tiny Llama of the default model's
    vocabulary: SmolLM2's 3 KV heads do not split in two): every reader rank reads its heads of
    the held prefix from the holder ranks that hold them, checked by their checksum groups; the
    prompt computes only the rest, and the tokens are transformers' (those of the whole prompt
    computed, with no reuse)."""
    directory = tool_llama[0]
    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(
        conversation(directory, messages, backend, tp=tp))
    assert held.num_tokens >= 4 * BLOCK and answer.num_cached_tokens == held.num_tokens  # read, not computed
    assert stats.prefix_tokens_read == held.num_tokens and stats.kv_verify_failures == 0
    assert stats.prefix_reads_refused == 0 and stats.kv_transfer_failures == 0
    assert_greedy_matches(load_reference(directory, torch.float32), prompt, tokens, MAX_TOKENS, what=f"tp {tp} over {backend}")
    assert holding == 0  # every rank pair's notice landed: the hold ended
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS


@pytest.mark.parametrize("gone", ["holder", "lease"])
def test_a_holder_or_lease_gone_before_the_read_costs_time_only(model_dir, hf, messages, gone):
    def dead(prefix):  # the decode worker died after the hold: nothing listens there any more
        prefix.prefill_address = "127.0.0.1:9"

    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(
        conversation(model_dir, messages, "nixl", spoil=dead if gone == "holder" else None, end_hold=gone == "lease"))
    assert held.num_tokens > 0 and answer.num_cached_tokens == 0  # computed whole
    assert stats.kv_transfer_failures == 1 and stats.prefix_tokens_read == 0
    assert_greedy_matches(hf, prompt, tokens, MAX_TOKENS, what=f"{gone} gone")
    # Unread, a hold lives on until the router's release ends it (or its expiry would).
    assert holding == (1 if gone == "holder" else 0)
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS


def test_a_block_that_fails_its_checksum_is_never_found_and_the_prompt_is_computed_whole(model_dir, hf, messages):
    def corrupt(prefix):  # as a block changed in transit: its bytes no longer match
        prefix.block_checksums[-1] ^= 1

    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(
        conversation(model_dir, messages, "nixl", spoil=corrupt))
    assert answer.num_cached_tokens == 0  # no block of the failed read was found by the prompt
    assert stats.kv_verify_failures == 1 and stats.kv_transfer_failures == 1
    assert_greedy_matches(hf, prompt, tokens, MAX_TOKENS, what="checksum mismatch")
    assert holding == 0  # the prefill worker released it on the failure
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS


def test_a_prefix_held_without_checksums_is_never_read_by_a_prefill_worker_that_verifies(tool_llama, messages):
    """Fail closed: the decode worker holds the prefix with verification off (no checksums);
    the prefill worker, which verifies, refuses it unread (counted), computes the prompt whole
    to the same tokens, and ends the hold. Nothing of it is marked final there, so nothing is
    found, published or summed again for another reader. (A tiny Llama of the default model's
    vocabulary, for time.)"""
    directory = tool_llama[0]
    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(
        conversation(directory, messages, "tcp", holder_verifies=False))
    assert held.num_tokens > 0 and not held.block_checksums
    assert answer.num_cached_tokens == 0 and stats.kv_unverified_refused == 1  # computed whole
    assert stats.kv_transfer_bytes == 0 and stats.kv_transfer_failures == 0 and stats.prefix_tokens_read == 0
    assert_greedy_matches(load_reference(directory, torch.float32), prompt, tokens, MAX_TOKENS,
                          what="prefix held without checksums")
    assert holding == 0  # released on the refusal
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS


async def routed(pool, rid: str, prompt: list[int], kind, stream_kv: bool) -> list[int]:
    """The request run of ``prompt`` whose attempt is ``kind``: every token."""
    model = ModelInfo("smollm2", config=None, max_model_len=4096, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, list(prompt), params), model, pool,
                     RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0))
    run._plan = lambda attempt: (kind, attempt)  # the router's choice of attempt kind is not under test here
    return [t async for resp in run.responses() for t in resp.token_ids]


def test_the_router_attempt_reads_the_prefix_whole_and_streamed_with_transformers_tokens(model_dir, hf, messages):
    """The router's ``RemotePrefill(prefix_from=...)``, in the real request run over a pool of
    real stubs: turn 1 prefilled on the decode worker, turn 2 read from it with the KV moved
    back whole, turn 3 with the KV streamed back chunk by chunk (``stream_kv_min_tokens``)."""
    third = messages[1][:5]

    async def main():
        async with pair(model_dir, "nixl") as (prefill, decoder, _, _, pool):
            address = next(a for a, c in pool.workers.items() if c.role == "decode")
            kinds = [LocalPrefill(), RemotePrefill(stream_kv=False, prefix_from=address),
                     RemotePrefill(stream_kv=True, prefix_from=address)]
            prompts, outputs, bytes_read = [messages[0]], [], []
            for i, kind in enumerate(kinds):
                if i:
                    prompts.append(prompts[-1] + outputs[-1] + (messages[1] if i == 1 else third))
                outputs.append(await routed(pool, f"turn-{i + 1}", prompts[-1], kind, stream_kv=i == 2))
                bytes_read.append(prefill.prefix_pulls.bytes_read)
            return prompts, outputs, bytes_read, await settled(prefill, decoder)

    prompts, outputs, bytes_read, (leases, p_free, d_free) = asyncio.run(main())
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert_greedy_matches(hf, prompt, out, MAX_TOKENS, what=f"turn {i + 1}")
    assert 0 < bytes_read[1] < bytes_read[2]  # turns 2 and 3 each read a prefix
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS
