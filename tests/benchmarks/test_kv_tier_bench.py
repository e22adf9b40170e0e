"""The KV tier benchmark measures what it says: the working set is the asked multiple of the
KV memory each worker gets, revisits come after the cold pass and cover every prefix, and the
cached share counts revisits only."""

from __future__ import annotations

import pytest

from benchmarks.kv_tier import parse_args, sizes, summary, traffic


def test_kv_memory_is_a_quarter_of_the_working_set_in_whole_blocks():
    args = parse_args(["--prefixes", "16", "--prefix-tokens", "2048"])
    size = sizes(args)
    # SmolLM2-135M in bfloat16: 30 layers x K and V x 3 heads x 64 dims x 2 bytes a token.
    assert size["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert size["working_set_bytes"] == 16 * 2048 * size["kv_bytes_per_token"]
    block = 16 * size["kv_bytes_per_token"]
    assert size["kv_cache_memory"] % block == 0
    assert 3.99 < size["working_set_bytes"] / size["kv_cache_memory"] < 4.01
    assert size["kv_offload_bytes"] >= size["working_set_bytes"]


def test_kv_memory_under_one_request_is_refused():
    with pytest.raises(SystemExit, match="under one request"):
        sizes(parse_args(["--prefixes", "2", "--prefix-tokens", "512", "--working-set-ratio", "8"]))


def test_revisits_follow_the_cold_pass_shuffled():
    prefixes, order = traffic(parse_args(["--prefixes", "6", "--prefix-tokens", "32", "--revisits", "2"]))
    assert len(prefixes) == 6 and all(len(p) == 32 for p in prefixes)
    assert len({tuple(p) for p in prefixes}) == 6
    assert order[:6] == list(range(6))
    assert sorted(order[6:12]) == sorted(order[12:]) == list(range(6))
    assert order[6:12] != list(range(6))


def test_cached_share_counts_revisits_only():
    records = [{"prefix": 0, "revisit": False, "ttft_s": 2.0, "prompt_tokens": 100, "cached_tokens": 0},
               {"prefix": 0, "revisit": True, "ttft_s": 0.2, "prompt_tokens": 100, "cached_tokens": 96},
               {"prefix": 1, "revisit": True, "ttft_s": 0.4, "prompt_tokens": 100, "cached_tokens": 0}]
    s = summary(records, prefix_tokens=96)
    assert s["revisits"] == 2 and s["cached_share"] == pytest.approx(0.48)
    assert s["prefix_cached_share"] == pytest.approx(0.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0) and s["cold_ttft_ms_p50"] == pytest.approx(2000.0)
