"""The shell both workers run in: the engine-thread bridge, idle waits, a step that raises,
and drain. Real prefill worker (tiny model, tcp KV agent) behind its real gRPC server."""

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.server import start
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from tests.factories import fail_sampling_for, make_engine, nan_logits_for, prefill_worker_config, random_prompts
from pdserve.wire.failure import Failure, failure_of
from pdserve.wire.grpc_util import aio_channel


@pytest.fixture
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir[0])


def test_an_idle_engine_thread_blocks_instead_of_polling(engine):
    thread = EngineThread(engine, lambda outputs: None, hooks=[lambda: None])
    thread.start()
    try:
        time.sleep(0.5)  # at the old 2 ms poll: ~250 wake-ups
        assert thread.idle_waits <= 2
        assert thread.call(lambda: 42).result(timeout=5) == 42  # a call still wakes it at once
    finally:
        thread.stop()


def test_a_step_outputs_reach_the_event_loop_in_one_wake_up(engine):
    worker = PrefillWorker(prefill_worker_config(kv_transfer_backend="tcp"), engine=engine)

    async def run():
        loop = asyncio.get_running_loop()
        queues = [worker.open_stream(f"r{i}") for i in range(5)]
        wakes = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), original(*a))[1]
        pusher = threading.Thread(target=worker.push, args=([(f"r{i}", i) for i in range(5)] + [("gone", 9)],))
        pusher.start()
        pusher.join()  # as the engine thread does at the end of a step
        got = [await asyncio.wait_for(q.get(), 5) for q in queues]
        return got, len(wakes)

    try:
        got, wakes = asyncio.run(run())
    finally:
        worker.agent.close()
    assert got == [0, 1, 2, 3, 4] and wakes == 1


def prefill_request(rid: str, prompt, temperature: float) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=pdserve_pb2.SamplingParams(max_tokens=4, temperature=temperature))


def test_a_step_that_raises_fails_its_prompt_with_a_typed_code_and_the_worker_serves_on(engine):
    config = prefill_worker_config(kv_transfer_backend="tcp")
    worker = PrefillWorker(config, engine=engine)
    fail_sampling_for(engine, "bad")
    bad, good = random_prompts(2, [30, 20], seed=5)

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:  # the sampler raises for "bad"
                    await stub.Prefill(prefill_request("bad", bad, 0.7), timeout=60)
                after = await stub.Prefill(prefill_request("good", good, 0.0), timeout=60)
                await stub.Release(worker_pb2.ReleaseRequest(lease_token=after.kv.lease_token), timeout=5)
                stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                return info.value, after, stats
        finally:
            await server.stop()

    error, after, stats = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and failure_of(error) is Failure.STEP_FAILED
    assert after.HasField("kv") and len(after.kv.block_ids) == 2
    assert stats.num_blocks_used == 0 and stats.num_waiting == 0 and stats.num_held_leases == 0


def test_a_request_whose_own_fault_ends_it_gets_invalid_argument_and_its_batch_does_not(engine):
    """NaN logits for "bad" alone: its Prefill ends INVALID_ARGUMENT naming the field, and
    "good", sent at the same time (same step), gets its answer."""
    config = prefill_worker_config(kv_transfer_backend="tcp")
    worker = PrefillWorker(config, engine=engine)
    nan_logits_for(engine, "bad")
    bad, good = random_prompts(2, [30, 20], seed=5)

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                calls = [stub.Prefill(prefill_request(rid, p, 0.0), timeout=60) for rid, p in (("bad", bad), ("good", good))]
                bad_answer, good_answer = await asyncio.gather(*calls, return_exceptions=True)
                await stub.Release(worker_pb2.ReleaseRequest(lease_token=good_answer.kv.lease_token), timeout=5)
                stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                return bad_answer, good_answer, stats
        finally:
            await server.stop()

    error, good_answer, stats = asyncio.run(run())
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logits" in error.details() and dict(error.trailing_metadata())["pdserve-field"] == "logits"
    assert good_answer.HasField("kv") and len(good_answer.kv.block_ids) == 2
    assert stats.num_blocks_used == 0 and stats.num_held_leases == 0


def test_drain_refuses_new_prompts_and_waits_for_held_kv(engine):
    config = prefill_worker_config(kv_transfer_backend="tcp")
    worker = PrefillWorker(config, engine=engine)
    first, second = random_prompts(2, [20, 20], seed=6)

    async def run():
        server = await start(config, worker)
        async with aio_channel(server.address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            held = await stub.Prefill(prefill_request("a", first, 0.0), timeout=60)
            drain = asyncio.create_task(server.drain(60.0))
            while not worker.draining:
                await asyncio.sleep(0.01)
            status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(prefill_request("b", second, 0.0), timeout=60)
            still_draining = not drain.done()  # the held KV is in flight: the drain waits for it
            await stub.Release(worker_pb2.ReleaseRequest(lease_token=held.kv.lease_token), timeout=5)
        await asyncio.wait_for(drain, 30)
        return status, refused.value, still_draining

    status, refused, still_draining = asyncio.run(run())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
    assert still_draining


@pytest.mark.slow
def test_sigterm_drains_a_worker_process_then_it_exits_0(tiny_llama_dir):
    """A plain worker process (as Kubernetes runs one): SIGTERM turns health NOT_SERVING and
    refuses new prompts; the process exits 0 once its held KV is released."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.worker_process", "prefill", "--model", str(tiny_llama_dir[0]),
         "--kv-transfer-backend", "tcp", "--num-blocks", "64", "--drain-grace-s", "120"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = ""
        while not line.startswith("listening on"):
            line = proc.stdout.readline()
            assert line, "the worker process exited before serving"
        address = line.split()[-1]
        first, second = random_prompts(2, [20, 20], seed=8)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            held = stub.Prefill(prefill_request("a", first, 0.0), timeout=60)
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().startswith("draining")
            status = health_pb2.HealthCheckResponse.SERVING
            while status == health_pb2.HealthCheckResponse.SERVING:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            with pytest.raises(grpc.RpcError) as refused:
                stub.Prefill(prefill_request("b", second, 0.0), timeout=60)
            assert proc.poll() is None  # held KV keeps it draining
            stub.Release(worker_pb2.ReleaseRequest(lease_token=held.kv.lease_token), timeout=5)
        assert proc.wait(timeout=60) == 0
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()


def test_pin_process_moves_every_thread_and_sizes_torch_to_the_cores():
    import os
    import subprocess
    import sys

    code = ("import os, threading, torch; from pdserve.shell.worker import pin_process; "
            "t = threading.Thread(target=threading.Event().wait, daemon=True); t.start(); "
            "pin_process([0]); "
            "print(sorted({tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir('/proc/self/task')}), "
            "torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True).stdout.strip()
    assert out == "[(0,)] 1"


def test_a_worker_with_a_step_trace_dir_traces_its_engine_steps(engine, tmp_path):
    from pdserve.engine.core.step_trace import read, trace_path

    config = prefill_worker_config(worker_id="prefill-7", kv_transfer_backend="tcp", step_trace_dir=str(tmp_path))
    worker = PrefillWorker(config, engine=engine)
    prompt = random_prompts(1, [40], seed=9)[0]

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                done = await stub.Prefill(prefill_request("a", prompt, 0.0), timeout=60)
                await stub.Release(worker_pb2.ReleaseRequest(lease_token=done.kv.lease_token), timeout=5)
        finally:
            await server.stop()

    asyncio.run(run())
    steps = list(read(trace_path(tmp_path, "prefill-7")))
    assert [s.shape.prefill for s in steps] == [((40, 0),)]  # one prefill step, the prompt whole; no decode
    assert steps[0].shape.sampled == 1 and steps[0].after_idle


def test_stats_count_the_blocks_of_requests_without_a_limit(tiny_llama_dir):
    """WorkerStats.num_blocks_unbounded: the blocks of running sequences whose only limit is
    the context's end, which the router counts as room for a request with a limit (issue 25)."""
    from types import SimpleNamespace

    from pdserve.engine.sampling.params import SamplingParams
    from pdserve.kv_transfer.base import TransferStats
    from pdserve.shell.stats import worker_stats

    eng = make_engine(tiny_llama_dir[0])
    prompt = list(range(1, 40))  # 39 tokens + the first: 3 blocks of 16
    eng.add_prefilled("unbounded", prompt, 5, SamplingParams(max_tokens=eng.max_model_len - len(prompt)))
    eng.add_prefilled("limited", prompt, 5, SamplingParams(max_tokens=8))
    for rid in ("unbounded", "limited"):
        eng.kv_ready(rid)
    stats = worker_stats("w", "decode", eng, SimpleNamespace(stats=TransferStats()))  # no transfers here
    assert stats.num_blocks_used == 6 and stats.num_blocks_unbounded == 3
    assert stats.local_prefill_token_s == 0  # no time-sized chunks here: the router falls back


def test_stats_carry_a_prompt_tokens_measured_wall_time(tiny_llama_dir):
    """WorkerStats.local_prefill_token_s: what the router weighs a local prefill by
    (docs/routing.md#prefill-that-keeps-up), from the step budget's timings (hand-made here)."""
    from types import SimpleNamespace

    from pdserve.engine.core.step_budget import StepBudget
    from pdserve.kv_transfer.base import TransferStats
    from pdserve.shell.stats import worker_stats

    eng = make_engine(tiny_llama_dir[0])
    eng.scheduler.step_budget = budget = StepBudget(0.05)
    budget.observe(4, 0, 0.02)
    budget.observe(4, 40, 0.06)  # 1 ms a token: a 30-token chunk in a 50 ms step
    stats = worker_stats("w", "decode", eng, SimpleNamespace(stats=TransferStats()))
    assert stats.local_prefill_token_s == pytest.approx(0.05 / 30)


def test_a_held_step_waits_running_the_calls_that_come_then_steps(engine):
    """A hold (engine_thread) keeps the next step back while it names a moment still ahead; the
    calls that come meanwhile run first, and once the hold lets go the step runs."""
    released = threading.Event()
    holds = []

    def hold():
        holds.append(thread.steps)
        return None if released.is_set() else time.monotonic() + 600

    thread = EngineThread(engine, lambda outputs: None, holds=[hold])
    engine.add_request("held", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    thread.start()
    try:
        for _ in range(1000):  # held: the loop keeps asking, and has not stepped
            if len(holds) >= 3:
                break
            time.sleep(0.01)
        assert len(holds) >= 3 and thread.steps == 0

        def let_go():
            released.set()
            return thread.steps

        assert thread.call(let_go).result(timeout=5) == 0  # ran inside the hold, before any step
        for _ in range(1000):
            if thread.steps:
                break
            time.sleep(0.01)
        assert thread.steps > 0
    finally:
        thread.stop()
    assert set(holds[:3]) == {0}
