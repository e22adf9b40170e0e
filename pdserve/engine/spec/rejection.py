"""Verification: which of a sequence's guesses the target keeps, and the token that follows.

One forward ran each speculating sequence's newest token and its ``k`` guesses, so the target's
logits are known at 1 + k positions: row i scores the token after guess i (row 0: after the
newest token). Rows are read in order:

- greedy (temperature 0): guess i is kept while it equals the target's argmax at row i; at the
  first that does not (or after all k), the target's argmax at that row is the next token. The
  tokens are exactly those of decoding one at a time.
- sampled: with p the target's distribution at row i after the request's temperature and
  top-k / top-p / min-p (the sampler's own processing, ``Sampler.probs``) and q the proposal's
  (its ``probs``, or all the mass on the guess for a deterministic proposer), guess x is kept with
  probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
  normalize(max(p - q, 0)); after all k kept, a bonus token is drawn from p at row k. Each token
  so made follows p exactly (Leviathan et al., Chen et al. 2023), whatever q is.

Draws come from the request's own generator when it has a seed (``Sampler.uniforms``). Every
operation is row-wise and the results come back to the host in one copy.
"""

from __future__ import annotations

import torch

from pdserve.engine.core.scheduler import ScheduledSeq
from pdserve.engine.device import to_device, to_host
from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.sampler import Sampler, SamplerRow


def verify(sampler: Sampler, logits: torch.Tensor, items: list[ScheduledSeq]
           ) -> tuple[dict[str, list[int]], dict[str, SequenceFailed]]:
    """logits (R, V) float32, 1 + k rows per item in order (k: its guesses) -> (per item, by seq
    id, the tokens it keeps: its accepted guesses, then the target's token; the items whose
    logits leave nothing to draw, which keep nothing)."""
    rows: list[SamplerRow] = []
    guesses: list[int] = []  # per row: the guess it checks, -1 on an item's last row
    for item in items:
        seq = item.seq
        rows += [SamplerRow(seq.seq_id, seq.params, seq.token_ids, seq.num_prompt_tokens)] * (len(item.draft_token_ids) + 1)
        guesses += [*item.draft_token_ids, -1]
    usable = logits.amax(dim=-1) > float("-inf")  # NaN fails too
    argmax = logits.max(dim=-1).indices  # (R,): the first maximum, as the sampler's greedy rows take
    [guess] = to_device([torch.tensor(guesses, dtype=torch.long)], logits.device)
    accept, token = guess == argmax, argmax
    if not all(r.params.greedy for r in rows):
        drawn_accept, drawn = _rejection_rows(sampler, logits, rows, items, guess)
        [greedy] = to_device([torch.tensor([r.params.greedy for r in rows])], logits.device)
        accept = torch.where(greedy, accept, drawn_accept)
        token = torch.where(greedy, token, drawn)
    accept, token, usable = (t.tolist() for t in to_host([accept, token, usable]))
    kept: dict[str, list[int]] = {}
    failed: dict[str, SequenceFailed] = {}
    start = 0
    for item in items:
        k = len(item.draft_token_ids)
        seq_id = item.seq.seq_id
        if not all(usable[start:start + k + 1]):
            failed[seq_id] = SequenceFailed(seq_id, "logits", "no token can be drawn: this sequence's logits are "
                                            "NaN or every token is forbidden")
        else:
            n = next((i for i in range(k) if not accept[start + i]), k)  # guesses kept
            kept[seq_id] = [*item.draft_token_ids[:n], token[start + n]]
        start += k + 1
    return kept, failed


def _rejection_rows(sampler: Sampler, logits: torch.Tensor, rows: list[SamplerRow], items: list[ScheduledSeq],
                    guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every row (R,): whether its guess is kept by the rejection rule, and the token drawn
    were it the first rejected (from normalize(max(p - q, 0))) or the last row (from p)."""
    p = sampler.probs(logits, rows)  # (R, V)
    q = torch.zeros_like(p)  # the last row of an item has no guess: q = 0 there, and it draws from p
    point_rows, point_ids, start = [], [], 0
    for item in items:
        k = len(item.draft_token_ids)
        if item.draft.probs is not None:
            q[start:start + k] = item.draft.probs.to(device=p.device, dtype=p.dtype)
        else:
            point_rows += range(start, start + k)
            point_ids += item.draft_token_ids
        start += k + 1
    # Two uniforms per row (greedy rows: unused zeros), from each request's generator: one to
    # accept, one to draw. Every host-built input goes to the device in one copy.
    u = torch.cat([torch.zeros(2) if r.params.greedy else sampler.uniforms(r, 2) for r in rows]).view(-1, 2)
    u, point_rows, point_ids = to_device([u, torch.tensor(point_rows, dtype=torch.long),
                                          torch.tensor(point_ids, dtype=torch.long)], p.device)
    q[point_rows, point_ids] = 1.0
    index = guess.clamp(min=0).unsqueeze(1)
    p_x, q_x = p.gather(1, index).squeeze(1), q.gather(1, index).squeeze(1)
    accept = (guess >= 0) & (u[:, 0] * q_x < p_x)  # u < p(x) / q(x), without dividing by a zero q(x)
    residual = (p - q).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: no rejection can happen
    cdf = residual.cumsum(dim=-1)
    # right=True: the first index whose cdf passes the draw, so a token of no mass is never drawn.
    drawn = torch.searchsorted(cdf, (u[:, 1] * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return accept, drawn.clamp_(max=p.shape[-1] - 1)
