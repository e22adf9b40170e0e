"""One sequence's fault is its own: a fault the sampler can pin on one row (its grammar
rejects its tokens, its logits are NaN) ends that sequence alone with finish reason "error"
and a typed error naming the field, and every other sequence of the step goes on bitwise as
if the faulty one had never been in the batch. A step that raises is run again in parts
at once (``pdserve.engine.core.step_isolation``): a fault that does not come back costs nothing,
and one that does is pinned on the row it belongs to."""


from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import fail_sampling_for, make_engine, nan_logits_for, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run_to_end(engine, tokens: dict[str, list[int]] | None = None, steps: int | None = None
               ) -> tuple[dict[str, list[int]], dict]:
    """Every request's tokens (added to ``tokens``), and each one's last output; ``steps``:
    stop after that many steps."""
    tokens = {} if tokens is None else tokens
    last = {}
    while engine.has_unfinished() and steps != 0:
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            last[o.request_id] = o
        steps = None if steps is None else steps - 1
    return tokens, last


def solo(model_dir, prompts: dict[str, list[int]], tokenizer=None) -> dict[str, list[int]]:
    """What the good requests produce with nothing else in their batches."""
    reference = make_engine(model_dir, tokenizer=tokenizer, policy="mixed")
    outs = reference.generate(list(prompts.values()), GREEDY)
    return {rid: out.token_ids for rid, out in zip(prompts, outs)}


def test_a_grammar_fault_ends_its_own_request_and_the_others_run_as_if_it_was_never_there(tool_llama):
    """The issue's trigger: ``resumed_tokens`` claims the prompt's last two tokens ("hello"'s
    letters) were output under the regex [0-9]+, so the matcher rejects them at the first
    draw. Its prompt chunk shares a step with two decoding streams (mixed schedule)."""
    directory, tok = tool_llama
    goods = {"a": tok.encode("The weather today is"), "b": tok.encode("Once upon a time")}
    expected = solo(directory, goods, tok)
    engine = make_engine(directory, tokenizer=tok, policy="mixed")
    for rid, prompt in goods.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens, _ = run_to_end(engine, steps=3)
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput(GrammarKind.REGEX, "[0-9]+", resumed_tokens=2))
    engine.add_request("bad", tok.encode("say hello"), bad)
    # Two more ordinary requests after it: the fault must not cost them either.
    engine.add_request("c", tok.encode("Give me JSON:"), GREEDY)
    tokens, last = run_to_end(engine, tokens)
    expected_c = solo(directory, {"c": tok.encode("Give me JSON:")}, tok)["c"]
    assert last["bad"].finished and last["bad"].finish_reason == "error"
    assert tokens["bad"] == []
    assert isinstance(last["bad"].error, SequenceFailed)
    assert last["bad"].error.field == "structured_output" and "grammar" in str(last["bad"].error)
    assert engine.num_free_blocks == 256
    assert {rid: tokens[rid] for rid in ("a", "b", "c")} == {**expected, "c": expected_c}


def test_a_nan_row_ends_its_own_request_and_the_batch_keeps_its_tokens(tiny_llama_dir):
    directory = tiny_llama_dir[0]
    prompts = dict(zip("abc", random_prompts(3, [20, 33, 17], seed=8)))
    expected = solo(directory, prompts)
    engine = make_engine(directory, policy="mixed")
    nan_logits_for(engine, "nan")
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens, _ = run_to_end(engine, steps=2)
    engine.add_request("nan", random_prompts(1, [25], seed=9)[0], GREEDY)
    tokens, last = run_to_end(engine, tokens)
    assert last["nan"].finish_reason == "error" and last["nan"].error.field == "logits"
    assert {rid: tokens[rid] for rid in prompts} == expected
    assert engine.num_free_blocks == 256


def test_a_fault_that_does_not_come_back_costs_nothing(tiny_llama_dir):
    """The sampler raises once for the whole step (nothing names a row): the step's
    sequences run again in parts at once, and their output is what it would have been."""
    directory = tiny_llama_dir[0]
    prompts = dict(zip("ab", random_prompts(2, [20, 30], seed=3)))
    expected = solo(directory, prompts)
    engine = make_engine(directory, policy="mixed")
    fail_sampling_for(engine, "a", times=1)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens, last = run_to_end(engine)
    assert tokens == expected and {o.finish_reason for o in last.values()} == {"length"}
    assert engine.num_free_blocks == 256


def test_a_fault_that_persists_is_pinned_on_its_row(tiny_llama_dir):
    directory = tiny_llama_dir[0]
    engine = make_engine(directory, policy="mixed")
    fail_sampling_for(engine, "bad")
    good, bad = random_prompts(2, [20, 30], seed=3)
    expected = solo(directory, {"good": good})
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, GREEDY)
    tokens, last = run_to_end(engine)
    assert last["bad"].finish_reason == "error" and last["bad"].error.field == "step" and tokens["bad"] == []
    assert {"good": tokens["good"]} == expected
    assert not engine.has_unfinished() and engine.num_free_blocks == 256
