"""Logprobs of the prompt's own tokens (OpenAI's ``echo`` with ``logprobs``; lm-eval's
loglikelihood): position i's logits score prompt token i + 1.

Computed in the prefill steps that run the prompt, chunk by chunk, from the hidden states
the forward already produced: extra ``compute_logits`` over the chunk's rows, only for
sequences that asked (``SamplingParams.prompt_logprobs``). A sequence recomputed after a
preemption keeps the entries it has.

The logits go ``SLICE_BYTES`` at a time: a 2,048-token chunk over the default model's
49,152-token vocabulary is 400 MB of float32 logits and as much again for their log-softmax,
which one request could make a worker allocate every step. Each row is computed alone of the
others (row-wise), so slices give the same numbers as the whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling.sampler import top_logprobs
from pdserve.engine.sampling.params import TopLogprobs

if TYPE_CHECKING:
    from pdserve.engine.core.scheduler import SchedulerOutput

PromptLogprob = tuple[float, TopLogprobs]  # the prompt token's logprob, and the best alternatives
SLICE_BYTES = 32 << 20  # float32 logits computed at once (their log-softmax takes as much again)


def prompt_logprobs(model, hidden: torch.Tensor, out: "SchedulerOutput") -> dict[str, list[PromptLogprob]]:
    """hidden (T, H), the step's packed rows -> per sequence that asked, the entries for the
    prompt tokens this chunk predicts (in order, continuing ``seq.prompt_logprobs``)."""
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
                result[seq.seq_id] = _scored(model, hidden[offset + first: offset + last], targets, k)
        offset += n
    return result


def _scored(model, hidden: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """hidden (m, H) -> for each row, ``targets[row]``'s logprob and the ``k`` best, computed
    a slice of rows at a time (``SLICE_BYTES`` of logits)."""
    rows = max(1, SLICE_BYTES // (4 * model.cfg.vocab_size))
    entries: list[PromptLogprob] = []
    for lo in range(0, hidden.shape[0], rows):
        logits = model.compute_logits(hidden[lo:lo + rows])  # (r, V) float32
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits
        chosen_ids = torch.tensor(targets[lo:lo + rows], device=logprobs.device)
        chosen = logprobs.gather(1, chosen_ids.view(-1, 1)).squeeze(1).tolist()
        entries += zip(chosen, top_logprobs(logprobs, [k] * len(chosen)))
    return entries
