"""Turns the last-position logits of each sequence into its next token.

Order of operations (as in vLLM): the grammar mask of rows with structured output
(``pdserve.engine.sampling.grammar``), then ``min_tokens`` bans, ``logit_bias`` and the repetition,
frequency and presence penalties (``pdserve.engine.sampling.penalties``), then temperature, then top-k,
top-p and min-p filters, then a draw. Greedy rows take the argmax of the processed logits.
Logprobs (the chosen token's and the top alternatives) are of the model's distribution
before the penalties and filters, as vLLM reports them by default; for a constrained row
that is after the grammar mask, as vLLM applies it to the logits before its sampler. A
request with a seed draws from its own ``torch.Generator``, so its output does not depend
on what else is in the batch.

Devices: every tensor the sampler hands a kernel is on the logits' device (a CUDA step
never mixes in a host tensor; xgrammar and torch refuse that, issue 26). The generators
stay on the host on every device: each drawn row takes one uniform from its generator, the
step's draws go to the device in one copy with its temperatures and filter limits, and a
seeded request draws the same numbers on a CPU and on a GPU (on CUDA, a generator per device
would launch a kernel per row). Grammar masks, penalties and the choice between greedy and
drawn rows reach the device the same way, as tensors built on the host and copied without
waiting (``pdserve.engine.device.to_device``); nothing indexes a device tensor with a Python
list. The results come back in one device-to-host copy (``DeviceSample.to_host``): the
step's one host sync, whatever its mix of penalties, grammars, logprobs and greedy and drawn
rows (tests/engine/test_one_sync.py counts it).

A fault that belongs to one row (its grammar rejects its tokens or cannot fill its mask,
its penalties raise, its processed logits are NaN or forbid every token) drops that row
and is reported in ``SamplerOutput.failed``: the other rows are computed exactly as in a
batch without it (row-wise operations only, and the shared generator never draws for it).
Grammar and penalty faults are known on the host before anything is drawn. Whether a row's
logits leave anything to draw is a flag a row computed on the device, which comes back with
the step's results in the one copy; when a row turns out unusable, the generators are put
back as they were before the step and the other rows are drawn again without it, a second
copy back in that rare step only.

A call that raises takes nothing from the generators: each one's state from before its first
draw of the call is put back. The engine runs a step that raised again in parts
(``pdserve.engine.core.step_isolation``), and a seeded request must still draw once per token.
Grammar matchers need no such care: they catch up from the sequence's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.engine.device import to_device, to_host
from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarMatcher, allow_only, apply_bitmask, token_bitmask
from pdserve.engine.sampling.penalties import apply_penalties
from pdserve.engine.sampling.params import SamplingParams, TopLogprobs


@dataclass(frozen=True)
class SamplerRow:
    seq_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (for the penalties)
    num_prompt_tokens: int = 0  # token_ids[num_prompt_tokens:] is output (frequency / presence)


class SamplerOutput(NamedTuple):
    """Per row that did not fail, in row order; ``failed``: the rows that did, by seq id."""

    token_ids: list[int]
    logprobs: list[float] | None  # None unless a row asked for logprobs
    top_logprobs: list[TopLogprobs] | None  # per row, () where the row asked for none
    failed: dict[str, SequenceFailed] = {}


class DeviceSample(NamedTuple):
    """One step's choices on the device: tokens (B,) int64; ``usable`` (B,) bool, whether a
    row's processed logits left anything to draw; with logprobs, the chosen tokens' (B,) and
    the best ``max(ks)`` alternatives (B, k), values and ids."""

    tokens: torch.Tensor
    usable: torch.Tensor
    chosen: torch.Tensor | None = None
    ks: list[int] | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self, pack: bool | None = None) -> tuple[SamplerOutput, list[bool]]:
        """The lists the engine hands out, and each row's ``usable`` flag, in one copy off the
        CPU (``pdserve.engine.device.to_host``; ``pack`` as there)."""
        parts = [t for t in (self.tokens, self.usable, self.chosen, self.top_values, self.top_ids) if t is not None]
        tokens, usable, *rest = (t.tolist() for t in to_host(parts, pack))
        if self.chosen is None:
            return SamplerOutput(tokens, None, None), usable
        if self.top_values is None:
            return SamplerOutput(tokens, rest[0], [()] * len(self.ks)), usable
        chosen, values, ids = rest
        tops = [tuple(zip(ids[i][:n], values[i][:n])) for i, n in enumerate(self.ks)]
        return SamplerOutput(tokens, chosen, tops), usable


def top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> list[TopLogprobs]:
    """logprobs (B, V) -> per row its ``ks[i]`` best (token id, logprob) pairs."""
    k = max(ks, default=0)
    if k == 0:
        return [()] * len(ks)
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [tuple(zip(ids[i][:n], values[i][:n])) for i, n in enumerate(ks)]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._shared = torch.Generator().manual_seed(seed)  # host generators: see the module docstring
        self._generators: dict[str, torch.Generator] = {}
        # Banned until ``min_tokens`` are out (besides stop_token_ids); the engine sets them.
        self.eos_token_ids: frozenset[int] = frozenset()
        # The engine attaches each constrained sequence's matcher (``attach``), its grammar
        # compiled off the engine thread. Without one, a row compiles its spec here with
        # ``grammars`` (callers that use the sampler alone set it), or fails.
        self.grammars: GrammarCompiler | None = None
        self._matchers: dict[str, GrammarMatcher] = {}
        # In a call: each generator it drew from, with its state before the call's first draw.
        self._drawn: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None

    def attach(self, seq_id: str, compiled, resumed_tokens: int = 0) -> None:
        """Constrain ``seq_id`` by ``compiled`` (an ``xgrammar.CompiledGrammar``) from now on."""
        self._matchers[seq_id] = GrammarMatcher(compiled, resumed_tokens)

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's generator and grammar matcher."""
        self._generators.pop(seq_id, None)
        self._matchers.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerOutput:
        """logits (B, V) float32 -> a token id for each row that did not fail, and their
        logprobs if any row asked. If it raises, the generators are as they were."""
        self._drawn = {}
        try:
            return self._sample_rows(logits, rows)
        except BaseException:
            for gen, state in self._drawn.values():
                gen.set_state(state)
            raise
        finally:
            self._drawn = None

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerOutput:
        failed: dict[str, SequenceFailed] = {}
        logits, raw = self._process(logits, rows, failed)
        logits, raw, rows = _without(logits, raw, rows, failed)
        if not rows:
            return SamplerOutput([], None, None, failed)
        output, usable = self.pick(logits, rows, raw).to_host()
        if not all(usable):  # rare: the other rows draw again, as if these had not been there
            for r, ok in zip(rows, usable):
                if not ok:
                    failed[r.seq_id] = SequenceFailed(r.seq_id, "logits", "no token can be drawn: this sequence's "
                                                      "logits are NaN or every token is forbidden")
            self._rewind()
            logits, raw, rows = _without(logits, raw, rows, failed)
            if not rows:
                return SamplerOutput([], None, None, failed)
            output, _ = self.pick(logits, rows, raw).to_host()
        return output._replace(failed=failed) if failed else output

    def _rewind(self) -> None:
        """Put every generator the call drew from back as it was before the call's first draw."""
        for gen, state in self._drawn.values():
            gen.set_state(state)
        self._drawn.clear()

    def pick(self, logits: torch.Tensor, rows: list[SamplerRow], raw: torch.Tensor | None = None) -> "DeviceSample":
        """The step's choices from ``logits`` (B, V) after the grammar masks and penalties
        (``raw``: before the penalties, for logprobs; None: ``logits`` themselves, the
        grammars and penalties then applied here), still on the logits' device."""
        if raw is None:
            logits, raw = self._process(logits, rows)
        # NaN (a forward that overflowed for this row) and -inf everywhere both fail ``> -inf``;
        # amax propagates NaN, as max's values do.
        usable = logits.amax(dim=-1) > float("-inf")
        want_logprobs = any(r.params.logprobs for r in rows)
        raw_logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None
        if all(r.params.greedy for r in rows):
            # max's indices are argmax's (the first maximum), at a third of its time on CPU
            # (0.36 vs 1.0 ms for 16 x 49152 logits, one thread).
            tokens = logits.max(dim=-1).indices
        else:
            tokens = self._sample(logits, rows)
        if raw_logprobs is None:
            return DeviceSample(tokens, usable)
        chosen = raw_logprobs.gather(1, tokens.view(-1, 1)).squeeze(1)
        ks = [r.params.top_logprobs if r.params.logprobs else 0 for r in rows]
        k = max(ks)
        top = raw_logprobs.topk(k, dim=-1) if k else None
        return DeviceSample(tokens, usable, chosen, ks, top.values if top else None, top.indices if top else None)

    def _process(self, logits: torch.Tensor, rows: list[SamplerRow],
                 failed: dict[str, SequenceFailed] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(processed, raw): the grammar masks applied in place to ``logits`` (raw), then the
        penalties on a copy (processed). Rows that fail go to ``failed`` (none given: raise)."""
        if any(r.params.structured is not None for r in rows):
            self._constrain(logits, rows, failed)
        if any(r.params.penalised for r in rows):
            return apply_penalties(logits.clone(), rows, self.eos_token_ids, failed), logits
        return logits, logits

    def _constrain(self, logits: torch.Tensor, rows: list[SamplerRow],
                   failed: dict[str, SequenceFailed] | None = None) -> None:
        """Mask, in place, what each constrained row's grammar forbids; other rows stay
        bit-identical (batch invariance). The grammars fill one host bitmask for the step,
        each its own row (a finished grammar: its stop tokens only), which goes to the
        logits' device in one copy with the rows filled and is applied in one call. A row
        whose grammar raises (catching up, filling its row) goes to ``failed`` (with none
        given, the error propagates)."""
        stops = sorted(self.eos_token_ids)
        bitmask = token_bitmask(len(rows), logits.shape[-1])
        masked: list[int] = []
        for i, r in enumerate(rows):
            if r.params.structured is None:
                continue
            try:
                matcher = self._matcher(r)
                matcher.advance(r.token_ids, r.num_prompt_tokens)
                if matcher.finished:
                    if not stops:  # nothing known to stop with: the row stays as it is
                        continue
                    allow_only(bitmask, i, stops)
                else:
                    matcher.fill(bitmask, i)
                masked.append(i)
            except Exception as exc:  # this row's grammar: its fault alone
                if failed is None:
                    raise
                failed[r.seq_id] = SequenceFailed(r.seq_id, "structured_output", f"{type(exc).__name__}: {exc}")
        if masked:
            apply_bitmask(logits, bitmask, masked)

    def _matcher(self, row: SamplerRow) -> GrammarMatcher:
        matcher = self._matchers.get(row.seq_id)
        if matcher is None:
            if self.grammars is None:
                raise RuntimeError("no grammar was compiled for this request")
            matcher = self._matchers[row.seq_id] = self.grammars.matcher(row.params.structured)
        return matcher

    def _sample(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        # Greedy rows (temperature below the epsilon) take the argmax: scale them by 1, not 1/0.
        temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)])
        # Inverse CDF: one uniform per drawn row (from the row's own generator when it is
        # seeded), then the first token whose cumulative probability passes it: one cumsum and
        # one search for the batch (torch.multinomial took 1.5 ms a row over a 49k vocabulary).
        # float32 sums move each token's probability by at most about 1e-7. A greedy row draws
        # nothing (0 stands in) and keeps its argmax, chosen on the device by a mask.
        u = torch.cat([torch.zeros(1) if g else torch.rand(1, generator=self._generator(r))
                       for r, g in zip(rows, greedy)])  # (B,)
        limits = _filter_limits(rows, logits.shape[-1])
        mixed = any(greedy)
        # The step's per-row values go to the device in one copy; on CPU nothing moves.
        temps, u, *limits = to_device([temps, u, *limits, *([torch.tensor(greedy)] if mixed else [])],
                                      logits.device)
        is_greedy = limits.pop() if mixed else None
        probs = _processed_probs(logits, temps, limits)
        cdf = probs.cumsum(dim=-1)  # (B, V): row-wise, so a row's values do not depend on the others
        # right=True: the first index whose cdf exceeds the draw, so a zero-probability token
        # (filtered out) is never chosen, even for a draw of exactly 0.
        picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        picked.clamp_(max=probs.shape[-1] - 1)
        if not mixed:
            return picked
        return torch.where(is_greedy, logits.argmax(dim=-1), picked)  # greedy rows keep their argmax

    def probs(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        """logits (B, V) -> (B, V) float32: the distribution each row draws from (its temperature,
        then its top-k, top-p and min-p; a greedy row at temperature 1). No grammar or penalty:
        for rows that have none (speculative verification, ``pdserve.engine.spec.rejection``)."""
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows])
        temps, *limits = to_device([temps, *_filter_limits(rows, logits.shape[-1])], logits.device)
        return _processed_probs(logits, temps, limits)

    def uniforms(self, row: SamplerRow, n: int) -> torch.Tensor:
        """(n,) uniform draws in [0, 1) on the host, from ``row``'s generator (``generator``)."""
        return torch.rand(n, generator=self._generator(row))

    def generator(self, row: SamplerRow) -> torch.Generator:
        """The host generator ``row`` draws from: its own when it has a seed, else the shared one.
        A step draws one ``torch.rand(1)`` from it per token it samples for the row."""
        return self._generator(row)

    def _generator(self, row: SamplerRow) -> torch.Generator:
        """The generator ``row`` draws from; in a call, its state is kept before the first draw."""
        if row.params.seed is None:
            gen = self._shared
        else:
            gen = self._generators.get(row.seq_id)
            if gen is None:
                gen = self._generators[row.seq_id] = torch.Generator().manual_seed(row.params.seed)
        if self._drawn is not None and id(gen) not in self._drawn:
            self._drawn[id(gen)] = (gen, gen.get_state())
        return gen


def _without(logits: torch.Tensor, raw: torch.Tensor, rows: list[SamplerRow], failed: dict[str, SequenceFailed]
             ) -> tuple[torch.Tensor, torch.Tensor, list[SamplerRow]]:
    """The step without its failed rows: their logits rows left out on the device (the
    kept rows' indices go there in one copy that nothing waits for)."""
    keep = [i for i, r in enumerate(rows) if r.seq_id not in failed]
    if len(keep) == len(rows):
        return logits, raw, rows
    [index] = to_device([torch.tensor(keep, dtype=torch.long)], logits.device)
    kept = logits.index_select(0, index)
    return kept, kept if raw is logits else raw.index_select(0, index), [rows[i] for i in keep]


def _processed_probs(logits: torch.Tensor, temps: torch.Tensor, limits: list[torch.Tensor]) -> torch.Tensor:
    """Softmax of ``logits`` (B, V) over the temperatures ``temps`` (B,), with the filters of
    ``limits`` (``_filter``'s k, p, m; none: no filter), all on the logits' device."""
    scaled = logits / temps.unsqueeze(1)
    if limits:
        scaled = _filter(scaled, *limits)
    return torch.softmax(scaled, dim=-1)


def _filter_limits(rows: list[SamplerRow], vocab: int) -> list[torch.Tensor]:
    """Host (B,) top-k, top-p and min-p per row, or none when no row filters."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0 for m in min_p):
        return []
    return [torch.tensor([k if k > 0 else vocab for k in top_k]), torch.tensor(top_p), torch.tensor(min_p)]


def _filter(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mask out tokens that top-k (k), top-p (p) or min-p (m), each (B,) on the logits'
    device, exclude; a row's disabled filters keep every token."""
    vocab = logits.shape[-1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    remove |= torch.arange(vocab, device=dev).unsqueeze(0) >= k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token when the tokens before it already cover top_p; the first always stays.
    remove |= (sorted_probs.cumsum(-1) - sorted_probs) > p.unsqueeze(1)
    remove |= sorted_probs < (m.unsqueeze(1) * sorted_probs[:, :1])
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)
