"""What the fuzz tests share (tests/fuzz): Hypothesis settings (derandomized, fixed example counts
times ``FUZZ_SCALE``), the bounds that mark a hang, and strategies for protobuf floats and text
that protobuf can encode."""

import os
import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
CLIENT_TIMEOUT_S = 90  # a hang: far past the cluster's request_timeout_s (60 s)
# No valid fuzz request asks for more than 16 tokens, so every answer comes within a second or two,
# and one this late waited on something. The cluster's own deadline is no such check: a request
# that waits out request_timeout_s ends 408 (HTTP) or DEADLINE_EXCEEDED, and both pass as
# client errors (a chat body with "max_tokens": null once decoded for the whole 60 s).
ANSWER_WITHIN_S = 20.0


def assert_answered_in_time(started: float, what) -> None:
    """The call begun at ``started`` (``time.monotonic()``) was answered within ``ANSWER_WITHIN_S``."""
    took = time.monotonic() - started
    assert took < ANSWER_WITHIN_S, f"answered after {took:.1f} s (a hang: over {ANSWER_WITHIN_S:g} s): {what!r}"[:2000]


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


PROTO_FLOATS = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                         st.sampled_from([1e-40, 1e-45, -0.0, 1e-5]))
SAFE_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=24)
