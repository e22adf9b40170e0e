"""Multi-turn conversations end to end (issue 44): a follow-up turn reuses the KV its decode
worker kept of the previous turn (prompt and answer), and that reuse never changes a token.

One cluster (1 prefill + 1 decode worker, the default model in float32, ``decode_kv_reuse`` at
its default, on), shared by every test here. The oracle for "reuse off" is the same cluster:
each turn's messages sent again as a one-shot request under a cache salt of its own, so
nothing of the conversation's cache can serve it and it runs as a plain prefill (the
engine shares prefix-cache blocks only within a salt; pdserve/router/cache_salt.py).

In bfloat16 a prompt's KV computed token by token in decode steps and the same KV computed in
one prefill need not agree bit for bit, so a follow-up that reads the former must still pick
the tokens a plain prefill picks: tests/decode_worker/test_kv_reuse.py checks that in bfloat16
(the default model, an answer's KV computed while decoding, the next turn read whole and
streamed, against a full read of KV the prefill worker computed). The router's side of reuse
(its decisions, what it reuses, the cluster path) does not depend on the dtype and is checked
here. (This module ran a second cluster in bfloat16 until 2026-11-29.)
"""

from __future__ import annotations

import os
import signal
import urllib.request
import uuid
from dataclasses import dataclass

import grpc
import pytest
import ray

from pdserve.engine.config import CacheConfig
from pdserve.engine.loader import materialize
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.helpers.chat import collect
from tests.helpers.router_http import wait_healthy
from tests.serving.conftest import start_cluster

pytestmark = pytest.mark.slow

# (user message, answer length): answers of fixed lengths (ignore_eos), follow-ups short
TURNS = (("Tell me about lighthouses.", 32), ("Why are they tall?", 24), ("And at night?", 40))
BLOCK = CacheConfig.block_size
# local_prefill_decisions_total reasons that predate issue 44: none of them is a reuse
# The router's reasons for a plan that uses a decode worker's cache (pdserve/router/local_prefill.py).
REUSE_REASONS = {"decode_hit", "prefix_on_decode"}


@dataclass
class Turn:
    messages: list[dict]  # what was sent
    ids: list[int]  # the answer
    text: str
    prompt_tokens: int
    cached_tokens: int


@pytest.fixture(scope="module")
def cluster():
    # admission_wait_s: a turn sent right after its decode worker died waits for the
    # supervisor's replacement (a model load, slow on a busy machine)
    c = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0, dtype="float32", supervise_interval_s=0.5,
                      admission_wait_s=180.0)
    try:
        wait_healthy(c.http_address)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield pdserve_pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(materialize("default"))


def ask(stub, messages: list[dict], max_tokens: int, salt: str = "") -> Turn:
    sampling = pdserve_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
    req = pdserve_pb2.GenerateRequest(sampling=sampling)
    for m in messages:
        req.chat.messages.add(role=m["role"], content=m["content"])
    ids, text, resps = collect(stub.Generate(req, timeout=300))
    usage = resps[-1].usage
    return Turn(list(messages), ids, text, usage.prompt_tokens, usage.cached_prompt_tokens)


def follow_up(previous: Turn, question: str) -> list[dict]:
    return previous.messages + [{"role": "assistant", "content": previous.text}, {"role": "user", "content": question}]


def replay(stub, turn: Turn) -> list[int]:
    """The turn's answer with no reuse: the same messages, alone, under a fresh salt."""
    return ask(stub, turn.messages, len(turn.ids), salt=f"replay-{uuid.uuid4().hex}").ids


def decisions(cluster) -> dict[str, float]:
    """The router's local_prefill_decisions_total, by reason."""
    text = urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:local_prefill_decisions_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def conversation(stub, cluster):
    """The three turns, each sent when the previous answer has streamed in full; and the
    router's decisions they added."""
    before = decisions(cluster)
    turns = [ask(stub, [{"role": "user", "content": TURNS[0][0]}], TURNS[0][1])]
    for question, n in TURNS[1:]:
        turns.append(ask(stub, follow_up(turns[-1], question), n))
    after = decisions(cluster)
    return turns, {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def test_every_turn_equals_its_replay_without_reuse(stub, conversation):
    turns, _ = conversation
    for i, turn in enumerate(turns):
        assert len(turn.ids) == TURNS[i][1]
        assert turn.ids == replay(stub, turn), f"turn {i + 1}"


def reusable(tokenizer, previous: Turn, turn: Turn) -> int:
    """Prompt tokens of ``turn`` its decode worker can have cached from ``previous``, in full
    blocks: the previous prompt and answer, less the answer's last token (never computed),
    as far as the new prompt starts with them (re-tokenized answer text may differ at its end)."""
    kept = tokenizer.apply_chat_template(previous.messages) + previous.ids[:-1]
    new = tokenizer.apply_chat_template(turn.messages)
    same = next((i for i, (a, b) in enumerate(zip(kept, new)) if a != b), min(len(kept), len(new)))
    return same // BLOCK * BLOCK


def test_follow_ups_reuse_the_previous_answers_kv(conversation, tokenizer):
    turns, counted = conversation
    for previous, turn in zip(turns, turns[1:]):
        # a prefill worker caches at most the previous prompt; more is the answer's KV
        assert reusable(tokenizer, previous, turn) > previous.prompt_tokens
        assert turn.cached_tokens >= reusable(tokenizer, previous, turn), turn.messages[-1]["content"]
    reuse = {reason: n for reason, n in counted.items() if reason in REUSE_REASONS}
    assert sum(reuse.values()) >= len(turns) - 1, f"decisions counted: {counted}"


def test_decode_worker_killed_between_turns_next_turn_has_the_same_tokens(cluster, stub):
    first = ask(stub, [{"role": "user", "content": "Name a famous lighthouse."}], 24)
    old = cluster.decode_addresses[0]
    os.kill(ray.get(cluster.decode[0].pid.remote()), signal.SIGKILL)
    # sent at once: the router still indexes the dead worker's cache, and it has no other
    # decode worker until the supervisor's replacement joins (its admission wait covers that)
    turn = ask(stub, follow_up(first, "Where is it?"), 32)
    assert cluster.decode_addresses[0] != old
    assert turn.ids == replay(stub, turn)
