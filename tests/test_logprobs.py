"""The vLLM-style closeness check (tests/logprobs.py) itself: it must be able to fail."""

import pytest

from tests.logprobs import Generation, check_logprobs_close


def gen(tokens, tops):
    return Generation(tokens, [set(t) for t in tops])


def test_identical_outputs_agree_exactly():
    a = gen([1, 2, 3], [{1}, {2}, {3}])
    assert check_logprobs_close([a, a], [a, a], "a", "b") == 2


def test_divergence_at_a_near_tie_passes_and_is_not_exact():
    a = gen([1, 2, 9, 9], [{1, 5}, {2, 7}, {3, 4}, {9}])
    b = gen([1, 2, 4, 0], [{1, 5}, {2, 7}, {4, 9}, {0}])
    assert check_logprobs_close([a], [b], "a", "b") == 0


def test_divergence_outside_the_other_sides_top_k_fails():
    a = gen([1, 8], [{1}, {8, 3}])
    b = gen([1, 3], [{1}, {3, 4}])  # 8 is not in b's top ids at position 1
    with pytest.raises(AssertionError, match="position 1: a's 8 not in b's top"):
        check_logprobs_close([a], [b], "a", "b")
