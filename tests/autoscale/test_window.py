"""Samples and windows: malformed values are named, the trailing window covers its whole span."""

import pytest

from pdserve.cluster.autoscaling import MetricsError, MetricsWindow, PoolSample


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_usage": 1.5}, "kv_usage"),
    ({"kv_usage": -0.1}, "kv_usage"),
    ({"replicas": -1}, "replicas"),
    ({"queued_prompt_tokens": -5}, "queued_prompt_tokens"),
    ({"ttft_p90_s": -1.0}, "ttft_p90_s"),
    ({"itl_p90_s": float("nan")}, "itl_p90_s"),
    ({"t": float("inf")}, "t"),
])
def test_bad_sample_names_the_field(kwargs, field):
    values = {"t": 0.0, "replicas": 1, **kwargs}
    with pytest.raises(MetricsError, match=f"^{field}: ") as err:
        PoolSample(**values)
    assert err.value.field == field


def test_samples_out_of_order_are_named():
    with pytest.raises(MetricsError, match=r"samples\[1\]\.t: must be >= samples\[0\]\.t"):
        MetricsWindow((PoolSample(5.0, 1), PoolSample(4.0, 1)))


def test_trailing_keeps_the_anchor_sample_before_the_start_and_nothing_after_now():
    history = [PoolSample(t, 1) for t in (0.0, 9.5, 19.0, 28.5, 31.0)]
    window = MetricsWindow.trailing(history, now=30.0, window_s=20.0)
    assert [s.t for s in window.samples] == [9.5, 19.0, 28.5]  # 9.5 anchors the start at 10.0
    assert window.span_s(30.0) == 20.5


def test_trailing_of_a_young_history_is_partial():
    history = [PoolSample(t, 1) for t in (12.0, 20.0, 30.0)]
    window = MetricsWindow.trailing(history, now=30.0, window_s=20.0)
    assert window.oldest.t == 12.0 and window.span_s(30.0) < 20.0


def test_empty_window():
    window = MetricsWindow.trailing([], now=1.0, window_s=20.0)
    assert window.latest is None and window.span_s(1.0) == 0.0
