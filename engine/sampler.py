"""Turns the last-position logits of each sequence into its next token.

Order of operations (as in transformers): repetition penalty on the raw logits, then
temperature, then top-k, top-p and min-p filters, then a draw. Greedy rows take the argmax
of the penalised logits. A request with a seed draws from its own ``torch.Generator``, so
its output does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class SamplerRow:
    seq_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (for the repetition penalty)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's generator."""
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[list[int], list[float] | None]:
        """logits (B, V) float32 -> B token ids, and their logprobs if any row asked."""
        want_logprobs = any(r.params.logprobs for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            logits = self._apply_repetition_penalty(logits.clone(), rows)
        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, raw_logprobs.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()

    def _apply_repetition_penalty(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            p = r.params.repetition_penalty
            if p == 1.0:
                continue
            ids = torch.tensor(sorted(set(r.token_ids)), device=logits.device, dtype=torch.long)
            seen = logits[i, ids]
            logits[i, ids] = torch.where(seen < 0, seen * p, seen / p)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        # Greedy rows (temperature below the epsilon) take the argmax: scale them by 1, not 1/0.
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        scaled = _filter(scaled, rows)
        probs = torch.softmax(scaled, dim=-1)
        out = logits.argmax(dim=-1)  # greedy rows keep their argmax
        for i, r in enumerate(rows):
            if r.params.greedy:
                continue
            out[i] = torch.multinomial(probs[i], 1, generator=self._generator(r)).squeeze()
        return out

    def _generator(self, row: SamplerRow) -> torch.Generator:
        if row.params.seed is None:
            return self._shared
        gen = self._generators.get(row.seq_id)
        if gen is None:
            gen = self._generators[row.seq_id] = torch.Generator(device=self.device).manual_seed(row.params.seed)
        return gen


def _filter(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """Mask out tokens that top-k, top-p or min-p exclude (per row; disabled rows untouched)."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0 for m in min_p):
        return logits
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
    remove |= torch.arange(vocab, device=dev).unsqueeze(0) >= k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    p = torch.tensor(top_p, device=dev)
    # Drop a token when the tokens before it already cover top_p; the first always stays.
    remove |= (sorted_probs.cumsum(-1) - sorted_probs) > p.unsqueeze(1)
    m = torch.tensor(min_p, device=dev)
    remove |= sorted_probs < (m.unsqueeze(1) * sorted_probs[:, :1])
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)
