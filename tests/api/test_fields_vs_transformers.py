"""Each new sampling field's effect equals applying it to transformers' logits (float32,
the tiny random Llama), engine-level: penalties, logit_bias, min_tokens, top logprobs and
prompt logprobs (echo). Reference loops run transformers' full forward at every step."""

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

from pdserve.engine.sampling.params import SamplingParams
from tests.factories import hf_greedy, make_engine, random_prompts

STEPS = 12


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits (len(ids), V) for a whole sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_processed_greedy(hf, prompt, steps, process) -> list[int]:
    """Greedy decoding where ``process(ids, output, logits)`` edits the last position's logits."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf_logits(hf, ids)[-1].clone()
        ids.append(int(process(ids, ids[len(prompt):], logits).argmax()))
    return ids[len(prompt):]


def openai_penalties(output: list[int], logits: torch.Tensor, freq: float, pres: float) -> torch.Tensor:
    """OpenAI's documented formula: logit -= count * frequency + (count > 0) * presence."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    return logits - counts * freq - (counts > 0).float() * pres


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir[0])


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return tiny_llama_dir[1]


@pytest.mark.parametrize("seed,freq,pres", [(13, 1.5, 0.8), (11, -1.0, -1.0)])
def test_frequency_and_presence_penalties_match_transformers(engine, hf, seed, freq, pres):
    """Seed 13's greedy output repeats a token (the penalties stop that); negative values
    reward repeats, so the output changes on a prompt whose greedy output repeats nothing."""
    prompt = random_prompts(1, [10], seed=seed)[0]
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, frequency_penalty=freq, presence_penalty=pres)
    ours = engine.generate([prompt], params)[0].token_ids
    ref = hf_processed_greedy(hf, prompt, STEPS, lambda ids, out, lg: openai_penalties(out, lg, freq, pres))
    assert ours == ref
    assert ours != hf_greedy(hf, prompt, STEPS)  # the penalties changed the output


def test_repetition_penalty_matches_transformers_processor(engine, hf):
    prompt = random_prompts(1, [10], seed=12)[0]
    proc = RepetitionPenaltyLogitsProcessor(1.8)
    ours = engine.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True, repetition_penalty=1.8))[0]
    ref = hf_processed_greedy(hf, prompt, STEPS, lambda ids, out, lg: proc(torch.tensor([ids]), lg[None])[0])
    assert ours.token_ids == ref


def test_logit_bias_matches_adding_to_transformers_logits(engine, hf):
    prompt = random_prompts(1, [10], seed=13)[0]
    plain = hf_greedy(hf, prompt, STEPS)
    bias = ((plain[0], -100.0), (77, 4.0), (plain[3], -3.0))
    ours = engine.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True, logit_bias=bias))[0]

    def add_bias(ids, out, logits):
        for tid, b in bias:
            logits[tid] += b
        return logits

    ref = hf_processed_greedy(hf, prompt, STEPS, add_bias)
    assert ours.token_ids == ref and ref[0] != plain[0]


def test_all_penalties_together_in_a_mixed_batch(engine, hf):
    """Penalised and plain rows in one batch: each gets its own logits processing."""
    prompts = random_prompts(2, [9, 14], seed=14)
    bias = ((5, 2.5),)
    penalised = SamplingParams(max_tokens=STEPS, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5,
                               presence_penalty=0.4, logit_bias=bias)
    outs = engine.generate(prompts, [penalised, SamplingParams(max_tokens=STEPS, ignore_eos=True)])
    rep = RepetitionPenaltyLogitsProcessor(1.2)

    def process(ids, out, logits):  # vLLM's order: bias, repetition, frequency / presence
        logits[5] += 2.5
        logits = rep(torch.tensor([ids]), logits[None])[0]
        return openai_penalties(out, logits, 0.5, 0.4)

    assert outs[0].token_ids == hf_processed_greedy(hf, prompts[0], STEPS, process)
    assert outs[1].token_ids == hf_greedy(hf, prompts[1], STEPS)


def test_min_tokens_bans_stop_tokens_like_transformers_min_new_tokens(engine, hf):
    prompt = random_prompts(1, [12], seed=3)[0]
    plain = hf_greedy(hf, prompt, 30)
    stop = plain[1]  # greedy would stop at its 2nd token
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,), min_tokens=6)
    ours = engine.generate([prompt], params)[0]
    proc = MinNewTokensLengthLogitsProcessor(len(prompt), 6, stop)
    ref = hf_processed_greedy(hf, prompt, 30, lambda ids, out, lg: proc(torch.tensor([ids]), lg[None])[0])
    expected = ref[: ref.index(stop) + 1] if stop in ref else ref
    assert ours.token_ids == expected and len(ours.token_ids) > 6
    assert stop not in ours.token_ids[:6]


def test_top_logprobs_equal_transformers_log_softmax(engine, hf):
    prompt = random_prompts(1, [15], seed=21)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5))[0]
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)[len(prompt) - 1:-1]  # (8, V)
    assert len(out.top_logprobs) == 8
    for pos, (token, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        values, ids = ref[pos].topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values, atol=1e-4)
        assert abs(lp - ref[pos, token].item()) < 1e-4
        assert top[0][0] == token  # greedy: the chosen token is the best one


def test_top_logprobs_of_a_sampled_token_are_of_the_raw_distribution(engine, hf):
    """Penalties and temperature change the draw, not the reported (raw) logprobs."""
    prompt = random_prompts(1, [7], seed=22)[0]
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=5, logprobs=True, top_logprobs=3,
                            frequency_penalty=1.0)
    out = engine.generate([prompt], params)[0]
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), dim=-1)[len(prompt) - 1:-1]
    for pos, (token, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert abs(lp - ref[pos, token].item()) < 1e-4
        assert [t for t, _ in top] == ref[pos].topk(3).indices.tolist()


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, hf, chunk):
    """Echo's prompt logprobs: position i's logits score prompt token i + 1. Chunked, a
    prompt's logprobs are gathered across its chunks; asked twice, the second run must not
    take the first run's KV from the prefix cache (it has no logits)."""
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    eng = make_engine(tiny_llama_dir[0], **kwargs)
    prompt = random_prompts(1, [45], seed=31)[0]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for _ in range(2):
        out = eng.generate([prompt], params)[0]
        assert len(out.prompt_logprobs) == len(prompt) - 1
        for i, (lp, top) in enumerate(out.prompt_logprobs):
            assert abs(lp - ref[i, prompt[i + 1]].item()) < 1e-4
            assert [t for t, _ in top] == ref[i].topk(2).indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in top]), ref[i].topk(2).values, atol=1e-4)
