"""The n-gram proposer (pdserve/engine/spec/ngram.py): the continuation of the most recent
earlier occurrence of the longest suffix that occurs, and the engine's policy around it
(pdserve/engine/spec/decoding.py): what speculates, how many guesses, cut to the room left."""

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.spec.decoding import SpecDecoding
from pdserve.engine.spec.ngram import NgramProposer, lookup


def test_the_most_recent_match_of_the_longest_suffix_gives_the_guess():
    tokens = [1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2]
    assert lookup(tokens, 1, 3, 3) == [3, 9, 9]  # "1 2" last seen at 4, followed by 3 9 9
    assert lookup([7, 1, 2, 5, 8, 2, 6, 1, 2], 1, 3, 2) == [5, 8]  # "1 2" beats the more recent "2"
    assert lookup([1, 2, 3, 1, 2], 2, 2, 5) == [3, 1, 2]  # up to k, as far as the tokens go
    assert lookup([5, 5], 1, 3, 2) == [5]


def test_no_match_no_guess():
    assert lookup([1, 2, 3, 4], 1, 3, 4) == []
    assert lookup([1, 2, 3, 1, 2], 3, 4, 4) == []  # no suffix of 3 occurs earlier
    assert lookup([1], 1, 1, 4) == [] and lookup([1, 1], 1, 1, 0) == []


def test_the_window_bounds_the_lookup():
    tokens = [4, 5, 6] + [0] * 50 + [4, 5]
    assert NgramProposer(2, 2).propose([Sequence("a", tokens, SamplingParams())], 2)[0].token_ids == [6, 0]
    assert NgramProposer(2, 2, window=20).propose([Sequence("a", tokens, SamplingParams())], 2)[0].token_ids == []


def spec(**fields):
    return SpecDecoding(SpeculativeConfig(**{"num_speculative_tokens": 4, **fields}), NgramProposer(1, 3), 64)


def decoding(seq_id, tokens, **params):
    return Sequence(seq_id, tokens, SamplingParams(**{"max_tokens": 32, **params}), num_prompt_tokens=len(tokens) - 1)


REPEATING = [3, 4, 5, 6, 7, 3, 4]  # guesses 5 6 7 3


def test_requests_with_per_token_rules_do_not_speculate():
    s = spec()
    seqs = [decoding(name, REPEATING, **p) for name, p in [
        ("plain", {}), ("sampled", {"temperature": 0.8, "top_p": 0.9}), ("logprobs", {"logprobs": True}),
        ("penalty", {"presence_penalty": 0.5}), ("bias", {"logit_bias": ((3, 1.0),)}),
        ("min", {"min_tokens": 4}), ("echo", {"prompt_logprobs": 0}), ("stop", {"stop": ("x",)})]]
    assert set(s.propose(seqs)) == {"plain", "sampled"}


def test_guesses_are_cut_to_the_room_left_and_turn_off_past_the_batch_limit():
    s = spec(disable_by_batch_size=4)
    assert s.propose([decoding("a", REPEATING)])["a"].token_ids == [5, 6, 7, 3]
    # One token out: with 3 more to go, two guesses and the target's own token.
    assert s.propose([decoding("a", REPEATING, max_tokens=4)])["a"].token_ids == [5, 6]
    assert s.propose([decoding("a", REPEATING, max_tokens=2)]) == {}  # its next token is its last
    assert SpecDecoding(SpeculativeConfig(num_speculative_tokens=4), NgramProposer(1, 3), 9).propose(
        [decoding("a", REPEATING)])["a"].token_ids == [5]  # the context's end
    assert [s.num_guesses(b) for b in (1, 2, 3, 4, 5)] == [4, 3, 1, 1, 0]  # at most ~8 positions a step
    assert s.propose([decoding(f"s{i}", REPEATING) for i in range(5)]) == {}
