"""A served cluster whose prefill and decode workers each run on two tensor-parallel ranks
(rank 0 a Ray actor, rank 1 its child process): float32 greedy equals transformers through the
disaggregated path (the KV of both ranks moves, block by block), and killing one rank of a
worker under load loses no stream: the worker dies whole, its streams migrate, and the
supervisor replaces it.

The model is the tiny random Llama with the default model's tokenizer and a chat template
(``tests.factories.save_tool_llama``): 4 attention heads and 2 KV heads split over 2 ranks,
where the default model's 3 KV heads cannot."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch

from pdserve.engine.config import SchedulerConfig
from pdserve.router.limits import RouterLimits
from pdserve.shell.rank_follower import RANK_ENTRY
from tests.clusters import reconnecting_stub
from tests.factories import CHAT_QUESTIONS, assert_greedy_matches, load_reference
from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import busy_worker, gone, greedy_at_once
from tests.helpers.tensor_parallel import CHUNK, LONG, MAX_TOKENS, STREAMED, tp_cluster
from tests.serving.conftest import all_stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tool_llama):
    """Prompts of STREAMED tokens or more stream their KV, in chunks of CHUNK tokens, while shorter
    ones move at once: both paths at TP 2."""
    c = tp_cluster(tool_llama[0], scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK), num_prefill=1,
                   num_decode=2, delay_s=0.0, supervise_interval_s=0.5,
                   router_limits=RouterLimits(stream_kv_min_tokens=STREAMED))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:
        yield stub


def followers(pid: int) -> list[int]:
    """The tensor-parallel ranks a worker's rank 0 (``pid``) started: its child processes that
    run a worker's rank entry (``RANK_ENTRY``: the engine's follower and the rank's KV agent)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and RANK_ENTRY in (entry / "cmdline").read_text():
                out.append(int(entry.name))
    return out


def test_tp2_greedy_equals_transformers_through_both_pools(cluster, stub, tool_llama):
    from transformers import AutoTokenizer

    directory = tool_llama[0]
    model, tok = load_reference(directory, torch.float32), AutoTokenizer.from_pretrained(str(directory))
    lengths = set()
    for question in ["Hi", CHAT_QUESTIONS[0], LONG]:
        before = all_stats(cluster)
        ids, _, resps = collect(stub.Generate(chat_request(question, MAX_TOKENS, ignore_eos=True), timeout=120))
        after = all_stats(cluster)
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        lengths.add(len(prompt) >= STREAMED)
        assert_greedy_matches(model, prompt, ids, MAX_TOKENS, what=question)
        moved = [a.num_forward_tokens - b.num_forward_tokens
                 for a, b in zip(after, before) if a.role == "decode" and a.kv_transfers > b.kv_transfers]
        assert moved == [MAX_TOKENS - 1]  # the KV moved (in one read or several) to one decode worker: no prompt ran there
    assert lengths == {True, False}  # streamed and whole
    assert sum(s.kv_transfer_failures + s.kv_verify_failures for s in all_stats(cluster)) == 0


def test_each_worker_runs_two_ranks(cluster):
    for actor in [*cluster.prefill, *cluster.decode]:
        assert len(followers(ray.get(actor.pid.remote(), timeout=10))) == 1


def test_a_killed_rank_0_takes_its_other_rank_with_it_and_is_replaced_whole(cluster, stub):
    address = cluster.prefill_addresses[0]
    rank0 = ray.get(cluster.prefill[0].pid.remote(), timeout=10)
    (rank1,) = followers(rank0)
    os.kill(rank0, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while address in cluster.prefill_addresses or not cluster.prefill_addresses:
        assert time.monotonic() < deadline, "the killed prefill worker was not replaced"
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank1}").exists() and not gone(rank1):
        assert time.monotonic() < deadline, "rank 1 outlived its rank 0"
        time.sleep(0.1)
    assert len(followers(ray.get(cluster.prefill[0].pid.remote(), timeout=10))) == 1  # the new one has two ranks
    ids, _, _ = collect(stub.Generate(chat_request("Hello again.", MAX_TOKENS, ignore_eos=True), timeout=120))
    assert len(ids) == MAX_TOKENS


def test_killing_one_rank_of_a_decode_worker_under_load_loses_no_stream(cluster, stub):
    prompts = [f"Count to {i}." for i in range(4)]
    reference = dict(enumerate(greedy_at_once(stub, prompts, MAX_TOKENS)))
    replaced = cluster._supervisor.replaced
    with Load(stub, prompts, MAX_TOKENS, clients=3, timeout_s=120, pause_after_error_s=0.2) as load:
        load.wait_for(3)
        index = busy_worker(cluster, "decode", "num_running")
        address = cluster.decode_addresses[index]
        rank0 = ray.get(cluster.decode[index].pid.remote(), timeout=10)
        (rank1,) = followers(rank0)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while address in cluster.decode_addresses or len(cluster.decode_addresses) < 2:
            assert time.monotonic() < deadline, "the worker that lost a rank was not replaced"
            time.sleep(0.2)
        load.wait_for(3)
    assert gone(rank0)  # the worker that lost a rank ended whole
    assert cluster._supervisor.replaced - replaced >= 1
    errors = [(o.code, o.details) for o in load.outcomes if o.code is not None]
    assert not errors  # a worker's death costs no request: its streams migrate
    for o in load.outcomes:
        assert o.tokens == reference[o.prompt]

