"""The draft-model proposer: a small model of the target's vocabulary guesses the next ``k``
tokens of each sequence, run beside the target on the same device with a paged KV cache of its
own (pdserve/engine/spec/draft_model.py loads it and sizes the cache).

One ``propose(seqs, k)`` is ``k`` batched forwards of the draft through the engine's own runner
and attention backends:

1. catch up: each sequence runs the tokens whose draft KV is missing, all sequences in one
   prefill-like step of varied query lengths. The first time that is the whole prompt (on a
   decode worker the target's prompt KV came from the prefill pool; the draft's is built here,
   from the prompt's tokens); later, the tokens the target kept since the last call (its
   accepted guesses and its own next token). The step's last row per sequence gives guess 1.
   The step runs at most ``catch_up_tokens`` tokens (the target's step budget,
   ``max_num_batched_tokens``): a sequence past what is left catches up on a chunk and guesses
   nothing this call, so a long prompt never stalls the target's decode step by more than a
   draft step of that budget.
2. ``k - 1`` single-token steps, each running the previous guess and giving the next.

A greedy request (temperature 0) takes the draft's argmax and returns no probabilities; a
sampled one draws from the draft's softmax at the request's temperature and returns those rows,
(k, vocab) float32 on the draft's device, for rejection sampling. A seeded request draws from a
generator seeded by its seed and the position guessed, so its guesses do not depend on the batch
or on what the draft computed before.

Stale state: the sequence's tokens are the truth. The draft remembers the tokens it ran (its
guesses included); each call keeps its KV only for their common prefix with the sequence's
tokens (the target rejected the rest), at most all but the newest token, whose logits it needs.

A sequence the cache cannot hold gets an empty proposal (the target decodes it one token a
step), after the least recently proposed sequences outside the call were evicted to make room.

Where the draft's KV comes from (issue 57: built from the transferred prompt on the decode
worker, or transferred from the prefill pool too). Built. A draft of 2 of SmolLM2-135M's 30
layers catches a prompt up at 8% of the target's prefill cost per token (0.22 against 2.9 ms,
bfloat16, one CPU thread: benchmarks/spec_draft.py catch-up), once per request and at most one
step budget a step. Transferring it would not remove that work but move it: every prefill worker
would load and run the draft too, register a second cache with its transfer agents, and every
lease would carry and checksum a second set of blocks (docs/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from pdserve.engine.attention.kv_cache import cache_spec_of
from pdserve.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.device import to_device
from pdserve.engine.cuda_graphs import capture_sizes
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.spec.draft_model import DraftModel, DraftRunner, draft_cache_blocks, load_draft
from pdserve.engine.spec.proposer import Proposal

_DRAFT_PARAMS = SamplingParams()  # what the runner reads of a draft row: no prompt logprobs
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seeds


@dataclass(eq=False)
class _Tracked:
    """What the draft holds of one sequence: ``view`` is the draft's own ``Sequence`` (its
    tokens: the target's as last seen, then its guesses; ``num_computed_tokens``: those whose
    draft KV is in its cache), ``last_used`` the call that last proposed for it."""

    view: Sequence
    last_used: int = 0


@dataclass(eq=False)
class _Row:
    """One sequence proposing in this call."""

    index: int  # in the call's ``seqs``
    tracked: _Tracked
    params: SamplingParams
    k: int  # guesses it may make (fewer than the call's k near the end of the context)
    chunk: int  # tokens its catch-up runs; short of all it lacks: no guess this call
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftProposer:
    """``Proposer`` over a draft model (module docstring). ``num_blocks``: its cache's size;
    ``catch_up_tokens``: the most tokens one call's catch-up step runs."""

    def __init__(self, draft: DraftModel, num_blocks: int, block_size: int, attention_backend: str = "auto",
                 seed: int = 0, graph_sizes: tuple[int, ...] = (), catch_up_tokens: int = 2048):
        if catch_up_tokens < 1:
            raise ValueError(f"catch_up_tokens must be at least 1, got {catch_up_tokens}")
        self.catch_up_tokens = catch_up_tokens
        self.cfg = draft.cfg
        self.max_model_len = draft.max_model_len
        model = draft.model
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        cache = cache_spec_of(draft.cfg, block_size, dtype).allocate(num_blocks, device)
        # No prefix cache: the draft's blocks are never shared, so nothing needs marking final.
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache=False)
        self.runner = DraftRunner(model, draft.cfg, cache, self.blocks, attention_backend, seed, graph_sizes,
                                  self.max_model_len)
        self.device = device
        self._shared = torch.Generator().manual_seed(seed)  # unseeded requests' draws (host, as the sampler's)
        self._tracked: dict[str, _Tracked] = {}
        self._calls = 0

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, engine_config: EngineConfig, model_cfg: ModelConfig
                    ) -> "DraftProposer":
        """Load ``spec.model`` beside the target of ``model_cfg`` (refused by name when its
        vocabulary or family does not fit, draft_model.load_draft) with a cache sized by
        ``draft_model.draft_cache_blocks``."""
        draft = load_draft(spec, engine_config, model_cfg)
        num_blocks = draft_cache_blocks(spec, engine_config, model_cfg, draft.max_model_len)
        speculating = min(engine_config.scheduler.max_num_seqs, spec.disable_by_batch_size)
        graphs = capture_sizes(speculating) if engine_config.cuda_graphs else ()
        return cls(draft, num_blocks, engine_config.cache.block_size, engine_config.attention_backend,
                   engine_config.seed, graphs, engine_config.scheduler.max_num_batched_tokens)

    # ---- Proposer ------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` guesses per sequence (module docstring); empty where the draft's context
        or cache has no room for it."""
        self._calls += 1
        proposals = [Proposal([]) for _ in seqs]
        if k < 1 or not seqs:
            return proposals
        batch = {seq.seq_id for seq in seqs}
        rows, budget = [], self.catch_up_tokens
        for i, seq in enumerate(seqs):
            row_k = min(k, self.max_model_len - seq.num_tokens)  # no guess past the context's end
            if row_k < 1 or budget < 1:
                continue
            tracked = self._sync(seq)
            if self._reserve(seq.seq_id, seq.num_tokens + row_k - 1, batch):
                tracked.last_used = self._calls
                chunk = min(budget, seq.num_tokens - tracked.view.num_computed_tokens)
                budget -= chunk
                rows.append(_Row(i, tracked, seq.params, row_k, chunk))
        self._run(rows)
        for row in rows:
            probs = torch.stack(row.probs) if row.probs else None
            proposals[row.index] = Proposal(row.tokens, probs)
        return proposals

    def forget(self, seq_id: str) -> None:
        """Free the draft's blocks of ``seq_id`` and what it knew of it."""
        if self._tracked.pop(seq_id, None) is not None:
            self.blocks.free(seq_id)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    # ---- state ---------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> _Tracked:
        """The draft's view of ``seq`` brought to its tokens: KV kept for the common prefix of
        what the draft ran and ``seq.token_ids``, short of the newest token."""
        truth = seq.token_ids
        tracked = self._tracked.get(seq.seq_id)
        if tracked is None:
            view = Sequence(seq.seq_id, list(truth), _DRAFT_PARAMS, num_prompt_tokens=seq.num_prompt_tokens)
            tracked = self._tracked[seq.seq_id] = _Tracked(view)
            return tracked
        view = tracked.view
        kept = min(view.num_computed_tokens, len(truth) - 1)
        mine = view.token_ids
        if mine[:kept] != truth[:kept]:
            kept = next(i for i, (a, b) in enumerate(zip(mine, truth)) if a != b)
        del mine[kept:]
        mine.extend(truth[kept:])
        view.num_computed_tokens = kept
        return tracked

    def _reserve(self, seq_id: str, num_tokens: int, batch: set[str]) -> bool:
        """Slots for ``num_tokens`` of ``seq_id``, evicting the least recently proposed
        sequences outside ``batch`` while the free blocks fall short; False when even that
        leaves too few (nothing of ``seq_id``'s changes then)."""
        table = self.blocks.block_table(seq_id) if self.blocks.has(seq_id) else []
        missing = self.blocks.blocks_needed(num_tokens) - len(table)
        if missing > self.blocks.num_free_blocks:
            idle = sorted((t.last_used, sid) for sid, t in self._tracked.items() if sid not in batch)
            for _, victim in idle:
                if missing <= self.blocks.num_free_blocks:
                    break
                self.forget(victim)
        if missing > self.blocks.num_free_blocks:
            return False
        if not self.blocks.has(seq_id):
            self.blocks.allocate(seq_id, (), use_prefix_cache=False)
        return self.blocks.append_slots(seq_id, range(num_tokens))

    # ---- the draft's steps ---------------------------------------------------------
    def _run(self, rows: list[_Row]) -> None:
        """The catch-up step, then single-token steps until every row has its guesses."""
        if not rows:
            return
        step = [ScheduledSeq(r.tracked.view, r.chunk, r.tracked.view.num_computed_tokens + r.chunk ==
                             r.tracked.view.num_tokens) for r in rows]
        prefill = any(item.num_new_tokens > 1 for item in step)  # else a decode step (graphs replay it)
        logits = self.runner.logits(SchedulerOutput(step, is_prefill=prefill))
        for row in rows:
            row.tracked.view.num_computed_tokens += row.chunk
        rows = [r for r, item in zip(rows, step) if item.sample]  # the caught-up ones guess
        while rows:
            self._draw(logits, rows)
            for row in rows:
                row.tracked.view.token_ids.append(row.tokens[-1])
            rows = [r for r in rows if len(r.tokens) < r.k]
            if rows:
                step = [ScheduledSeq(r.tracked.view, 1, True) for r in rows]
                logits = self.runner.logits(SchedulerOutput(step, is_prefill=False))
                for row in rows:
                    row.tracked.view.num_computed_tokens += 1

    def _draw(self, logits: torch.Tensor, rows: list[_Row]) -> None:
        """Each row's next guess from its logits row (S, V): the argmax when greedy, else a
        draw from the softmax at its temperature (inverse CDF of one uniform, as the engine's
        sampler draws), whose row is kept with the guess."""
        greedy = [r.params.greedy for r in rows]
        picked = logits.argmax(dim=-1)
        probs = None
        if not all(greedy):
            temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)])
            u = torch.cat([torch.zeros(1) if g else torch.rand(1, generator=self._generator(r))
                           for r, g in zip(rows, greedy)])
            temps, u, is_greedy = to_device([temps, u, torch.tensor(greedy)], logits.device)
            probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)  # (S, V)
            cdf = probs.cumsum(dim=-1)
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
            drawn.clamp_(max=probs.shape[-1] - 1)
            picked = torch.where(is_greedy, picked, drawn)
        for i, (row, token) in enumerate(zip(rows, picked.tolist())):
            row.tokens.append(token)
            if not greedy[i]:
                row.probs.append(probs[i])

    def _generator(self, row: _Row) -> torch.Generator:
        """A seeded request's generator for the position it guesses now; else the shared one."""
        if row.params.seed is None:
            return self._shared
        position = row.tracked.view.num_tokens
        return torch.Generator().manual_seed((row.params.seed * _SEED_MIX + position) % (1 << 63))
