"""Logprobs of the prompt's own tokens (OpenAI's ``echo`` with ``logprobs``; lm-eval's
loglikelihood): position i's logits score prompt token i + 1.

Computed in the prefill steps that run the prompt, chunk by chunk, from the hidden states
the forward already produced: extra logits over the chunk's rows, only for sequences that
asked (``SamplingParams.prompt_logprobs``). A sequence recomputed after a preemption keeps the
entries it has. The caller computes them (``RowLogits``): in a tensor-parallel worker every
rank takes part in each call (pdserve/engine/runner/model_runner.py).

The logits go ``SLICE_BYTES`` at a time: a 2,048-token chunk over the default model's
49,152-token vocabulary is 400 MB of float32 logits and as much again for their log-softmax,
which one request could make a worker allocate every step. Each row is computed alone of the
others (row-wise), so slices give the same numbers as the whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pdserve.engine.sampling.sampler import top_logprobs
from pdserve.engine.sampling.params import TopLogprobs

if TYPE_CHECKING:
    from pdserve.engine.core.scheduler import SchedulerOutput

PromptLogprob = tuple[float, TopLogprobs]  # the prompt token's logprob, and the best alternatives
SLICE_BYTES = 32 << 20  # float32 logits computed at once (their log-softmax takes as much again)
# (start, stop) -> the logits (stop - start, V) float32 of rows [start, stop) of the step's packed rows.
RowLogits = Callable[[int, int], torch.Tensor]


def prompt_logprobs(logits: RowLogits, vocab_size: int, out: "SchedulerOutput") -> dict[str, list[PromptLogprob]]:
    """The step's packed rows' logits (``logits``) -> per sequence that asked, the entries for
    the prompt tokens this chunk predicts (in order, continuing ``seq.prompt_logprobs``)."""
    result: dict[str, list[PromptLogprob]] = {}
    if not out.is_prefill or all(item.seq.params.prompt_logprobs is None for item in out.seqs):
        return result
    offset = 0
    for item in out.seqs:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens  # row j scores token start + j + 1
        k = seq.params.prompt_logprobs
        if k is not None:
            first = max(0, len(seq.prompt_logprobs) - start)  # already have these (recompute)
            last = min(n, seq.num_prompt_tokens - 1 - start)  # rows that score a prompt token
            if last > first:
                targets = seq.token_ids[start + first + 1: start + last + 1]
                result[seq.seq_id] = _scored(logits, vocab_size, offset + first, offset + last, targets, k)
        offset += n
    return result


def _scored(logits: RowLogits, vocab_size: int, start: int, stop: int, targets: list[int],
            k: int) -> list[PromptLogprob]:
    """Rows [start, stop) -> for each row, ``targets[row - start]``'s logprob and the ``k`` best,
    computed a slice of rows at a time (``SLICE_BYTES`` of logits)."""
    rows = max(1, SLICE_BYTES // (4 * vocab_size))
    entries: list[PromptLogprob] = []
    for lo in range(start, stop, rows):
        hi = min(stop, lo + rows)
        logprobs = torch.log_softmax(logits(lo, hi).float(), dim=-1)  # (r, V)
        chosen_ids = torch.tensor(targets[lo - start:hi - start], device=logprobs.device)
        chosen = logprobs.gather(1, chosen_ids.view(-1, 1)).squeeze(1).tolist()
        entries += zip(chosen, top_logprobs(logprobs, [k] * len(chosen)))
    return entries
