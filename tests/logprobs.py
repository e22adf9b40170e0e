"""Closeness of two greedy generations the way vLLM measures it (``check_logprobs_close``).

Two implementations whose kernels round differently (pdserve's bfloat16 kernels against
``transformers`` in float32) cannot be compared token for token: a near tie may break
either way, and after that the continuations differ. The standard is: up to the first
differing token the outputs agree, and at that position each side's token is among the
other side's top-k log-probabilities (so the difference is a near tie, not a wrong model).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

TOP_K = 5


@dataclass(frozen=True)
class Generation:
    """A greedy generation and, per position, the top-k token ids of its distribution."""

    token_ids: list[int]
    top_ids: list[set[int]]


def check_logprobs_close(a: list[Generation], b: list[Generation], name_a: str, name_b: str) -> int:
    """Assert ``a`` and ``b`` are close by vLLM's standard; return how many agree exactly."""
    assert len(a) == len(b), f"{name_a} has {len(a)} generations, {name_b} {len(b)}"
    exact = 0
    for i, (ga, gb) in enumerate(zip(a, b)):
        for pos, (ta, tb) in enumerate(zip(ga.token_ids, gb.token_ids)):
            if ta == tb:
                continue
            assert ta in gb.top_ids[pos], f"prompt {i}, position {pos}: {name_a}'s {ta} not in {name_b}'s top {TOP_K}"
            assert tb in ga.top_ids[pos], f"prompt {i}, position {pos}: {name_b}'s {tb} not in {name_a}'s top {TOP_K}"
            break
        else:
            exact += ga.token_ids == gb.token_ids
    return exact


def top_ids(logits: torch.Tensor) -> set[int]:
    """(V,) logits -> the ids of the TOP_K largest (log-softmax keeps the order)."""
    return set(logits.float().topk(TOP_K).indices.tolist())


def hf_generation(model, prompt: list[int], max_new_tokens: int) -> Generation:
    """transformers' greedy ``generate`` with the logits of every step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return Generation(out.sequences[0, len(prompt):].tolist(), [top_ids(step[0]) for step in out.logits])


@contextmanager
def recording_logits(engine):
    """Record the top-k ids of every row of logits the engine's model computes.

    Wraps the model instance's ``compute_logits`` (observing it, not changing its output);
    with one request at a time, the list holds one entry per generated token.
    """
    model = engine.runner.model
    seen: list[set[int]] = []
    original = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.extend(top_ids(row) for row in logits)
        return logits

    model.compute_logits = compute_logits
    try:
        yield seen
    finally:
        del model.compute_logits


def engine_generation(engine, prompt: list[int], params) -> Generation:
    """The engine's greedy generation of ``prompt``, alone, with per-step top-k ids."""
    with recording_logits(engine) as seen:
        out = engine.generate([prompt], params)[0]
    return Generation(out.token_ids, seen[: len(out.token_ids)])
