"""Every request ends: its deadline (the OpenAI body's ``timeout``, X-Request-Timeout, gRPC's
deadline, else ``request_timeout_s``) bounds it end to end, and a prefill worker that holds its
socket and never answers (SIGSTOPped) costs a request only the prefill call's bound: then a
decode worker prefills the prompt itself instead of the request failing UNAVAILABLE. Fake
workers in process; tests/serving/test_one_prefill_one_decode.py freezes a real one."""

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

import aiohttp
import grpc
import pytest

from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.router import http_api
from pdserve.router.errors import RouteError
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.protos import worker_pb2
from pdserve.router.liveness import Liveness
from pdserve.router.local_prefill import LocalPrefillConfig, Mixed, Reason, decide
from pdserve.router.pool import WorkerClient
from pdserve.router.request_budget import prefill_call_timeout_s
from pdserve.router.service import GenerationService
from pdserve.router.validation import parse_body
from pdserve.router.http_errors import HttpError
from tests.helpers.fake_workers import FrozenDecode, FrozenPrefill, LocalDecode
from tests.metrics.metrics_helpers import FakePrefill, LetterTokenizer, fake_pool, request_run, rpc_error


def test_a_prefill_calls_bound_grows_with_prompt_and_queue_and_never_passes_the_deadline():
    bound = lambda remaining, prompt, queued, pace: prefill_call_timeout_s(  # noqa: E731
        remaining, prompt, queued, pace, min_s=10.0, slack=4.0, token_s_guess=0.01)
    assert bound(600, 50, 0, 0.001) == 10.0  # a short prompt: the floor
    assert bound(600, 5000, 0, 0.001) == pytest.approx(20.0)  # 4 x 5000 tokens x 1 ms
    assert bound(600, 5000, 5000, 0.001) == pytest.approx(40.0)  # the queue ahead counts too
    assert bound(600, 5000, 0, None) == pytest.approx(200.0)  # no pace seen yet: the guess
    assert bound(3.0, 5000, 0, 0.001) == 3.0  # the request's deadline caps it


@pytest.mark.parametrize("field", ["prefill_call_min_s", "prefill_call_slack", "prefill_token_s_guess",
                                   "request_timeout_s"])
def test_bounds_that_are_not_positive_are_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        RouterLimits(**{field: 0.0})


@pytest.mark.parametrize("value,words", [(0, "greater than 0"), (-2.5, "greater than 0"),
                                         (10**6, "less than or equal to 86400"), ("5", "valid number"),
                                         (True, "valid number")])
def test_a_bad_body_timeout_is_a_400_naming_the_field_and_the_limit(value, words):
    for chat, body in ((False, {"prompt": "x"}), (True, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(HttpError) as err:
            parse_body({**body, "timeout": value}, chat, "m")
        assert err.value.status == 400 and err.value.param == "timeout" and words in str(err.value)


def test_a_body_timeout_is_read_on_both_endpoints():
    assert parse_body({"prompt": "x", "timeout": 30}, False, "m")[1].timeout_s == 30.0
    chat = {"messages": [{"role": "user", "content": "x"}], "timeout": 2.5}
    assert parse_body(chat, True, "m")[1].timeout_s == 2.5
    assert parse_body({"prompt": "x"}, False, "m")[1].timeout_s is None


async def _collect(run) -> list:
    return [r async for r in run.responses()]


def test_a_frozen_prefill_worker_costs_the_call_bound_then_the_decode_worker_prefills():
    prefill, decode = FrozenPrefill(), LocalDecode()

    async def main():
        pool = fake_pool([prefill], [decode])
        run = request_run(pool, max_tokens=4, prefill_call_min_s=0.3)
        start = time.monotonic()
        responses = await _collect(run)
        return responses, run, pool, time.monotonic() - start

    responses, run, pool, took = asyncio.run(main())
    assert [t for r in responses for t in r.token_ids] == [1, 2, 3, 4]
    assert run.output.finish_reason is not None and run.migrations == 0
    assert prefill.timeouts == [pytest.approx(0.3)]  # the bound, not the request's 600 s
    assert 0.3 <= took < 5.0
    assert [r.local_prefill for r in decode.requests] == [True]
    assert not pool.workers["prefill-0:1"].healthy  # marked down until it answers a poll again
    # and, having left a call unanswered past its bound, out of routing for a while even though
    # it may keep answering polls (an accepted call it never serves)
    assert pool.workers["prefill-0:1"].down_until > time.monotonic()


def test_with_no_routable_prefill_worker_the_decode_worker_prefills_at_once():
    """Before: the request waited its whole admission budget for a prefill worker, then 503."""
    prefill, decode = FrozenPrefill(), LocalDecode()

    async def main():
        pool = fake_pool([prefill], [decode])
        pool.workers["prefill-0:1"].healthy = False  # its Stats polls fail: hung, dead or gone
        start = time.monotonic()
        responses = await _collect(request_run(pool, max_tokens=3))
        return responses, time.monotonic() - start

    responses, took = asyncio.run(main())
    assert [t for r in responses for t in r.token_ids] == [1, 2, 3]
    assert prefill.timeouts == [] and [r.local_prefill for r in decode.requests] == [True]
    assert took < 1.0


def test_a_request_whose_workers_never_answer_ends_deadline_exceeded_at_its_deadline():
    async def main():
        run = request_run(fake_pool([FrozenPrefill()], [FrozenDecode()]), max_tokens=3, request_timeout_s=0.6,
                          prefill_call_min_s=0.2)
        start = time.monotonic()
        with pytest.raises(RouteError) as err:
            await _collect(run)
        return err.value, time.monotonic() - start

    err, took = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline of 0.6 s" in str(err)
    assert 0.6 <= took < 2.0


def test_the_body_timeout_ends_an_http_request_with_the_timeout_error_the_api_uses():
    async def main():
        model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
        service = GenerationService(model, fake_pool([FakePrefill()], [FrozenDecode()]), RouterLimits())
        runner, address = await http_api.start(service, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                results = []
                # The sooner of the body's timeout and X-Request-Timeout is the deadline.
                for body, headers in (({"timeout": 0.5}, None), ({"timeout": 30}, {"X-Request-Timeout": "0.5"})):
                    start = time.monotonic()
                    async with session.post(f"http://{address}/v1/completions", headers=headers,
                                            data=json.dumps({"prompt": [5, 6], "max_tokens": 3, **body})) as r:
                        results.append((r.status, await r.json(), time.monotonic() - start))
                return results
        finally:
            await runner.cleanup()

    for status, payload, took in asyncio.run(main()):
        assert status == 408 and payload["error"]["type"] == "timeout", payload
        assert "deadline of 0.5 s" in payload["error"]["message"] and 0.5 <= took < 3.0


def test_the_prefill_call_floor_is_a_serve_setting_refused_when_not_positive():
    def limits(argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return build(resolve(parser.parse_args(argv), environ={})).router_limits

    assert limits([]).prefill_call_min_s == RouterLimits().prefill_call_min_s
    assert limits(["--prefill-call-min-seconds", "3"]).prefill_call_min_s == 3.0
    with pytest.raises(SettingsError, match="prefill_call_min_seconds"):
        limits(["--prefill-call-min-seconds", "0"])


def test_the_rule_prefills_on_the_decode_worker_while_no_prefill_worker_is_routable():
    off = LocalPrefillConfig()  # conditional disaggregation off: every prompt to the prefill pool
    assert not decide(off, 5000, 0.9).local
    down = decide(off, 5000, 0.9, mixed=Mixed(prefill_down=True))
    assert down.local and down.reason is Reason.NO_PREFILL_WORKER
    assert decide(LocalPrefillConfig(colocated=True), 10, 0.0, mixed=Mixed(prefill_down=True)).reason is Reason.COLOCATED


def test_a_prefill_call_on_a_worker_that_stopped_making_progress_gives_up_before_its_bound():
    """A long queue makes the call's bound long, but a worker frozen with it (no progress in
    its polls) is given up after ``prefill_call_min_s`` of silence."""
    prefill, decode = FrozenPrefill(), LocalDecode()

    async def main():
        pool = fake_pool([prefill], [decode])
        client = pool.workers["prefill-0:1"]
        client.stats = worker_pb2.WorkerStats(num_waiting_tokens=60_000)
        client.liveness = Liveness(steps=7, progressed_at=time.monotonic())  # its last poll that showed progress
        start = time.monotonic()
        responses = await _collect(request_run(pool, max_tokens=2, prefill_call_min_s=0.4))
        return responses, time.monotonic() - start

    responses, took = asyncio.run(main())
    assert [t for r in responses for t in r.token_ids] == [1, 2]
    assert prefill.timeouts[0] > 100  # the bound the queue gave ...
    assert 0.4 <= took < 3.0  # ... and the silence that ended the call first


class _DiesAtOnce(LocalDecode):
    """A decode worker that fails its first stream before any message (killed, or found hung)."""

    def Decode(self, request, timeout=None):
        if not self.requests:
            self.requests.append(request)
            return _Failing()
        return super().Decode(request, timeout)


class _Failing:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "worker gone")

    def cancel(self) -> None:
        pass


def test_after_a_fault_an_empty_pool_is_waited_on_until_the_deadline_not_the_admission_budget():
    """Its only decode worker lost before the first token; the replacement comes after the
    admission budget. Before: 503 "no healthy decode worker" once the budget was spent."""
    async def main():
        pool = fake_pool([FrozenPrefill()], [_DiesAtOnce()])
        pool.workers["prefill-0:1"].healthy = False  # the decode worker prefills (the plan is local)

        async def supervisor():
            while pool.workers["decode-0:1"].healthy:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.6)  # past the admission budget below
            pool.workers["decode-1:1"] = WorkerClient("decode", "decode-1:1", channel=None, stub=LocalDecode(),
                                                      healthy=True, stats=worker_pb2.WorkerStats(num_blocks_total=1000))

        replacing = asyncio.create_task(supervisor())
        run = request_run(pool, max_tokens=3, admission_wait_s=0.2, request_timeout_s=10.0)
        responses = await _collect(run)
        await replacing
        return responses, run

    responses, run = asyncio.run(main())
    assert [t for r in responses for t in r.token_ids] == [1, 2, 3] and run.migrations == 1
