"""How many prompt tokens a mixed step may take while streams decode in it, sized from a time
budget rather than fixed: Sarathi-Serve's chunk, derived from the TPOT objective.

A worker that prefills beside its streams (colocated, a mixed elastic worker, a decode worker
computing a conversation's suffix) stalls every stream for as long as its step's prompt chunk
takes. A fixed chunk is right on one processor only: 32 tokens cost about 40 ms on one core
of an AVX-512 EPYC and a fraction of a millisecond on a GPU. So the chunk is what fits the
target step time (``SchedulerConfig.mixed_step_target_s``, by default half the TPOT objective:
``pdserve serve`` sets it) given what steps have cost on this worker so far:

    chunk = max((target - decode_s - fixed_s) / token_s, fixed_s / token_s)

- ``decode_s``: a step's cost with the current decode rows and no prompt, an exponentially
  weighted mean of the decode-only steps (a handful of rows cost about one weight read on a
  CPU, so it moves slowly with the batch);
- ``token_s`` and ``fixed_s``: what a step with prompt tokens costs beyond ``decode_s``, fitted
  as ``fixed_s + token_s * tokens`` by a weighted least-squares line over the steps seen (mixed
  ones, and prompt-only ones once ``decode_s`` is known). ``fixed_s`` is what carrying any prompt
  costs at all: near 0 on a CPU, where every step runs eagerly, but on a GPU a decode step
  replays a CUDA graph while a step with prompt tokens launches its kernels one by one (8B on an
  H200, BENCHMARKS.md run 8: decode-only steps p50 7.3 ms, mixed steps of 16 prompt tokens p50
  35.8 ms, where the tokens themselves cost about 0.6 ms). Charged to the tokens, that fixed
  part made a token look like 1.8 ms, so a decode worker prefilled 16 tokens an eager step. The
  line needs steps of different sizes (their weighted deviation at least ``MIN_SAMPLE_TOKENS``).
  Until it is first fitted, ``fixed_s`` is 0, ``token_s`` the weighted mean of (step seconds -
  ``decode_s``) / prompt tokens, and every ``PROBE_EVERY``-th mixed step the next chunk is twice
  the size, so that sizes spread; later, while they do not spread, ``fixed_s`` stays as last
  fitted and ``token_s`` is the slope from it through the steps' mean. Before any mixed step, a
  prompt-only step's seconds per token (a little high: it includes the weight read).
- The second term amortizes: a chunk is never so small that the fixed part costs more than its
  tokens, since every extra step pays it again (with no fixed part, chunks of any size stall the
  streams for the same total time, and the smaller ones stall them least at a time).

The chunk never falls below ``floor_tokens``, so prompts progress however slow decode is,
and it is ``start_tokens`` until both costs exist. Pure arithmetic over the timings the engine
feeds in (``observe``); tests feed hand-made ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Steps with fewer prompt tokens than this say little about a token's cost (timer noise and
# the attention's fixed part dominate), so they do not move ``token_s``.
MIN_SAMPLE_TOKENS = 8
# While the line cannot be fitted, one chunk in this many is doubled, so that step sizes spread.
PROBE_EVERY = 4


@dataclass
class StepBudget:
    target_s: float  # the time a step with decode rows should take, prompt chunk included
    floor_tokens: int = 16  # the least chunk: prompts progress even when decode alone takes the target
    start_tokens: int = 32  # the chunk until both means have samples
    weight: float = 0.2  # the newest sample's weight in each mean
    decode_s: float | None = None
    token_s: float | None = None
    fixed_s: float = 0.0
    _ratio_s: float | None = field(default=None, repr=False)  # the mean of excess seconds / tokens
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  # weighted 1, x, y, xx, xy
    _unfitted: int = field(default=0, repr=False)  # mixed steps seen before the line could first be fitted
    _ever_fitted: bool = field(default=False, repr=False)

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
            excess = None if self.decode_s is None else max(seconds - self.decode_s, 0.0)
            if excess is not None:
                self._fit_sample(prompt_tokens, excess)
            if decode_rows and excess is not None:
                self._ratio_s = self._mean(self._ratio_s, excess / prompt_tokens)
                self._unfitted = 0 if self._ever_fitted or self._fitted() else self._unfitted + 1
            elif not decode_rows and self._ratio_s is None:
                self._ratio_s = seconds / prompt_tokens
            self._refit()

    def _fit_sample(self, x: float, y: float) -> None:
        keep = 1.0 - self.weight
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] = self._sums[i] * keep + self.weight * v

    def _spread(self) -> float:
        """The weighted variance of the prompt tokens of the steps fitted."""
        w, wx, _, wxx, _ = self._sums
        return wxx / w - (wx / w) ** 2 if w > 0 else 0.0

    def _fitted(self) -> bool:
        return self._spread() >= MIN_SAMPLE_TOKENS ** 2

    def _refit(self) -> None:
        """The line through the steps seen where their sizes spread; where they do not (a
        worker's chunks are mostly one size), the last fitted ``fixed_s`` with the slope through
        the steps' weighted mean; before any fit, the mean ratio."""
        w, wx, wy, _, wxy = self._sums
        if self._ratio_s is None:
            return
        if self._fitted():
            slope = (wxy / w - (wx / w) * (wy / w)) / self._spread()
            if slope > 0:
                self.token_s, self.fixed_s, self._ever_fitted = slope, max(wy / w - slope * wx / w, 0.0), True
                return
        if self._ever_fitted and wx > 0:
            self.token_s = max(wy / w - self.fixed_s, 0.0) / (wx / w)
        else:
            self.token_s, self.fixed_s = self._ratio_s, 0.0

    def chunk(self) -> int:
        """Prompt tokens the next step with decode rows may take."""
        if self.decode_s is None or self.token_s is None:
            return self.start_tokens
        if self.token_s <= 0:
            return 1 << 30  # free tokens: the token budget is the only bound
        fits = (self.target_s - self.decode_s - self.fixed_s) / self.token_s
        chunk = max(self.floor_tokens, int(max(fits, self.fixed_s / self.token_s) + 1e-6))  # not 39.999 for 40
        probe = self._unfitted and self._unfitted % PROBE_EVERY == 0
        return 2 * chunk if probe else chunk

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
        return (self.decode_s + self.fixed_s) / chunk + self.token_s

    def _mean(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.weight * (sample - old)
