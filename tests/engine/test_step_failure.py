"""A step that raises (twice: the first time its sequences are retried on the next step)
aborts exactly the sequences it held, frees their blocks, and leaves the engine serving
everything else. The failure is injected into the sampler
(``tests.factories.FailingSampler`` says why: validation closed the real overflow)."""

import pytest

from pdserve.engine.errors import StepFailed
from pdserve.engine.sampling import SamplingParams
from tests.factories import fail_sampling_for, make_engine, random_prompts

OVERFLOW = SamplingParams(max_tokens=4, temperature=0.7)  # the sampler fails for "bad"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run_to_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def test_a_failing_prefill_step_aborts_its_batch_and_the_engine_goes_on(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    fail_sampling_for(engine, "bad")
    good, bad, later = random_prompts(3, [20, 30, 25], seed=3)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, OVERFLOW)
    assert engine.step() == []  # the first failure is retried
    with pytest.raises(StepFailed) as info:
        engine.step()  # both prompts are in this prefill step: both are aborted
    assert sorted(info.value.request_ids) == ["bad", "good"]
    assert engine.num_free_blocks == 256 and not engine.has_unfinished()
    engine.add_request("later", later, GREEDY)
    assert len(run_to_end(engine)["later"]) == 6
    assert engine.num_free_blocks == 256


def test_a_failing_decode_step_does_not_make_later_steps_fail(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    fail_sampling_for(engine, "bad")
    survivor, bad = random_prompts(2, [20, 18], seed=4)
    reference = make_engine(tiny_llama_dir[0])
    expected = reference.generate([survivor], GREEDY)[0].token_ids
    # "bad" enters as a remote-prefilled request: its first forward is a decode step.
    engine.add_prefilled("bad", bad, 5, OVERFLOW)
    engine.kv_ready("bad")
    assert engine.step() == []  # the first failure is retried
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert info.value.request_ids == ["bad"]
    engine.add_request("survivor", survivor, GREEDY)
    assert run_to_end(engine)["survivor"] == expected
    assert engine.num_free_blocks == 256


def test_held_kv_is_a_state_and_release_frees_it(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    engine.add_request("p", random_prompts(1, [40])[0], SamplingParams(max_tokens=8), hold_kv=True)
    (out,) = engine.step()
    assert out.finished and out.finish_reason is None
    assert len(engine.held_block_ids("p")) == 3 and engine.num_held == 1
    assert not engine.has_runnable()
    assert engine.free_held("p") and not engine.free_held("p")
    assert engine.num_free_blocks == 256 and engine.num_held == 0
