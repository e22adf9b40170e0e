"""The sampler's filters and draws, on hand-made logits."""

import math

import torch

from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.sampling.params import SamplingParams


def rows(params, n=1, history=(1,)):
    return [SamplerRow(f"s{i}", params, list(history)) for i in range(n)]


def draw_many(params, logits, n=400, seed=0):
    sampler = Sampler(torch.device("cpu"), seed=seed)
    batch = logits.repeat(n, 1)
    tokens = sampler(batch, [SamplerRow(f"s{i}", params, [0]) for i in range(n)]).token_ids
    return tokens


LOGITS = torch.tensor([[4.0, 3.5, 3.0, 1.0, 0.5, -1.0]])


def test_greedy_is_argmax():
    tokens, logprobs, _, _ = Sampler(torch.device("cpu"))(LOGITS.clone(), rows(SamplingParams()))
    assert tokens == [0] and logprobs is None


def test_top_k_limits_support():
    assert set(draw_many(SamplingParams(temperature=1.0, top_k=2), LOGITS)) == {0, 1}


def test_top_p_keeps_the_smallest_covering_set():
    probs = torch.softmax(LOGITS[0], -1)
    assert probs[0] < 0.5 < probs[0] + probs[1]
    assert set(draw_many(SamplingParams(temperature=1.0, top_p=0.5), LOGITS)) == {0, 1}


def test_min_p_drops_tokens_far_below_the_best():
    # p(token)/p(best) = exp(l - 4): tokens 0,1,2 are above 0.3, the rest below
    assert set(draw_many(SamplingParams(temperature=1.0, min_p=0.3), LOGITS)) == {0, 1, 2}


def test_high_temperature_spreads_and_low_temperature_sharpens():
    hot = draw_many(SamplingParams(temperature=5.0), LOGITS)
    cold = draw_many(SamplingParams(temperature=0.05), LOGITS)
    assert len(set(hot)) >= 5 and set(cold) == {0}


def test_repetition_penalty_demotes_seen_tokens():
    sampler = Sampler(torch.device("cpu"))
    tokens = sampler(LOGITS.clone(), rows(SamplingParams(repetition_penalty=1.5), history=[0])).token_ids
    assert tokens == [1]  # 4.0/1.5 < 3.5


def test_logprobs_are_of_the_raw_distribution():
    sampler = Sampler(torch.device("cpu"))
    tokens, logprobs, _, _ = sampler(LOGITS.clone(), rows(SamplingParams(logprobs=True, temperature=0.5, seed=3)))
    expected = torch.log_softmax(LOGITS[0], -1)[tokens[0]].item()
    assert math.isclose(logprobs[0], expected, rel_tol=1e-6)


def test_same_seed_same_draws_different_seed_different_draws():
    def draws(seed):
        sampler = Sampler(torch.device("cpu"))
        params = SamplingParams(temperature=1.0, seed=seed)
        return [sampler(LOGITS.clone(), rows(params))[0][0] for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
