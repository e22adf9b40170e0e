"""The load generator's metrics (benchmarks/load/metrics.py): pure functions over hand-made
request records; no server."""

import math
import random

import numpy as np
import pytest

from benchmarks.load.metrics import (RequestRecord, e2el, goodput, itls, meets_slo, percentile, summarize, tpot,
                                     ttft)
from benchmarks.load.workload import SLO


def rec(sent=0.0, chunks=(0.2, 0.3, 0.5), end=None, tokens=None, prompt=10, error=None) -> RequestRecord:
    return RequestRecord(prompt_tokens=prompt, output_tokens=len(chunks) if tokens is None else tokens, sent=sent,
                         chunk_times=tuple(chunks), end=chunks[-1] if end is None and chunks else (end or sent),
                         error=error)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_equals_numpy_linear(n, q):
    xs = [random.Random(n).uniform(-5, 50) for _ in range(n)]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_of_nothing_is_nan_and_q_out_of_range_is_refused():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q: must be in"):
        percentile([1.0], 101)


def test_percentile_hand_values():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input: between the 2nd and 3rd
    assert percentile([10, 20], 90) == 19.0
    assert percentile([7], 99) == 7


def test_request_latencies():
    r = rec(sent=1.0, chunks=(1.25, 1.35, 1.65, 1.75), end=1.8)
    assert ttft(r) == pytest.approx(0.25)
    assert tpot(r) == pytest.approx((1.8 - 1.25) / 3)  # 4 tokens: 3 after the first
    assert itls(r) == pytest.approx([0.1, 0.3, 0.1])
    assert e2el(r) == pytest.approx(0.8)


def test_tpot_counts_tokens_not_chunks():
    """A server may pack several tokens into a chunk: TPOT divides by tokens from usage."""
    r = rec(chunks=(0.1, 0.5), end=0.5, tokens=5)
    assert tpot(r) == pytest.approx(0.4 / 4) and itls(r) == pytest.approx([0.4])


def test_one_token_has_no_tpot_and_is_judged_on_ttft_alone():
    r = rec(chunks=(0.2,), end=0.2)
    assert tpot(r) is None and itls(r) == []
    assert meets_slo(r, SLO(ttft_ms=200, tpot_ms=1)) and not meets_slo(r, SLO(ttft_ms=199, tpot_ms=1e9))


def test_meets_slo_needs_both_and_is_inclusive():
    r = rec(chunks=(0.25, 0.35, 0.45), end=0.45)  # TTFT 250 ms, TPOT 100 ms
    assert meets_slo(r, SLO(250, 100))
    assert not meets_slo(r, SLO(249.9, 100)) and not meets_slo(r, SLO(250, 99.9))


def test_failed_requests_never_meet_the_slo():
    assert not meets_slo(rec(error="HTTP 429: busy"), SLO(1e9, 1e9))
    assert not meets_slo(rec(chunks=(), end=1.0), SLO(1e9, 1e9))  # a 200 with no output


def test_goodput_is_requests_meeting_both_per_second():
    slo = SLO(ttft_ms=300, tpot_ms=100)
    good = rec(chunks=(0.2, 0.25, 0.3))  # TTFT 200, TPOT 50
    slow_first = rec(chunks=(0.4, 0.45))  # TTFT 400
    slow_tokens = rec(chunks=(0.1, 0.4))  # TPOT 300
    failed = rec(error="boom")
    assert goodput([good, good, slow_first, slow_tokens, failed], 2.0, slo) == 1.0
    with pytest.raises(ValueError, match="duration_s"):
        goodput([good], 0, slo)


def test_summarize_hand_computed():
    records = [rec(sent=0.0, chunks=(0.1, 0.2, 0.3), prompt=100),  # TTFT 100, TPOT 100, ITLs 100, 100
               rec(sent=0.5, chunks=(0.8, 1.2), prompt=50),  # TTFT 300, TPOT 400, ITL 400
               rec(sent=1.0, error="HTTP 500: x")]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=200))
    assert (s.completed, s.failed) == (2, 1)
    assert s.req_s == 1.0 and s.output_tok_s == 2.5 and s.prompt_tok_s == 75.0
    assert s.ttft_ms["p50"] == pytest.approx(200) and s.ttft_ms["mean"] == pytest.approx(200)
    assert s.tpot_ms["p99"] == pytest.approx(100 + 300 * 0.99)
    assert s.itl_ms["p50"] == pytest.approx(100) and s.itl_ms["mean"] == pytest.approx(200)
    assert s.e2el_ms["p90"] == pytest.approx(300 + 400 * 0.9)
    assert s.goodput_req_s == 0.5 and s.slo_attainment == pytest.approx(1 / 3)


def test_summarize_without_slo_or_completions():
    s = summarize([rec(error="x")], duration_s=1.0)
    assert s.goodput_req_s is None and s.slo_attainment is None and s.completed == 0
    assert math.isnan(s.ttft_ms["p50"]) and math.isnan(s.ttft_ms["mean"])
