"""What the engine hands out: one step's output for one request (``RequestOutput``, a diff),
and a whole finished request (``Completion``, from ``LLMEngine.generate``, which
``run_to_completion`` assembles from the diffs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tqdm import tqdm

from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.params import TopLogprobs
from pdserve.engine.core.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a diff, not the whole state)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # "" when the engine does not detokenize (workers: the router does)
    new_logprobs: list[float]
    finished: bool  # no later step produces output for it (finished, or HELD)
    finish_reason: str | None  # None with ``finished``: HELD, generation goes on elsewhere
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # with params.top_logprobs
    # On a request's first output, with params.prompt_logprobs: prompt tokens 1..n-1.
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None
    # With finish_reason "error": the request's own fault that ended it (no token with it).
    error: SequenceFailed | None = None


def token_output(seq: Sequence, text: str, num_new: int = 1) -> RequestOutput:
    """``seq``'s output for the ``num_new`` tokens its step just added (its last; more than one
    when it speculated), with ``text`` decoded for them."""
    logprobs, first = seq.params.logprobs, seq.num_output_tokens == num_new
    return RequestOutput(
        seq.seq_id, seq.token_ids[-num_new:], text, seq.output_logprobs[-num_new:] if logprobs else [],
        seq.is_done_here, seq.finish_reason.value if seq.finish_reason else None, seq.num_prompt_tokens,
        seq.num_output_tokens, seq.num_cached_tokens, seq.output_top_logprobs[-num_new:] if logprobs else [],
        list(seq.prompt_logprobs) if first and seq.params.prompt_logprobs is not None else None)


def error_output(seq: Sequence, error: SequenceFailed) -> RequestOutput:
    """``seq``'s last output when its own fault ended it: no token, finish reason "error"."""
    return RequestOutput(seq.seq_id, [], "", [], True, FinishReason.ERROR.value, seq.num_prompt_tokens,
                         seq.num_output_tokens, seq.num_cached_tokens, error=error)


@dataclass
class Completion:
    """A finished request, as ``generate`` returns it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None
    finish_reason: str | None = None

    def add(self, o: RequestOutput) -> None:
        """Append one step's output of this request (``RequestOutput`` is a diff)."""
        self.token_ids += o.new_token_ids
        self.text += o.new_text
        self.logprobs += o.new_logprobs
        self.top_logprobs += o.new_top_logprobs
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        if o.finished:
            self.finish_reason = o.finish_reason


def generate_all(add_request: Callable, step: Callable[[], list[RequestOutput]], prompts, params,
                 progress: bool = False) -> list[Completion]:
    """``LLMEngine.generate``: queue each prompt (with its own params, or ``params`` for all)
    through ``add_request`` and ``step`` until all are done; completions in prompt order."""
    prompts = list(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids = [f"gen-{i}" for i in range(len(prompts))]
    for request_id, p, sp in zip(ids, prompts, plist):
        add_request(request_id, p, sp)
    return run_to_completion(step, ids, progress)


def run_to_completion(step: Callable[[], list[RequestOutput]], request_ids: list[str],
                      progress: bool = False) -> list[Completion]:
    """Call ``step`` until every one of ``request_ids`` has finished; their completions, in order."""
    done = {request_id: Completion(request_id) for request_id in request_ids}
    pending = set(done)
    with tqdm(total=len(done), desc="generate", disable=not progress) as bar:
        while pending:
            for o in step():
                if o.request_id in done:
                    done[o.request_id].add(o)
                if o.finished and o.request_id in pending:
                    pending.discard(o.request_id)
                    bar.update(1)
    return [done[request_id] for request_id in request_ids]
