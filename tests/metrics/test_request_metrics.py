"""A request's timeline at the router, observed with a fake clock."""

import pytest

from tests.metrics.metrics_helpers import FakeClock, deltas, sample, samples
from pdserve.wire import metrics
from pdserve.wire.metrics import RequestMetrics

TIMES = ("pdserve:time_to_first_token_seconds_sum", "pdserve:inter_token_latency_seconds_sum",
         "pdserve:e2e_request_latency_seconds_sum", "pdserve:request_decode_time_seconds_sum",
         "pdserve:request_queue_time_seconds_sum", "pdserve:request_prefill_time_seconds_sum",
         "pdserve:inter_token_latency_seconds_count", "pdserve:generation_tokens_total",
         "pdserve:prompt_tokens_total")


def test_a_streamed_request_is_timed_from_its_start():
    clock, before = FakeClock(), samples(*TIMES)
    m = RequestMetrics(clock)
    clock.advance(0.5)
    m.prefilled(prompt_tokens=12, queue_s=0.1, prefill_s=0.4)
    m.sent(1)
    clock.advance(0.05)
    m.sent(1)
    clock.advance(0.07)
    m.sent(2, "length")
    d = deltas(before)
    assert d["pdserve:time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert d["pdserve:inter_token_latency_seconds_sum"] == pytest.approx(0.12)
    assert d["pdserve:inter_token_latency_seconds_count"] == 2  # one gap per batch after the first
    assert d["pdserve:e2e_request_latency_seconds_sum"] == pytest.approx(0.62)
    assert d["pdserve:request_decode_time_seconds_sum"] == pytest.approx(0.12)
    # The worker's 0.4 s is 0.1 s of queue and 0.3 s of compute.
    assert d["pdserve:request_queue_time_seconds_sum"] == pytest.approx(0.1)
    assert d["pdserve:request_prefill_time_seconds_sum"] == pytest.approx(0.3)
    assert d["pdserve:generation_tokens_total"] == 4 and d["pdserve:prompt_tokens_total"] == 12


def test_a_request_is_counted_once_by_its_first_outcome():
    before = samples("pdserve:request_success_total", finished_reason="stop")
    before_abort = samples("pdserve:request_success_total", finished_reason="abort")
    before_fail = samples("pdserve:request_failures_total", code="UNAVAILABLE")
    m = RequestMetrics(FakeClock())
    m.sent(1, "stop")
    m.finished("abort")  # the caller closed the stream after the last response
    m.failed("UNAVAILABLE")
    assert deltas(before, finished_reason="stop") == {"pdserve:request_success_total": 1}
    assert deltas(before_abort, finished_reason="abort") == {"pdserve:request_success_total": 0}
    assert deltas(before_fail, code="UNAVAILABLE") == {"pdserve:request_failures_total": 0}
    assert m.outcome == "stop"


def test_an_abort_before_the_first_token_has_no_ttft_or_decode_time():
    names = ("pdserve:time_to_first_token_seconds_count", "pdserve:request_decode_time_seconds_count",
             "pdserve:e2e_request_latency_seconds_count")
    clock, before = FakeClock(), samples(*names)
    m = RequestMetrics(clock)
    clock.advance(2.0)
    m.finished("abort")
    assert deltas(before) == {names[0]: 0, names[1]: 0, names[2]: 1}


def test_token_histograms_and_the_model_name_label():
    names = ("pdserve:request_prompt_tokens_sum", "pdserve:request_prompt_tokens_count",
             "pdserve:request_generation_tokens_sum", "pdserve:request_generation_tokens_count",
             "pdserve:time_to_first_token_seconds_count")
    before, other = samples(*names, model_name="tiny"), samples(*names, model_name="other")
    m = RequestMetrics(FakeClock(), model_name="tiny")
    m.prefilled(prompt_tokens=30, queue_s=0.0, prefill_s=0.1)
    m.sent(1)
    m.sent(4, "stop")
    assert deltas(before, model_name="tiny") == {
        "pdserve:request_prompt_tokens_sum": 30, "pdserve:request_prompt_tokens_count": 1,
        "pdserve:request_generation_tokens_sum": 5, "pdserve:request_generation_tokens_count": 1,
        "pdserve:time_to_first_token_seconds_count": 1}
    assert set(deltas(other, model_name="other").values()) == {0}  # another model's series is untouched
    # 30 prompt tokens land in the (20, 50] bucket.
    assert (sample("pdserve:request_prompt_tokens_bucket", model_name="tiny", le="50.0")
            - sample("pdserve:request_prompt_tokens_bucket", model_name="tiny", le="20.0")) >= 1


def test_a_registered_model_reads_zero_before_its_first_request():
    metrics.register_model("fresh")
    assert metrics.REGISTRY.get_sample_value("pdserve:request_retries_total", {"model_name": "fresh"}) == 0
    assert metrics.REGISTRY.get_sample_value("pdserve:request_migrations_total", {"model_name": "fresh"}) == 0
    assert metrics.REGISTRY.get_sample_value("pdserve:time_to_first_token_seconds_count", {"model_name": "fresh"}) == 0
