"""End to end through the gRPC API: prefill and decode in different processes, KV over NIXL."""

import asyncio
import concurrent.futures
import time

import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.factories import CHAT_QUESTIONS, chat_variants
from tests.helpers.chat import assert_chat_greedy, chat_request, collect
from tests.helpers.faults import reads_delayed
from tests.helpers.kv_layout import moved_bytes
from tests.serving.conftest import LEASE_S, TRANSFER_DELAY_S, all_stats, assert_all_blocks_free, worker_stats

pytestmark = pytest.mark.slow

QUESTIONS = CHAT_QUESTIONS


def test_greedy_equals_transformers_across_processes(stub, reference):
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: collect(stub.Generate(chat_request(q), timeout=120)), QUESTIONS))
    for q, (ids, _, resps) in zip(QUESTIONS, answers):
        assert_chat_greedy(reference, q, ids, 32)
        assert resps[-1].finish_reason in (pdserve_pb2.FINISH_REASON_STOP, pdserve_pb2.FINISH_REASON_LENGTH)
        assert resps[-1].usage.completion_tokens == len(ids)


def test_kv_moved_over_nixl_and_decode_ran_no_prompt_forward(cluster, stub):
    before = all_stats(cluster)
    ids, _, resps = collect(stub.Generate(chat_request("Tell me a fun fact about octopuses.", 20, ignore_eos=True),
                                          timeout=120))
    after = all_stats(cluster)
    prompt_tokens = resps[-1].usage.prompt_tokens
    delta = {a.worker_id: (a.kv_transfer_bytes - b.kv_transfer_bytes, a.num_forward_tokens - b.num_forward_tokens,
                           a.kv_transfers - b.kv_transfers, a.prefix_cache_hits - b.prefix_cache_hits)  # tokens
             for a, b in zip(after, before)}
    decode = [d for w, d in delta.items() if w.startswith("decode") and d[2]]
    prefill = [d for w, d in delta.items() if w.startswith("prefill") and d[1]]
    assert len(decode) == 1 and len(prefill) == 1
    kv_bytes, decode_forward, transfers, reused = decode[0]
    # Only what the decode worker's own prefix cache lacked moved (decode_kv_reuse: an earlier
    # chat request there left the chat template's system prompt).
    assert kv_bytes == moved_bytes(prompt_tokens, reused, after[0].kv_bytes_per_token)
    assert decode_forward == len(ids) - 1  # one decode step per token after the first: no prompt
    # The prefill worker computed the prompt, minus what its prefix cache already held.
    assert prefill[0][1] == prompt_tokens - resps[-1].usage.cached_prompt_tokens


def test_first_token_arrives_before_the_kv_transfer_finishes(cluster, stub):
    """The read is held back TRANSFER_DELAY_S: the first token is streamed before it is done."""
    before = sum(s.kv_transfers for s in all_stats(cluster) if s.role == "decode")
    with reads_delayed(cluster, TRANSFER_DELAY_S):
        t0 = time.monotonic()
        stream = stub.Generate(chat_request("Count to five.", 12, ignore_eos=True), timeout=120)
        first = next(stream)
        t_first = time.monotonic() - t0
        during = sum(s.kv_transfers for s in all_stats(cluster) if s.role == "decode")
        rest = list(stream)
        t_second = None if not rest else time.monotonic() - t0
    assert first.token_ids and during == before, "the pull had already finished when the first token arrived"
    assert rest and rest[-1].usage.completion_tokens == 12
    assert t_second - t_first >= TRANSFER_DELAY_S * 0.8


def test_sixteen_concurrent_streams_complete_and_free_every_block(cluster, stub, reference):
    questions = chat_variants(16)

    async def one(aio_stub, q):
        ids = []
        async for r in aio_stub.Generate(chat_request(q, 24), timeout=300):
            ids += list(r.token_ids)
        return ids

    async def run_all():
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            aio_stub = pdserve_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(one(aio_stub, q) for q in questions))

    outputs = asyncio.run(run_all())
    for q, ids in zip(questions, outputs):
        assert_chat_greedy(reference, q, ids, 24)
    used = {s.worker_id: s.kv_transfers for s in all_stats(cluster)}
    assert all(used[w] > 0 for w in used if w.startswith("decode")), "both decode workers should serve"
    assert_all_blocks_free(cluster)


def test_lease_expiry_frees_kv_nobody_pulls(cluster):
    address = cluster.prefill_addresses[0]
    with grpc.insecure_channel(address) as ch:
        prefill = worker_pb2_grpc.PrefillWorkerStub(ch)
        resp = prefill.Prefill(worker_pb2.PrefillRequest(
            request_id="orphan", prompt_token_ids=list(range(100, 150)),
            sampling=pdserve_pb2.SamplingParams(max_tokens=10, ignore_eos=True)), timeout=60)
    assert len(resp.kv.block_ids) == 4 and resp.kv.lease_token
    held = worker_stats(address, "prefill")
    assert held.num_held_leases == 1 and held.num_blocks_used == 4
    time.sleep(LEASE_S + 0.5)
    after = worker_stats(address, "prefill")
    assert (after.num_held_leases, after.num_blocks_used) == (0, 0)
    assert after.leases_expired == held.leases_expired + 1


def test_abort_during_decode_frees_blocks_on_both_sides(cluster, stub):
    stream = stub.Generate(chat_request("Write a very long story about a dragon.", 400, ignore_eos=True),
                           timeout=120)
    got = []
    for r in stream:
        got += list(r.token_ids)
        if len(got) >= 5:
            rid = r.request_id
            assert stub.Abort(pdserve_pb2.AbortRequest(request_id=rid)).found
            break
    tail = list(stream)
    assert tail and tail[-1].finish_reason == pdserve_pb2.FINISH_REASON_ABORT
    assert len(got) + sum(len(r.token_ids) for r in tail) < 400
    assert_all_blocks_free(cluster)


def test_cancelled_client_stream_frees_blocks_on_both_sides(cluster, stub):
    stream = stub.Generate(chat_request("Describe every planet in detail.", 400, ignore_eos=True), timeout=120)
    for i, _ in enumerate(stream):
        if i >= 5:
            stream.cancel()
            break
    time.sleep(0.5)
    assert_all_blocks_free(cluster)


def test_bad_input_is_invalid_argument_naming_the_field(stub):
    """Bad input is INVALID_ARGUMENT naming the field; a model not served is NOT_FOUND (the
    OpenAI API's 404), naming ``model`` too."""
    cases = [
        (pdserve_pb2.GenerateRequest(text="hi", sampling=pdserve_pb2.SamplingParams(temperature=-1)), "temperature"),
        (pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[10**7])), "prompt_token_ids"),
        (pdserve_pb2.GenerateRequest(text="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=100000)), "max_tokens"),
        (pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=4)), "input"),
        (pdserve_pb2.GenerateRequest(text="hi", model="gpt-9"), "model"),
        # fits the model's 8192-token context but no decode worker's KV cache (~4,160 tokens here)
        (pdserve_pb2.GenerateRequest(text="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=6000)), "max_tokens"),
    ]
    for req, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        expected = grpc.StatusCode.NOT_FOUND if field == "model" else grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.code() == expected, (field, err.value.details())
        assert field in err.value.details()


def test_list_models_health_and_reflection(channel, stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    models = stub.ListModels(pdserve_pb2.ListModelsRequest()).models
    assert models[0].id == "smollm2" and models[0].max_model_len == 8192
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for s in next(replies).list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services


def test_ray_reserves_each_workers_threads(cluster):
    """threads_per_worker=1: each worker's Ray actor holds one CPU (the router none). Pinning
    is off here: 4 workers on 2 cores oversubscribe them (tests/wire covers pin_process)."""
    import ray

    workers = cluster.prefill + cluster.decode
    used = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
    assert used == pytest.approx(len(workers))
