"""How many prompt tokens a mixed step may take while streams decode in it, sized from a time
budget rather than fixed: Sarathi-Serve's chunk, derived from the TPOT objective.

A worker that prefills beside its streams (colocated, a mixed elastic worker, a decode worker
computing a conversation's suffix) stalls every stream for as long as its step's prompt chunk
takes. A fixed chunk is right on one processor only: 32 tokens cost about 40 ms on one core
of an AVX-512 EPYC and a fraction of a millisecond on a GPU. So the chunk is what fits the
target step time (``SchedulerConfig.mixed_step_target_s``, by default half the TPOT objective:
``pdserve serve`` sets it) given what steps have cost on this worker so far:

    chunk = (target - decode_s) / token_s

- ``decode_s``: a step's cost with the current decode rows and no prompt, an exponentially
  weighted mean of the decode-only steps (a handful of rows cost about one weight read on a
  CPU, so it moves slowly with the batch);
- ``token_s``: what a prompt token adds to a step, the weighted mean over mixed steps of
  (step seconds - ``decode_s``) / prompt tokens; before any mixed step, a prompt-only step's
  seconds per token (a little high: it includes the weight read).

The chunk never falls below ``floor_tokens``, so prompts progress however slow decode is,
and it is ``start_tokens`` until both means exist. Pure arithmetic over the timings the engine
feeds in (``observe``); tests feed hand-made ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Steps with fewer prompt tokens than this say little about a token's cost (timer noise and
# the attention's fixed part dominate), so they do not move ``token_s``.
MIN_SAMPLE_TOKENS = 8


@dataclass
class StepBudget:
    target_s: float  # the time a step with decode rows should take, prompt chunk included
    floor_tokens: int = 16  # the least chunk: prompts progress even when decode alone takes the target
    start_tokens: int = 32  # the chunk until both means have samples
    weight: float = 0.2  # the newest sample's weight in each mean
    decode_s: float | None = None
    token_s: float | None = None

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"mixed_step_target_s must be above 0, got {self.target_s!r}")
        if self.floor_tokens < 1 or self.start_tokens < self.floor_tokens:
            raise ValueError(f"need 1 <= floor_tokens <= start_tokens, got {self.floor_tokens}, {self.start_tokens}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's shape and its wall time (the model's forward and sampling)."""
        if seconds <= 0 or not math.isfinite(seconds) or decode_rows + prompt_tokens == 0:
            return
        if prompt_tokens == 0:
            self.decode_s = self._mean(self.decode_s, seconds)
        elif prompt_tokens >= MIN_SAMPLE_TOKENS:
            if decode_rows and self.decode_s is not None:
                self.token_s = self._mean(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)
            elif not decode_rows and self.token_s is None:
                self.token_s = seconds / prompt_tokens

    def chunk(self) -> int:
        """Prompt tokens the next step with decode rows may take."""
        if self.decode_s is None or self.token_s is None:
            return self.start_tokens
        if self.token_s <= 0:
            return 1 << 30  # free tokens: the token budget is the only bound
        return max(self.floor_tokens, int((self.target_s - self.decode_s) / self.token_s))

    def prompt_token_s(self) -> float | None:
        """Wall seconds a prompt token costs this worker when it prefills beside its streams:
        a step of its decode rows plus ``chunk()`` prompt tokens, over the chunk, so the streams'
        share of each step is charged to the prompt too (what the router weighs a local prefill
        by, docs/routing.md#prefill-that-keeps-up). Near ``target_s / chunk``, and more when the
        chunk sits at its floor because decode alone nearly fills the target. An upper bound:
        with no stream running, a prompt takes whole steps at prefill speed. None until both
        means exist."""
        if self.decode_s is None or self.token_s is None:
            return None
        chunk = self.chunk()
        return self.decode_s / chunk + self.token_s

    def _mean(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.weight * (sample - old)
