"""A step that raises is run again in parts (``pdserve.engine.core.step_isolation``): the row
the fault belongs to ends alone, and a fault pinned on no row (a lone request whose step
keeps raising) aborts exactly the sequences it held, frees their blocks, and leaves the engine
serving everything else. The failure is injected into the sampler
(``tests.factories.FailingSampler`` says why: validation closed the real overflow)."""

import pytest

from pdserve.engine.errors import StepFailed
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import fail_sampling_for, make_engine, random_prompts

OVERFLOW = SamplingParams(max_tokens=4, temperature=0.7)  # the sampler fails for "bad"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run_to_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def test_a_failing_prefill_step_ends_the_row_it_belongs_to_and_the_engine_goes_on(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    fail_sampling_for(engine, "bad")
    good, bad, later = random_prompts(3, [20, 30, 25], seed=3)
    expected = make_engine(tiny_llama_dir[0]).generate([good], GREEDY)[0].token_ids
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, OVERFLOW)
    outputs = {o.request_id: o for o in engine.step()}  # both prompts are in this prefill step
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].error.field == "step"
    assert len(outputs["good"].new_token_ids) == 1
    engine.add_request("later", later, GREEDY)
    tokens = run_to_end(engine)
    assert [outputs["good"].new_token_ids[0]] + tokens["good"] == expected
    assert len(tokens["later"]) == 6 and engine.num_free_blocks == 256


def test_a_lone_request_whose_step_keeps_raising_fails_unattributed_and_later_steps_do_not(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    fail_sampling_for(engine, "bad")
    survivor, bad = random_prompts(2, [20, 18], seed=4)
    reference = make_engine(tiny_llama_dir[0])
    expected = reference.generate([survivor], GREEDY)[0].token_ids
    # "bad" enters as a remote-prefilled request: its first forward is a decode step, alone.
    engine.add_prefilled("bad", bad, 5, OVERFLOW)
    engine.kv_ready("bad")
    with pytest.raises(StepFailed) as info:
        engine.step()  # run once more alone, it raises again: nothing pins the fault on it
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
