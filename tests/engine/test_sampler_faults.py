"""The sampler's faults are one row's: a grammar that cannot fill its row of the step's mask
fails that row alone (the mask was once filled and applied outside the per-row guard, so one
request's grammar failed the whole step), and a call that raises after it drew gives every
draw back, so a step run again (``pdserve.engine.core.step_isolation``) draws a seeded request's
token once."""

import json

import pytest
import torch

from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarKind, StructuredOutput
from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.sampling.params import SamplingParams

SCHEMA = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
CONSTRAINED = SamplingParams(structured=SCHEMA)


@pytest.fixture(scope="module")
def compiled(tool_llama):
    return GrammarCompiler(tool_llama[1].hf, 49152, [2]).compile(SCHEMA)


def constrained_sampler(compiled, *seq_ids: str) -> Sampler:
    sampler = Sampler(torch.device("cpu"))
    sampler.eos_token_ids = frozenset({2})
    for seq_id in seq_ids:
        sampler.attach(seq_id, compiled)
    return sampler


def test_a_grammar_that_cannot_fill_its_mask_fails_its_row_alone(compiled):
    """Injected: "bad"'s matcher raises as it fills its row of the mask."""
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    rows = [SamplerRow("json", CONSTRAINED, [5, 6], 2), SamplerRow("bad", CONSTRAINED, [5, 6], 2),
            SamplerRow("free", SamplingParams(), [5, 6], 2)]
    alone = constrained_sampler(compiled, "json")(logits[[0, 2]].clone(), [rows[0], rows[2]])
    sampler = constrained_sampler(compiled, "json", "bad")

    def fill(bitmask, row):
        raise RuntimeError("injected: the matcher cannot fill its mask")

    sampler._matchers["bad"].fill = fill
    out = sampler(logits.clone(), rows)
    assert set(out.failed) == {"bad"} and out.failed["bad"].field == "structured_output"
    assert "cannot fill" in str(out.failed["bad"])
    assert out.token_ids == alone.token_ids


def test_a_call_that_raises_after_drawing_gives_the_draws_back():
    rows = [SamplerRow("seeded", SamplingParams(temperature=1.0, seed=11), [1], 1),
            SamplerRow("shared", SamplingParams(temperature=1.0), [1], 1)]
    logits = torch.zeros(2, 4096)  # uniform: every draw lands on a different token
    expected = Sampler(torch.device("cpu"), seed=3)(logits.clone(), rows).token_ids
    sampler = Sampler(torch.device("cpu"), seed=3)
    pick = sampler.pick

    def pick_then_raise(*args):
        pick(*args)  # every row draws
        raise RuntimeError("injected: a device error at the copy back")

    sampler.pick = pick_then_raise
    with pytest.raises(RuntimeError, match="injected"):
        sampler(logits.clone(), rows)
    del sampler.pick
    assert sampler(logits.clone(), rows).token_ids == expected
