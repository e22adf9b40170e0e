"""Driving an ``LLMEngine`` step by step: requests that join a running batch (``run_staggered``),
one request run to its end (``run``), or every request (``drain``)."""

from __future__ import annotations

from pdserve.engine.sampling.params import SamplingParams

LENGTHS = [1, 7, 16, 17, 40, 64, 90, 130, 200]  # prompt lengths across block (16) boundaries


def run_staggered(engine, prompts, params, join_every=3):
    """Add one request every ``join_every`` steps so requests join a running batch."""
    outs = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        for o in engine.step():
            outs[int(o.request_id)] += o.new_token_ids
        step += 1
    return [outs[i] for i in range(len(prompts))]


def run(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Add a request and step until it finishes: its tokens and its ``cached_tokens``."""
    engine.add_request(request_id, prompt, params)
    return drain(engine, until=request_id)[request_id]


def drain(engine, until: str | None = None) -> dict[str, tuple[list[int], int]]:
    """Step until ``until`` finishes, or else until nothing can run; each request's tokens
    and ``cached_tokens``."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    done: set[str] = set()
    while (until not in done) if until else engine.has_runnable():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                done.add(out.request_id)
    return {rid: (tokens[rid], cached[rid]) for rid in tokens}
