"""The conversations benchmark's pure parts (benchmarks/conversations.py and its report): the
seeded traffic, which turns count as alone for KV bytes, and the per-turn statistics."""

import argparse

import pytest

from benchmarks.conversations import Conversation, InFlight, Turn, conversations, pick_vllm_dtype
from benchmarks.conversations_report import ratios, summarize
from benchmarks.load.workload import parse_lengths


def traffic_args(**kw) -> argparse.Namespace:
    base = dict(seed=0, conversations=3, turns=4, rate=0.5, answer_tokens=parse_lengths("uniform:128:512"),
                message_tokens=parse_lengths("uniform:16:64"))
    return argparse.Namespace(**{**base, **kw})


def test_traffic_is_seeded_within_its_lengths_and_arrives_at_a_fixed_rate():
    a, b = conversations(traffic_args()), conversations(traffic_args())
    assert a == b and a != conversations(traffic_args(seed=1))
    assert [c.start_s for c in a] == [0.0, 2.0, 4.0]
    for c in a:
        assert isinstance(c, Conversation) and len(c.messages) == 4
        assert all(128 <= n <= 512 for n in c.answers) and all(16 <= n <= 64 for n in c.words)
        assert [len(m.split()) for m in c.messages] == list(c.words)


def test_a_turn_is_alone_only_when_no_other_was_in_flight_at_any_point():
    flight, a, b, c = InFlight(), Turn(0, 1, 1, 1), Turn(1, 1, 1, 1), Turn(2, 1, 1, 1)
    flight.enter(a)
    flight.leave(a)
    flight.enter(b)
    flight.enter(c)  # c starts while b runs: both overlapped
    flight.leave(b)
    flight.leave(c)
    assert (a.overlapped, b.overlapped, c.overlapped) == (False, True, True)


def turn(conv, k, prompt, cached, completion, first_s, gaps, kv=None):
    t = Turn(conv, k, 20, completion, sent=0.0, prompt_tokens=prompt, cached_tokens=cached,
             completion_tokens=completion, kv_bytes=kv)
    t.chunks = [first_s + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    return t


def test_per_turn_statistics_and_ratios():
    turns = [turn(0, 1, 50, 0, 100, 0.2, [0.01, 0.03], kv=1000.0), turn(0, 2, 180, 140, 100, 0.1, [0.02]),
             turn(1, 1, 60, 16, 100, 0.4, [0.01])]
    got = summarize(turns, kv_bytes_total=3000.0)
    g1, g2, follow = got["by_turn"]["1"], got["by_turn"]["2"], got["by_turn"]["2+"]
    assert (g1["turns"], g1["computed_tokens_mean"], g1["ttft_ms_p50"]) == (2, 47.0, 300.0)
    assert g1["kv_bytes_alone_mean"] == 1000.0 and g1["kv_bytes_alone_turns"] == 1
    assert (g2["computed_tokens_mean"], g2["new_prompt_tokens_mean"]) == (40.0, 30.0)  # 180 - 50 - 100
    assert follow == g2 and got["kv_bytes_per_turn_mean"] == 1000.0
    assert g2["kv_bytes_alone_turns"] == 0 and g2["kv_bytes_alone_mean"] is None
    peer = summarize([turn(0, 1, 50, 0, 100, 0.4, [0.02]), turn(0, 2, 180, 0, 100, 0.4, [0.02])], None)
    r = ratios({"arms": {"pdserve": got, "vllm": peer}})
    assert r["pdserve"]["2"]["computed_tokens_mean"] == pytest.approx(40 / 180, abs=1e-3)
    assert r["pdserve"]["2"]["ttft_ms_p50"] == 0.25
    assert ratios({"arms": {"pdserve": got}}) == {}


def test_vllm_runs_bfloat16_only_where_the_processor_has_bf16_instructions():
    assert pick_vllm_dtype(["avx2", "avx512f", "avx512_bf16"]) == "bfloat16"
    assert pick_vllm_dtype(["avx2", "amx_bf16"]) == "bfloat16"
    assert pick_vllm_dtype(["avx2", "avx512f"]) == "float32"
