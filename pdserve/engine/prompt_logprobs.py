"""Logprobs of the prompt's own tokens (OpenAI's ``echo`` with ``logprobs``; lm-eval's
loglikelihood): position i's logits score prompt token i + 1.

Computed in the prefill steps that run the prompt, chunk by chunk, from the hidden states
the forward already produced: one extra ``compute_logits`` over the chunk's rows, only for
sequences that asked (``SamplingParams.prompt_logprobs``). A sequence recomputed after a
preemption keeps the entries it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampler import top_logprobs
from pdserve.engine.sampling import TopLogprobs

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput

PromptLogprob = tuple[float, TopLogprobs]  # the prompt token's logprob, and the best alternatives


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
                logits = model.compute_logits(hidden[offset + first: offset + last])  # (m, V) float32
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                targets = torch.tensor(seq.token_ids[start + first + 1: start + last + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets.view(-1, 1)).squeeze(1).tolist()
                tops = top_logprobs(logprobs, [k] * len(chosen))
                result[seq.seq_id] = list(zip(chosen, tops))
        offset += n
    return result
