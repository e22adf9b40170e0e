"""The liveness rule (router.liveness) and how the router's pool applies it: a worker that
holds work and whose engine does not step, or that stops answering, is hung after the
timeout; an idle worker is never hung however long it does not step."""

import asyncio

import grpc

from pdserve.protos import worker_pb2
from pdserve.router.liveness import QUARANTINE_BOUND, is_hung, observe
from pdserve.router.pool import WorkerClient, WorkerPool
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, fake_pool, request_run

HANG_S = 5.0


def polls(answers, hang_s=HANG_S):
    """Fold (time, answer) pairs, answer None for a failed poll or (steps, busy); the
    hung verdict after each."""
    state, verdicts = None, []
    for now, answer in answers:
        state = observe(state, now, answer is not None, *(answer or (0, False)))
        verdicts.append(is_hung(state, now, hang_s))
    return verdicts


def test_a_busy_engine_that_steps_is_alive():
    assert polls([(t, (t * 10, True)) for t in range(0, 30)]) == [False] * 30


def test_an_idle_engine_is_alive_however_long_it_does_not_step():
    assert polls([(t, (7, False)) for t in range(0, 60, 3)]) == [False] * 20


def test_a_busy_engine_that_stops_stepping_is_hung_after_the_timeout():
    answers = [(0, (1, True)), (1, (2, True))] + [(t, (2, True)) for t in range(2, 9)]
    # progress last at t=1; hung once more than 5 s have passed (t=7, 8)
    assert polls(answers) == [False] * 7 + [True, True]


def test_a_worker_that_stops_answering_is_hung_after_the_timeout():
    answers = [(0, (1, True)), (1, (2, False))] + [(t, None) for t in range(2, 9)]
    assert polls(answers) == [False] * 7 + [True, True]


def test_a_hung_worker_that_steps_again_recovers():
    answers = [(0, (1, True))] + [(t, (1, True)) for t in range(1, 8)] + [(8, (2, True))]
    assert polls(answers)[-2:] == [True, False]


def test_a_restarted_worker_whose_count_starts_over_counts_as_progress():
    assert polls([(0, (500, True)), (4, (500, True)), (6, (3, True))]) == [False, False, False]


def test_first_sighting_counts_as_progress_even_without_an_answer():
    assert polls([(100, None), (104, None), (106, None)]) == [False, False, True]


def quarantine_polls(quarantined_by_time, blocks=100, hang_s=HANG_S):
    """An idle engine (it steps; nothing to run) answering with ``quarantined`` blocks of
    ``blocks`` quarantined: the hung verdict after each poll."""
    state, verdicts = None, []
    for now, quarantined in quarantined_by_time:
        state = observe(state, now, True, now, True, quarantined, blocks)
        verdicts.append(is_hung(state, now, hang_s))
    return verdicts


def test_kv_quarantined_past_the_bound_for_the_timeout_is_a_hang_though_the_engine_steps():
    over = int(QUARANTINE_BOUND * 100) + 1
    assert quarantine_polls([(t, over) for t in range(0, 9)]) == [False] * 6 + [True] * 3


def test_a_quarantine_under_the_bound_or_shorter_than_the_timeout_is_no_hang():
    at_bound = int(QUARANTINE_BOUND * 100)
    assert quarantine_polls([(t, at_bound) for t in range(0, 20)]) == [False] * 20
    over = at_bound + 1
    # a stopped read of many blocks that ends within a few seconds, twice: the clock starts over
    assert quarantine_polls([(0, over), (4, over), (5, 0), (6, over), (10, over), (11, 3)]) == [False] * 6


class FakeStub:
    """The worker's Stats RPC, answering whatever ``answer`` holds (None: unreachable)."""

    def __init__(self):
        self.answer = worker_pb2.WorkerStats(num_blocks_total=10, engine_steps=1, engine_busy=True)

    async def Stats(self, request, timeout):
        if self.answer is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())
        return self.answer


def test_the_pool_stops_routing_to_a_hung_worker_and_tells_its_requests(monkeypatch):
    asyncio.run(_pool_sequence(monkeypatch))


async def _pool_sequence(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("pdserve.router.pool.time.monotonic", lambda: clock[0])
    pool = WorkerPool(hang_timeout_s=HANG_S)
    stub = FakeStub()
    w = pool.workers["d:1"] = WorkerClient("decode", "d:1", channel=None, stub=stub)
    await pool.refresh()
    lost = w.lost
    assert w.snapshot().routable and not lost.is_set()
    clock[0] = 6.0  # busy, and still at step 1: hung
    await pool.refresh()
    assert w.hung and not w.snapshot().routable and not pool.ready() and lost.is_set()
    assert pool.missing_roles() == ["prefill", "decode"]  # what /health's 503 names
    colocated = WorkerPool(hang_timeout_s=HANG_S, required_roles=("decode",))
    assert colocated.missing_roles() == ["decode"]  # no prefill pool to miss
    stub.answer = worker_pb2.WorkerStats(num_blocks_total=10, engine_steps=2, engine_busy=True)
    clock[0] = 7.0
    await pool.refresh()
    assert not w.hung and w.snapshot().routable and not w.lost.is_set()  # a fresh event for its new life
    assert pool.missing_roles() == ["prefill"]
    stub.answer = None  # stopped: answers nothing
    clock[0] = 12.5
    await pool.refresh()
    assert w.hung and w.lost.is_set()


class HangingDecode(FakeDecode):
    """A decode worker that sends ``stall_after`` tokens, then nothing, ever (a SIGSTOPped one)."""

    def __init__(self, stall_after: int):
        super().__init__()
        self.stall_after = stall_after

    def Decode(self, request, timeout=None):
        return _Stalling(super().Decode(request, timeout), self.stall_after)


class _Stalling:
    def __init__(self, call, stall_after: int):
        self.call, self.stall_after = call, stall_after

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        sent = 0
        async for resp in self.call:
            if resp.token_ids and sent >= self.stall_after:
                await asyncio.Event().wait()
            sent += len(resp.token_ids)
            yield resp

    def cancel(self):
        self.call.cancel()


def test_a_stream_on_a_worker_found_hung_migrates_at_once_not_after_the_idle_timeout():
    async def main():
        pool = fake_pool([FakePrefill()], [HangingDecode(stall_after=2), FakeDecode()])
        pool.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=999)
        run = request_run(pool, max_tokens=6, decode_idle_timeout_s=600.0)  # the idle timeout never fires here
        stream = asyncio.create_task(_collect(run))
        while len(run.output.token_ids) < 3:  # the first token, then two from decode-0
            await asyncio.sleep(0.01)
        pool.workers["decode-0:1"].hung = True  # as the pool's liveness check marks it
        pool.workers["decode-0:1"].lost.set()
        return await asyncio.wait_for(stream, 10), run

    responses, run = asyncio.run(main())
    assert sum(len(r.token_ids) for r in responses) == 6
    assert run.migrations == 1 and run.output.finish_reason is not None


def test_a_prefill_on_a_worker_found_hung_is_retried_on_another():
    class HangingPrefill(FakePrefill):
        async def Prefill(self, request, timeout=None):
            await asyncio.Event().wait()

    class Call:
        """What the router awaits: an awaitable it may cancel, as gRPC's call object."""

        def __init__(self, coro):
            self.task = asyncio.ensure_future(coro)

        def __await__(self):
            return self.task.__await__()

        def cancel(self):
            self.task.cancel()

    class AsCall:
        def __init__(self, stub):
            self.stub = stub

        def Prefill(self, request, timeout=None):
            return Call(self.stub.Prefill(request, timeout))

        def Release(self, request, timeout=None):
            return self.stub.Release(request, timeout)

    async def main():
        pool = fake_pool([AsCall(HangingPrefill()), AsCall(FakePrefill())], [FakeDecode()])
        pool.workers["prefill-1:1"].stats = worker_pb2.WorkerStats(num_waiting_tokens=10_000)  # picked second
        run = request_run(pool, max_tokens=3)
        stream = asyncio.create_task(_collect(run))
        while not pool.workers["prefill-0:1"].inflight:
            await asyncio.sleep(0.01)
        pool.workers["prefill-0:1"].hung = True
        pool.workers["prefill-0:1"].lost.set()
        return await asyncio.wait_for(stream, 10), pool

    responses, pool = asyncio.run(main())
    assert sum(len(r.token_ids) for r in responses) == 3
    assert not pool.workers["prefill-0:1"].snapshot().routable


async def _collect(run) -> list:
    return [r async for r in run.responses()]


def test_a_router_that_loses_its_prefill_pool_stays_ready_and_says_it_is_degraded():
    """Ready once every pool has had a routable worker; after that, a lost prefill pool leaves
    it ready (its decode workers prefill) and ``degraded``, where before it went unready and a
    Kubernetes Service stopped sending it any client. A lost decode pool still takes it out."""
    asyncio.run(_degraded_sequence())


async def _degraded_sequence():
    pool = WorkerPool(hang_timeout_s=HANG_S)
    prefill, decode = FakeStub(), FakeStub()
    pool.workers["p:1"] = WorkerClient("prefill", "p:1", channel=None, stub=prefill)
    prefill.answer = None  # the prefill worker is not up yet
    pool.workers["d:1"] = WorkerClient("decode", "d:1", channel=None, stub=decode)
    await pool.refresh()
    assert not pool.ready() and pool.missing_roles() == ["prefill"]  # a cluster starting: not yet
    prefill.answer = worker_pb2.WorkerStats(num_blocks_total=10, engine_steps=1)
    await pool.refresh()
    assert pool.ready() and pool.degraded() == []
    prefill.answer = None  # the prefill pool is lost
    await pool.refresh()
    assert pool.missing_roles() == ["prefill"]
    assert pool.ready() and pool.degraded() == ["prefill"]
    decode.answer = None  # and the decode pool: nothing can serve
    await pool.refresh()
    assert not pool.ready() and pool.degraded() == []
