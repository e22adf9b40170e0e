"""What the fuzz tests share (tests/fuzz): Hypothesis settings (derandomized, fixed example counts
times ``FUZZ_SCALE``), the client timeout that marks a hang, and strategies for protobuf floats
and text that protobuf can encode."""

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
CLIENT_TIMEOUT_S = 90  # a hang: far past the cluster's request_timeout_s (60 s)


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


PROTO_FLOATS = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                         st.sampled_from([1e-40, 1e-45, -0.0, 1e-5]))
SAFE_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=24)
