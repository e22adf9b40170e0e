"""What one request, or the peer that prefilled it, can make an engine do is bounded: prompt
logprobs are computed a slice of rows at a time (a 2,048-token chunk once made 400 MB of
float32 logits and as much again for their log-softmax, each step), and a first token out of
the vocabulary is refused naming the field and the limit (it would index past the embedding
table in the next forward, failing a step shared with other requests)."""

import pytest

from pdserve.engine.runner import prompt_logprobs
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import TINY_LLAMA, make_engine, random_prompts

VOCAB = TINY_LLAMA["vocab_size"]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_prompt_logprobs_are_computed_a_slice_at_a_time_with_the_same_numbers(tiny_llama_dir, monkeypatch):
    prompt = random_prompts(1, [300], seed=2)[0]
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    whole = make_engine(tiny_llama_dir[0]).generate([prompt], params)[0]  # 299 rows, within one slice here
    monkeypatch.setattr(prompt_logprobs, "SLICE_BYTES", 4 * VOCAB * 32, raising=False)  # 32 rows a slice
    engine = make_engine(tiny_llama_dir[0])
    compute_logits, rows = engine.runner.model.compute_logits, []

    def noted(hidden):
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    engine.runner.model.compute_logits = noted
    sliced = engine.generate([prompt], params)[0]
    assert max(rows) <= 32 and sum(r for r in rows if r > 1) >= 299 - 32
    assert sliced.prompt_logprobs == whole.prompt_logprobs and len(sliced.prompt_logprobs) == 299
    assert sliced.token_ids == whole.token_ids


@pytest.mark.parametrize("token", [VOCAB, -1, 10**9])
def test_a_peers_first_token_out_of_the_vocabulary_is_refused_naming_the_field(tiny_llama_dir, token):
    engine = make_engine(tiny_llama_dir[0])
    with pytest.raises(InvalidRequestError) as err:
        engine.add_prefilled("r", random_prompts(1, [20])[0], token, GREEDY)
    assert err.value.field == "first_token_id" and err.value.limit == VOCAB and f"[0, {VOCAB})" in str(err.value)
    assert engine.num_free_blocks == 256 and not engine.has_unfinished()


def test_a_streamed_first_token_out_of_the_vocabulary_ends_its_request_alone(tiny_llama_dir):
    """Streamed KV learns its first token last (``kv_ready``): a bad one ends that request
    with its error as its output, once its KV has landed; the stream beside it goes on."""
    engine = make_engine(tiny_llama_dir[0], policy="mixed")
    good, bad = random_prompts(2, [20, 24], seed=6)
    expected = make_engine(tiny_llama_dir[0]).generate([good], GREEDY)[0].token_ids
    engine.add_request("good", good, GREEDY)
    engine.add_prefilled("bad", bad, 0, GREEDY)  # 0: the placeholder until the prompt is done
    engine.kv_ready("bad", VOCAB + 5)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    (error,) = outputs["bad"]
    assert error.finish_reason == "error" and error.error.field == "first_token_id" and error.error.limit == VOCAB
    assert [t for o in outputs["good"] for t in o.new_token_ids] == expected
    assert engine.num_free_blocks == 256
