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

  For a deterministic proposal (q all on x) the rule is run as a coupling: row i draws its token
  from p as the sampler would, with one uniform, and the guess is kept when the draw is the
  guess. That keeps x with probability p(x), and a draw that is not x follows p without x,
  renormalized: the rule's own distribution. And a seeded request then draws one uniform per
  token it emits, as without speculation: its generator is put back after the step and advanced
  by the tokens kept, so its tokens do not depend on how many guesses a step made, nor on its
  batch company (the promise of ``SamplingParams.seed``), given the same logits.

Draws come from the request's own generator when it has a seed. Every operation is row-wise and
the results come back to the host in one copy.
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
    accept, token, seeded = guess == argmax, argmax, {}
    if not all(r.params.greedy for r in rows):
        drawn_accept, drawn, seeded = _rejection_rows(sampler, logits, rows, items, guess)
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
    for seq_id, (gen, state) in seeded.items():  # one uniform per token kept, as without guesses
        gen.set_state(state)
        for _ in kept.get(seq_id, ()):
            torch.rand(1, generator=gen)
    return kept, failed


def _rejection_rows(sampler: Sampler, logits: torch.Tensor, rows: list[SamplerRow], items: list[ScheduledSeq],
                    guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """For every row (R,): whether its guess is kept by the rejection rule, and the token drawn
    were it the first rejected (from normalize(max(p - q, 0))) or the last row (from p); and the
    generators of the seeded deterministic proposals, by seq id, with their states before."""
    p = sampler.probs(logits, rows)  # (R, V)
    q = torch.zeros_like(p)  # the last row of an item has no guess: q = 0 there, and it draws from p
    uniforms, coupled, seeded, start = [], [], {}, 0
    for item in items:
        k = len(item.draft_token_ids)
        row = rows[start]
        if row.params.greedy:
            uniforms.append(torch.zeros(2 * (k + 1)))  # unused
        elif item.draft.probs is not None:  # two uniforms a row: to accept, to draw
            q[start:start + k] = item.draft.probs.to(device=p.device, dtype=p.dtype)
            uniforms.append(sampler.uniforms(row, 2 * (k + 1)))
        else:  # one uniform a row, drawn as the sampler draws them (a row at a time)
            gen = sampler.generator(row)
            if row.params.seed is not None:
                seeded[row.seq_id] = (gen, gen.get_state())
            u = torch.cat([torch.rand(1, generator=gen) for _ in range(k + 1)])
            uniforms.append(torch.stack([u, torch.zeros(k + 1)], dim=1).flatten())
            coupled += [True] * (k + 1)
            start += k + 1
            continue
        coupled += [False] * (k + 1)
        start += k + 1
    # Every host-built input goes to the device in one copy.
    u, coupled = to_device([torch.cat(uniforms).view(-1, 2), torch.tensor(coupled)], p.device)
    index = guess.clamp(min=0).unsqueeze(1)
    p_x, q_x = p.gather(1, index).squeeze(1), q.gather(1, index).squeeze(1)
    accept = (guess >= 0) & (u[:, 0] * q_x < p_x)  # u < p(x) / q(x), without dividing by a zero q(x)
    residual = (p - q).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: no rejection can happen
    drawn = _inverse_cdf(residual, u[:, 1])
    plain = _inverse_cdf(p, u[:, 0])  # the coupled rows' draws, as the sampler makes them
    return torch.where(coupled, plain == guess, accept), torch.where(coupled, plain, drawn), seeded


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (R, V) for the uniforms ``u`` (R,), as the sampler draws:
    right=True, so a token of no mass is never drawn, even for a draw of exactly 0."""
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)
