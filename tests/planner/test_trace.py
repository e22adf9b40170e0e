import numpy as np
import pytest

from pdserve.planner.synthetic import LengthMix, bursty_day, poisson, shared_prefix
from pdserve.planner.trace import TraceError, TraceRequest, read_trace, write_trace
from pdserve.router.request_trace import TraceWriter


def test_trace_round_trips_sorted(tmp_path):
    reqs = [TraceRequest(2.0, 10, 5), TraceRequest(1.0, 20, 3, "abc", 16)]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == sorted(reqs, key=lambda r: r.t)


@pytest.mark.parametrize("line, field", [('{"t": 1, "prompt_tokens": 0, "output_tokens": 1}', "prompt_tokens"),
                                         ('{"t": -1, "prompt_tokens": 1, "output_tokens": 1}', "t"),
                                         ('{"t": 1, "output_tokens": 1}', "prompt_tokens"),
                                         ('{"t": 1, "prompt_tokens": 4, "output_tokens": 1, "prefix_tokens": 9}',
                                          "prefix_tokens"),
                                         ("not json", "line")])
def test_bad_lines_name_the_field_and_the_line(tmp_path, line, field):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "prompt_tokens": 1, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.field == field and f"{path}:2" in str(info.value)


def test_poisson_has_the_rate_and_the_mean_lengths():
    reqs = poisson(50, 200, LengthMix(700, 150, sigma=0.8), seed=3)
    assert len(reqs) == pytest.approx(10_000, rel=0.05)
    assert np.mean([r.prompt_tokens for r in reqs]) == pytest.approx(700, rel=0.05)
    assert np.mean([r.output_tokens for r in reqs]) == pytest.approx(150, rel=0.05)
    assert poisson(50, 10, LengthMix(5, 5), seed=1) == poisson(50, 10, LengthMix(5, 5), seed=1)


def test_bursty_day_follows_the_day_and_bursts():
    reqs = bursty_day(2.0, LengthMix(10, 10), duration_s=86400.0, bursts=0, seed=0)
    t = np.array([r.t for r in reqs])
    trough = ((t > 3 * 3600) & (t < 5 * 3600)).sum()
    peak = ((t > 15 * 3600) & (t < 17 * 3600)).sum()
    assert peak > 5 * trough
    assert len(reqs) == pytest.approx(2.0 * 86400, rel=0.05)


def test_shared_prefix_marks_the_prefix():
    reqs = shared_prefix(5, 20, LengthMix(10, 5), num_prefixes=2, prefix_tokens=100)
    assert {r.prefix_hash for r in reqs} == {"prefix-0", "prefix-1"}
    assert all(r.prompt_tokens == 110 and r.prefix_tokens == 100 for r in reqs)


def test_router_trace_writer_writes_the_replay_format(tmp_path):
    path = tmp_path / "router.jsonl"
    with TraceWriter(path, block_size=4, prefix_blocks=2, clock=iter([100.0, 100.5]).__next__) as w:
        w.record(list(range(10)), 7)
        w.record(list(range(3)), 2)
    a, b = read_trace(path)
    assert (a.t, a.prompt_tokens, a.output_tokens, a.prefix_tokens) == (0.0, 10, 7, 8)
    assert (b.t, b.prefix_hash, b.prefix_tokens) == (0.5, None, 0)
    other = TraceWriter(tmp_path / "o.jsonl", block_size=4, prefix_blocks=2, clock=lambda: 0.0)
    assert other.prefix_of(list(range(8)) + [99]) == (a.prefix_hash, 8)  # same leading blocks, same hash


def test_a_context_limit_drops_pairs_that_do_not_fit_and_keeps_the_count():
    mix = LengthMix(755, 200, sigma=0.8, max_len=4096, max_total=2048)
    prompts, outputs = mix.sample(5000, np.random.default_rng(0))
    assert len(prompts) == len(outputs) == 5000
    assert (prompts + outputs).max() < 2048
    unfiltered, _ = LengthMix(755, 200, sigma=0.8, max_len=4096).sample(5000, np.random.default_rng(0))
    assert (unfiltered >= 2048).any() and prompts.mean() < unfiltered.mean()
    with pytest.raises(TraceError):
        LengthMix(10, 10, max_total=2)
