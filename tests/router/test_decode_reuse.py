"""Conversations keep their KV (router side): the plan per attempt when a decode worker
caches a prefix of the prompt (pdserve/router/local_prefill.py, pure), the pool's view of the
decode workers' caches, and the plan as a run makes it (request_run)."""

import asyncio
import dataclasses
import itertools

import pytest

from pdserve.protos import worker_pb2
from pdserve.router.attempts import LocalPrefill, RemotePrefill
from pdserve.router.decode_call import decode
from pdserve.router.kv_index import prompt_block_hashes
from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.local_prefill import (DecodeHolder, LocalPrefillConfig, Mixed, PrefillOption, Reason, decide,
                                          decide_for_attempt, find_holder)
from pdserve.router.policy import WorkerSnapshot
from pdserve.router.request_run import RequestRun
from pdserve.router.session_hint import MAX_SESSION_ID_CHARS, SessionHints
from pdserve.router.validation import HttpError, parse_body
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, fake_pool, request_run, sample

ROUTING = RoutingConfig()
CFG = LocalPrefillConfig()
IDLE_PREFILL = (PrefillOption(cached_tokens=0, queued_tokens=0),)


def holder(cached: int, load: float = 0.0, queued: int = 0, worker: str = "d0") -> DecodeHolder:
    return DecodeHolder(worker, cached, load, queued)


# ---- the pure plan ------------------------------------------------------------------------

CONFIGS = [LocalPrefillConfig(), LocalPrefillConfig(colocated=True), LocalPrefillConfig(max_tokens=64),
           LocalPrefillConfig(max_tokens=256, max_load=0.5)]
MIXED = [Mixed(), Mixed(worker=True, own_queue=10, prefill_queue=5, any_mixed=True),
         Mixed(worker=True, own_queue=0, prefill_queue=None, any_mixed=True), Mixed(any_mixed=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_without_a_decode_hit_the_plan_is_todays_rule(cfg):
    """No decode worker caching anything (first turns, the reuse off): exactly ``decide``."""
    for prompt, load, mixed, hold in itertools.product((1, 63, 64, 300, 4096), (0.0, 0.49, 0.5, 1.0), MIXED,
                                                       (None, holder(0))):
        got = decide_for_attempt(cfg, ROUTING, prompt, load, hold, IDLE_PREFILL, mixed=mixed)
        assert got == decide(cfg, prompt, load, mixed=mixed), (prompt, load, mixed, hold)
        assert got.decode_worker is None and got.prefix_from is None


def test_a_short_suffix_on_the_decode_worker_that_holds_the_rest_is_prefilled_there():
    # turn 2: 400 tokens cached on d0 (turn 1's prompt and answer), 40 new ones
    got = decide_for_attempt(CFG, ROUTING, 440, 0.2, holder(400, load=0.2), IDLE_PREFILL)
    assert (got.local, got.reason, got.decode_worker, got.prefix_from) == (True, Reason.DECODE_HIT, "d0", None)
    assert got.uncached_tokens == 40 and got.label == "local"


def test_a_long_suffix_goes_to_a_prefill_worker_that_reads_the_prefix_from_the_decode_worker():
    # a long pasted document after a cached conversation, on a busy decode worker
    got = decide_for_attempt(CFG, ROUTING, 3400, 0.6, holder(400, load=0.6), IDLE_PREFILL)
    assert (got.local, got.reason, got.decode_worker, got.prefix_from) == (False, Reason.PREFIX_ON_DECODE, "d0", "d0")
    assert got.uncached_tokens == 3000 and got.label == "remote"


def test_a_prefix_a_prefill_worker_caches_as_well_is_decided_as_today():
    """A shared system prompt, or a prompt the decode worker read from the prefill worker:
    no answer's KV that only the decode worker has, so no reason to leave disaggregation (nor
    to send every stream with that prefix to one decode worker)."""
    for prefill_cached in (400, 3000):
        got = decide_for_attempt(CFG, ROUTING, 3400, 0.0, holder(400), (PrefillOption(prefill_cached, 0),))
        assert got == decide(CFG, 3400, 0.0) and got.decode_worker is None and got.prefix_from is None


def test_where_moving_kv_costs_more_than_computing_it_the_prefill_worker_computes_it():
    """A slow link (kv_move_weight above 1): reading the decode worker's prefix costs more than
    recomputing it, so the prefill worker computes the prompt past its own cache."""
    slow_link = LocalPrefillConfig(kv_move_weight=2.0)
    got = decide_for_attempt(slow_link, ROUTING, 3400, 0.6, holder(400, load=0.6, queued=9000),
                             (PrefillOption(390, 0),))
    assert (got.local, got.reason, got.prefix_from) == (False, Reason.PREFILL_CHEAPER, None)
    assert got.decode_worker == "d0"  # it still decodes where the conversation is
    assert got.uncached_tokens == 3010


def test_short_is_decided_by_the_cost_model_not_a_constant():
    """The same suffix is local on an idle decode worker and remote on a busy one; and a
    decode worker with a long queue of its own sends even a short suffix away."""
    idle = decide_for_attempt(CFG, ROUTING, 1400, 0.0, holder(400, load=0.0), IDLE_PREFILL)
    busy = decide_for_attempt(CFG, ROUTING, 1400, 1.0, holder(400, load=1.0), IDLE_PREFILL)
    assert idle.reason is Reason.DECODE_HIT and busy.reason is Reason.PREFIX_ON_DECODE
    queued = decide_for_attempt(CFG, ROUTING, 440, 0.0, holder(400, queued=5000), IDLE_PREFILL)
    assert queued.reason is Reason.PREFIX_ON_DECODE
    # ... unless every prefill worker is busier still
    swamped = decide_for_attempt(CFG, ROUTING, 440, 0.0, holder(400, queued=5000), (PrefillOption(0, 9000),))
    assert swamped.reason is Reason.DECODE_HIT
    # the crossover moves with the interference weight
    gentle = LocalPrefillConfig(interference_weight=0.0)
    assert decide_for_attempt(gentle, ROUTING, 1400, 1.0, holder(400, load=1.0), IDLE_PREFILL).local


def test_without_a_routable_prefill_worker_a_hit_prefills_locally():
    got = decide_for_attempt(CFG, ROUTING, 5000, 0.9, holder(400, load=0.9), ())
    assert got.reason is Reason.DECODE_HIT and got.decode_worker == "d0"


def test_colocated_mode_stays_local_and_sticks_to_the_holder():
    got = decide_for_attempt(LocalPrefillConfig(colocated=True), ROUTING, 5000, 0.9, holder(400, load=0.9), ())
    assert (got.reason, got.decode_worker) == (Reason.COLOCATED, "d0")


def test_the_last_prompt_token_is_always_computed():
    got = decide_for_attempt(CFG, ROUTING, 64, 0.0, holder(64), IDLE_PREFILL)
    assert got.local and got.uncached_tokens == 1


def test_new_weights_are_checked():
    for name in ("interference_weight", "kv_move_weight", "remote_overhead_tokens"):
        with pytest.raises(ValueError, match=name):
            LocalPrefillConfig(**{name: -1})


# ---- which decode worker holds the prefix ---------------------------------------------------

def snap(worker, used=0, total=100, healthy=True, role="decode"):
    return WorkerSnapshot(worker, role, healthy, blocks_used=used, blocks_total=total)


def test_the_holder_is_the_longest_prefix_with_room():
    snaps = [snap("d0"), snap("d1", used=95), snap("d2", healthy=False), snap("p0", role="prefill")]
    cached = {"d0": 64, "d1": 256, "d2": 512, "p0": 1024}
    assert find_holder(snaps, cached, blocks=4) == DecodeHolder("d1", 256, 0.95, 0)
    assert find_holder(snaps, cached, blocks=10).worker_id == "d0"  # d1 has no room: the next longest
    assert find_holder(snaps, {"d0": 0, "d1": 0}, blocks=1) is None
    assert find_holder(snaps, {"d2": 512}, blocks=1) is None  # unroutable


# ---- the pool's view and the run's plan ----------------------------------------------------

PROMPT = list(range(3, 3 + 40))  # request_run's prompt with prompt_len=40
BLOCK = 16


def publish(pool, worker: str, tokens: list[int]) -> None:
    """What a decode worker's Stats answer carries once it cached ``tokens`` (a snapshot)."""
    hashes = prompt_block_hashes(tokens, BLOCK)
    pool.index.apply(worker, worker_pb2.CacheEvents(epoch="e", snapshot=True, last_seq=len(hashes),
                                                    block_hashes=hashes, cached=[True] * len(hashes)), BLOCK)


def two_decodes():
    return fake_pool([FakePrefill()], [FakeDecode(), FakeDecode()])


def test_the_pool_reads_what_each_decode_worker_caches_and_forgets_a_removed_one():
    async def main():
        pool = two_decodes()
        publish(pool, "decode-1:1", PROMPT)
        assert pool.decode_overlaps(PROMPT) == {"decode-0:1": 0, "decode-1:1": 32}
        assert pool.prefill_overlaps(PROMPT) == {"prefill-0:1": 0}
        assert pool.decode_overlaps(PROMPT, cache_salt="other tenant")["decode-1:1"] == 0
        pool.sessions.remember("s", "decode-1:1")
        pool.workers["decode-1:1"].inflight = 1  # closed later; the test ends first
        await pool.remove("decode-1:1")
        assert pool.index.num_blocks("decode-1:1") == 0 and pool.sessions.get("s") is None

    asyncio.run(main())


def plan(run):
    attempt = run._attempt(0)
    return run._plan(attempt)


def test_a_follow_up_turn_is_prefilled_on_the_decode_worker_that_holds_it():
    pool = two_decodes()
    publish(pool, "decode-1:1", PROMPT)
    before = sample("pdserve:local_prefill_decisions_total", decision="local", reason="decode_hit")
    kind, attempt = plan(request_run(pool, prompt_len=40))
    assert isinstance(kind, LocalPrefill) and attempt.decode_worker == "decode-1:1"
    assert sample("pdserve:local_prefill_decisions_total", decision="local", reason="decode_hit") == before + 1


def test_with_the_reuse_off_or_no_hit_the_plan_is_todays():
    for reuse, published in ((False, True), (True, False)):
        pool = two_decodes()
        if published:
            publish(pool, "decode-1:1", PROMPT)
        kind, attempt = plan(request_run(pool, prompt_len=40, decode_kv_reuse=reuse))
        assert isinstance(kind, RemotePrefill) and kind.prefix_from is None
        assert attempt.decode_worker is None  # the decode call picks as it always did


def test_a_long_suffix_plans_a_remote_prefill_that_reads_the_prefix_from_the_holder():
    pool = two_decodes()
    publish(pool, "decode-1:1", PROMPT[:32])
    long_prompt = PROMPT[:32] + list(range(100, 1100))
    pool.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=900)
    run = request_run(pool, prompt_len=40)
    run.req.prompt_token_ids[:] = long_prompt
    kind, attempt = plan(run)
    assert isinstance(kind, RemotePrefill) and kind.prefix_from == "decode-1:1"
    assert attempt.decode_worker == "decode-1:1"


def session_run(pool, session_id: str, salt: str = "", **limits):
    run = request_run(pool, prompt_len=40, **limits)
    req = dataclasses.replace(run.req, params=dataclasses.replace(run.req.params, cache_salt=salt))
    return RequestRun(req, run.model, pool, run.limits, session_id=session_id)


def test_a_session_hint_keeps_a_conversation_on_its_worker_before_the_index_knows():
    pool = two_decodes()
    pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=10)
    _, attempt = plan(session_run(pool, "chat-1"))
    assert attempt.decode_worker is None  # no hint yet: the least loaded, decode-1, as without one
    pool.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=20)
    _, attempt = plan(session_run(pool, "chat-1"))
    assert attempt.decode_worker == "decode-1:1"  # though decode-0 is now less loaded
    _, attempt = plan(session_run(pool, "chat-1", salt="another tenant"))
    assert attempt.decode_worker is None  # a session id is one tenant's
    _, attempt = plan(session_run(pool, "chat-1", decode_kv_reuse=False))
    assert attempt.decode_worker is None  # the reuse off: as before the feature
    pool.workers["decode-1:1"].healthy = False  # gone: the plan falls back to the least loaded
    _, attempt = plan(session_run(pool, "chat-1"))
    assert attempt.decode_worker is None
    pool.workers["decode-1:1"].healthy = True
    _, attempt = plan(session_run(pool, "chat-1"))
    assert attempt.decode_worker == "decode-0:1"  # the session moved with its last attempt


def test_the_session_hints_are_bounded_least_recently_used_first():
    hints = SessionHints(capacity=2)
    hints.remember("a", "d0")
    hints.remember("b", "d1")
    assert hints.get("a") == "d0"  # a is now the most recent
    hints.remember("c", "d0")
    assert len(hints) == 2 and hints.get("b") is None and hints.get("a") == "d0"
    hints.forget_worker("d0")
    assert len(hints) == 0


@pytest.mark.parametrize("chat", [True, False])
def test_the_session_id_is_read_from_the_body_and_its_length_is_limited(chat):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    _, options = parse_body({**body, "session_id": "chat-1"}, chat, "m")
    assert options.session_id == "chat-1"
    assert parse_body(body, chat, "m")[1].session_id is None
    for bad in ("x" * (MAX_SESSION_ID_CHARS + 1), "", 7):
        with pytest.raises(HttpError) as exc:
            parse_body({**body, "session_id": bad}, chat, "m")
        assert exc.value.status == 400 and exc.value.param == "session_id"
        assert "session_id" in str(exc.value)
    with pytest.raises(HttpError, match=str(MAX_SESSION_ID_CHARS)):
        parse_body({**body, "session_id": "x" * (MAX_SESSION_ID_CHARS + 1)}, chat, "m")


# ---- the decode call tries the planned worker first ------------------------------------------

class CountingDecode(FakeDecode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def Decode(self, request, timeout=None):
        self.calls += 1
        return super().Decode(request, timeout)


def decode_on(pool, prefer):
    """Run one decode call preferring ``prefer``; which stubs were called."""
    async def main():
        run = request_run(pool, max_tokens=3)
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                           sampling=run._attempt(0).sampling)
        return [out async for out in decode(run.calls, request, 1, "prefill-0:1", prefer=prefer)]

    asyncio.run(main())
    return [pool.workers[a].stub.calls for a in ("decode-0:1", "decode-1:1")]


def counting_pool():
    pool = fake_pool([FakePrefill()], [CountingDecode(), CountingDecode()])
    pool.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=500)
    return pool  # decode-0 is the least loaded


def test_the_decode_call_prefers_the_planned_worker_while_it_is_routable_and_has_room():
    assert decode_on(counting_pool(), None) == [1, 0]
    assert decode_on(counting_pool(), "decode-1:1") == [0, 1]
    full = counting_pool()
    full.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=1000)
    assert decode_on(full, "decode-1:1") == [1, 0]
    down = counting_pool()
    down.workers["decode-1:1"].healthy = False
    assert decode_on(down, "decode-1:1") == [1, 0]
    assert decode_on(counting_pool(), "decode-9:1") == [1, 0]  # gone from the pool


def test_when_the_worker_holding_the_conversation_dies_the_request_migrates_and_completes():
    pool = fake_pool([FakePrefill()], [CountingDecode(), CountingDecode()])
    pool.workers["decode-1:1"].stub.fail_after = 1  # dies after one decoded token
    pool.workers["decode-1:1"].stats = worker_pb2.WorkerStats(num_blocks_total=1000, num_blocks_used=900)
    publish(pool, "decode-1:1", PROMPT[:32])
    run = request_run(pool, max_tokens=6, prompt_len=40)
    run.req.prompt_token_ids[:] = PROMPT[:32] + list(range(100, 1100))  # a long suffix: remote, prefix pulled

    async def main():
        return [r async for r in run.responses()]

    responses = asyncio.run(main())
    assert [pool.workers[a].stub.calls for a in ("decode-0:1", "decode-1:1")] == [1, 1]  # the holder first
    assert sum(len(r.token_ids) for r in responses) == 6 and run.output.finish_reason is not None
    assert run.migrations == 1


def test_a_finished_stream_is_in_the_index_before_its_workers_next_events():
    """The next turn may come within the 0.2 s poll that brings the decode worker's events for
    the answer: the run records what that worker now caches (prompt and every token but the
    last) as soon as the stream ends, so the next turn is planned on it."""
    def finish(reuse: bool):
        pool = fake_pool([FakePrefill()], [FakeDecode()])
        publish(pool, "decode-0:1", [])  # it publishes (reuse on), nothing cached yet
        run = request_run(pool, max_tokens=30, prompt_len=40, decode_kv_reuse=reuse)

        async def main():
            return [t async for resp in run.responses() for t in resp.token_ids]

        out = asyncio.run(main())
        follow_up = PROMPT + out + [9, 9, 9]
        return pool.decode_overlaps(follow_up)["decode-0:1"], len(PROMPT + out) - 1

    cached, known = finish(reuse=True)
    assert cached == known // BLOCK * BLOCK and cached > len(PROMPT)
    assert finish(reuse=False)[0] == 0
