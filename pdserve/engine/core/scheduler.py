"""Continuous-batching scheduler: which sequences run in the next forward, and how much.

Two policies (``SchedulerConfig.policy``):

- ``prefill_first`` (as in nano-vllm): if waiting sequences fit, the next step prefills
  them, packing prompts of different lengths up to the token budget and chunking a prompt
  longer than what is left of the budget; otherwise every running sequence decodes one
  token. Right for a prefill worker, whose sequences never decode.
- ``mixed`` (chunked prefill mixed into decode batches, as vLLM and SGLang run): every
  running sequence decodes one token, and prefill chunks fill what is left of the token
  budget in the same step. A worker that both prefills and decodes (colocated mode, a decode
  worker prefilling locally or recomputing a preempted sequence) so never stops its streams
  for a whole prompt: a step costs at most one budget's worth of prompt tokens.

When a decoding sequence needs a block and none is free, a running sequence is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(prefix-cache hits make that cheap) and resumed later. The victim is the one that may still
grow the most (tokens left before its max_tokens or the context's end), the youngest among
equals. So a request without a limit (the OpenAI chat default: the rest of the context) is
preempted before limited ones, and however far it runs it cannot push them out; with equal
limits the rule is vLLM's, youngest first. The same rule makes room for a request whose KV
arrives from a prefill worker (``add_remote_prefilled``): it preempts running sequences that
may grow more than the newcomer, so requests without a limit filling a decode worker cannot
keep a limited one out (the router admits it on those blocks: pdserve/router/policy.py).

With LoRA (``lora``, docs/lora.md), a step holds at most ``max_loras`` distinct adapters (the
device has that many slots; the base model needs none). A waiting prompt whose adapter would be
one too many stays waiting, and the prompts behind it may go first; running sequences of
adapters past the limit (their KV arrived from another worker) sit the step out, and are first
in line the step after.

With a KV tier that reads ahead (docs/kv_tier.md: next to a GPU), a prompt added is read ahead
from the tier (``BlockManager.prefetch``) off the engine thread; while the reads go on and other
sequences run, it stays waiting as a prompt over the adapter limit does, so their step never waits on
files (for at most ``KVTier.read_ahead_wait_s``; then its ``allocate`` loads what is left).

Pure Python; tests feed it hand-built outputs through ``update_from_output``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Callable

from pdserve.engine.core.block_hashes import kv_salt
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import MIXED, LoRAConfig, SchedulerConfig
from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.params import TopLogprobs
from pdserve.engine.core.sequence import FinishReason, Sequence, SeqStatus
from pdserve.engine.core.step_budget import StepBudget


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to run through the model this step
    sample: bool  # whether this step produces the sequence's next token
    # Speculation: a ``pdserve.engine.spec.proposer.Proposal`` whose guesses run after the newest
    # token (``num_new_tokens`` is 1 + their number) and are verified from its logits. None: none.
    draft: Any = None

    @property
    def draft_token_ids(self) -> list[int]:
        return self.draft.token_ids if self.draft is not None else []


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    is_prefill: bool  # some sequence runs prompt tokens (in a mixed step, beside decode rows)
    preempted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SampledTokens:
    """What the model runner gives back for one step: the next token of each sampled sequence."""

    token_ids: dict[str, int]
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, TopLogprobs] = field(default_factory=dict)
    # Per sequence with ``prompt_logprobs``: entries for the prompt tokens this step scored.
    prompt_logprobs: dict[str, list[tuple[float, TopLogprobs]]] = field(default_factory=dict)
    # Sequences whose own fault ended them this step (no token): the engine finishes them
    # with FinishReason.ERROR before ``update_from_output``.
    failed: dict[str, SequenceFailed] = field(default_factory=dict)
    # Speculating sequences: the guesses verification kept, which come before ``token_ids``'.
    accepted: dict[str, list[int]] = field(default_factory=dict)


# Speculation's hook: given the sequences a step decodes, the guesses (``ScheduledSeq.draft``) of
# those that speculate, by seq id.
Propose = Callable[[list[Sequence]], dict[str, Any]]


class Scheduler:
    """Owns the waiting and running queues; the block manager owns the blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), lora: LoRAConfig | None = None):
        self.config = config
        self.max_adapters = None if lora is None else lora.max_loras  # distinct adapters in one step
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Prompts the running step computes to their end: out of ``waiting``, not yet running
        # (a worker's stats count their tokens as still to compute, pdserve.shell.stats).
        self.stepping: list[Sequence] = []
        start = max(StepBudget.floor_tokens, config.mixed_prefill_tokens or StepBudget.start_tokens)
        self.step_budget = (StepBudget(config.mixed_step_target_s, start_tokens=start)
                            if config.policy == MIXED and config.mixed_step_target_s > 0 else None)

    # ---- admission -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.blocks.check_fits(seq.num_tokens + 1)
        self.waiting.append(seq)
        if seq.params.prompt_logprobs is None:  # its blocks may come from the KV tier: read them ahead
            self.blocks.prefetch(seq.seq_id, seq.token_ids, kv_salt(seq.params, seq.lora_fingerprint))

    def add_remote_prefilled(self, seq: Sequence, reuse_cached: bool = False) -> list[int]:
        """Allocate blocks for a prompt whose KV another worker computed.

        ``seq.token_ids`` is prompt + the first token. Returns the block ids to fill. With
        too few blocks free, running sequences that may grow more than ``seq`` are preempted
        first, by the rule a step preempts by (module docstring): the router counts the
        blocks of requests without a limit as room for one with a limit (pdserve/router/policy.py),
        and this is where that room is made.

        ``reuse_cached``: the leading blocks this worker's prefix cache holds (same salt) are
        taken as they are, final already, and only the rest need filling; how many tokens they
        cover is ``seq.num_cached_tokens``, always short of the block of the prompt's last token
        (``BlockManager.allocate``), so at least one block is left to read. Without it every
        block is fresh.
        """
        self.blocks.check_fits(seq.num_tokens + 1)
        self._make_room(seq, self.blocks.blocks_needed(len(seq.prompt_token_ids)))
        # The fresh blocks are PENDING until ``kv_ready``: findable once the pull has been verified.
        alloc = self.blocks.allocate(seq.seq_id, seq.prompt_token_ids, use_prefix_cache=reuse_cached,
                                     cache_salt=kv_salt(seq.params, seq.lora_fingerprint))
        seq.num_cached_tokens = alloc.num_cached_tokens
        seq.status = SeqStatus.WAITING_FOR_KV
        self.awaiting_kv[seq.seq_id] = seq
        return list(alloc.block_ids)

    def kv_ready(self, seq_id: str) -> None:
        """The prompt's KV has landed and was verified: the sequence joins the decode batch,
        and its full prompt blocks become findable (only now: a pull still in flight, or one
        that failed, leaves nothing a prefix lookup could find)."""
        seq = self.awaiting_kv.pop(seq_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.blocks.mark_final(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.awaiting_kv)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self, propose: Propose | None = None) -> SchedulerOutput:
        """The next step. ``propose``: asked for guesses for the sequences it decodes, once
        they are known (a step that only prefills asks nothing)."""
        self.stepping = []
        if self.config.policy == MIXED:
            return self._schedule_mixed(propose)
        prefill = self._schedule_prefill(self.config.max_num_batched_tokens)
        if prefill:
            return SchedulerOutput(prefill, is_prefill=True)
        return self._schedule_decode(propose)

    def _schedule_mixed(self, propose: Propose | None = None) -> SchedulerOutput:
        """Decode rows first (one token each), then prompt chunks in the rest of the budget.
        A step that had to preempt admits no prompt: the blocks it freed are for the running
        sequences, and a new prompt would only be preempted in turn."""
        decode = self._schedule_decode(propose)
        budget = self.config.max_num_batched_tokens - sum(item.num_new_tokens for item in decode.seqs)
        cap = self.step_budget.chunk() if self.step_budget else self.config.mixed_prefill_tokens
        if decode.seqs and cap:  # streams run in this step: keep it short
            budget = min(budget, cap)
        prefill = self._schedule_prefill(budget) if budget > 0 and not decode.preempted else []
        return SchedulerOutput(decode.seqs + prefill, is_prefill=bool(prefill), preempted=decode.preempted)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """What a step of ``out`` took to run, for the time-sized chunk (``step_budget``)."""
        if self.step_budget is not None:
            rows = sum(1 for item in out.seqs if item.num_new_tokens == 1 and item.seq.num_computed_tokens
                       == item.seq.num_tokens - 1)  # before update_from_output: a decode row's one token
            self.step_budget.observe(rows, sum(item.num_new_tokens for item in out.seqs) - rows, seconds)

    def _fits_adapters(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether ``seq`` may join a step whose adapters are ``adapters`` (module docstring)."""
        name = seq.params.lora_name
        return self.max_adapters is None or not name or name in adapters or len(adapters) < self.max_adapters

    def _schedule_prefill(self, budget: int) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        skipped: list[Sequence] = []  # waiting on an adapter slot: back at the head afterwards
        adapters = {s.params.lora_name for s in self.running if s.params.lora_name}
        while self.waiting and budget > 0 and len(self.running) + len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._fits_adapters(seq, adapters) or (
                    (self.running or batch) and not self.blocks.has(seq.seq_id) and self.blocks.tier_fetching(seq.seq_id)):
                skipped.append(self.waiting.popleft())  # an adapter slot, or its KV tier reads: a later step
                continue
            if not self.blocks.has(seq.seq_id):
                # Leave one block per running sequence so admitting this one does not
                # force an immediate preemption.
                if not self.blocks.can_allocate(seq.num_tokens, reserve=len(self.running)) and (
                    self.running or batch
                ):
                    break
                if not self.blocks.can_allocate(seq.num_tokens):
                    break
                # Prompt logprobs need every prompt position run: no prefix-cache hits. A
                # tail's block is taken: this step computes the rest of it.
                alloc = self.blocks.allocate(seq.seq_id, seq.token_ids,
                                             use_prefix_cache=seq.params.prompt_logprobs is None,
                                             cache_salt=kv_salt(seq.params, seq.lora_fingerprint), take_tail=True)
                seq.num_computed_tokens = seq.num_cached_tokens = alloc.num_cached_tokens
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                if batch:
                    break
                budget = remaining  # chunking off: a lone over-budget prompt runs whole
            n = min(remaining, budget)
            batch.append(ScheduledSeq(seq, n, sample=(n == remaining)))
            if seq.params.lora_name:
                adapters.add(seq.params.lora_name)
            budget -= n
            if n < remaining:
                break  # a chunked prompt stays at the head of the queue for the next step
            self.stepping.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _schedule_decode(self, propose: Propose | None = None) -> SchedulerOutput:
        """Every running sequence decodes, with its guesses (``propose``) when their slots fit
        without preempting anyone; else one token, preempting the most growing ones for room."""
        preempted: list[str] = []
        scheduled: list[Sequence] = []
        queue, sitting_out = self._adapter_split(self.running)
        drafts = propose(queue) if propose is not None and queue else {}
        while queue:
            seq = queue.pop(0)
            draft = drafts.get(seq.seq_id)
            if draft is not None and not self.blocks.append_slots(seq.seq_id, seq.token_ids, len(draft.token_ids)):
                drafts.pop(seq.seq_id)  # no room for its guesses: it decodes one token this step
            while not self.blocks.append_slots(seq.seq_id, seq.token_ids):
                # A victim already given its slot this step leaves the step: nothing ran yet.
                victim = max((*scheduled, *queue, seq), key=self._preemption_rank)
                if victim in scheduled:
                    scheduled.remove(victim)
                elif victim is not seq:
                    queue.remove(victim)
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
        self.running = sitting_out + scheduled
        items = [ScheduledSeq(s, 1 + len(d.token_ids), True, d) if (d := drafts.get(s.seq_id)) else ScheduledSeq(s, 1, True)
                 for s in scheduled]
        return SchedulerOutput(items, False, preempted)

    def _adapter_split(self, running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(the running sequences this step decodes, those that sit it out): the adapters of the
        first ``max_adapters`` distinct ones in running order, and the base model's, run."""
        if self.max_adapters is None:
            return list(running), []
        adapters: set[str] = set()
        runs, waits = [], []
        for seq in running:
            fits = self._fits_adapters(seq, adapters)
            (runs if fits else waits).append(seq)
            if fits and seq.params.lora_name:
                adapters.add(seq.params.lora_name)
        return runs, waits

    def _make_room(self, seq: Sequence, needed: int) -> None:
        """Preempt running sequences ranked above ``seq`` (they may grow more), highest
        first, until ``needed`` blocks are free or none is left to preempt."""
        rank = self._preemption_rank(seq)
        while self.blocks.num_free_blocks < needed:
            above = [s for s in self.running if self._preemption_rank(s) > rank]
            if not above:
                return  # the allocation then refuses it, as without this rule
            victim = max(above, key=self._preemption_rank)
            self.running.remove(victim)
            self._preempt(victim)

    def _preemption_rank(self, seq: Sequence) -> tuple[int, int]:
        """Highest is preempted first: tokens it may still add, then youth (module docstring)."""
        growth = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return growth, seq.arrival

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def hold(self, seq: Sequence) -> None:
        """Take a decoding ``seq`` out of the batch with its blocks kept (HELD), for another
        worker to read its KV and go on decoding it (``LLMEngine.hold_running``)."""
        self.running.remove(seq)
        seq.status = SeqStatus.HELD

    # ---- results -------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: SampledTokens) -> list[Sequence]:
        """Advance every scheduled sequence; return those that finished this step."""
        self.stepping = []
        finished: list[Sequence] = []
        for item in out.seqs:
            seq = item.seq
            if seq.is_done_here:  # aborted while its step ran
                continue
            seq.prompt_logprobs.extend(sampled.prompt_logprobs.get(seq.seq_id, ()))
            if item.draft is not None:
                reason = self._keep_verified(item, sampled)
            else:
                seq.num_computed_tokens += item.num_new_tokens
                # The step finished: the KV it wrote is final, and the blocks it filled shareable.
                self.blocks.mark_final(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
                if not item.sample:
                    continue
                token = sampled.token_ids[seq.seq_id]
                seq.token_ids.append(token)
                if seq.seq_id in sampled.logprobs:
                    seq.output_logprobs.append(sampled.logprobs[seq.seq_id])
                    seq.output_top_logprobs.append(sampled.top_logprobs.get(seq.seq_id, ()))
                reason = self._stop_reason(seq, token)
            if seq.hold_kv and reason is None:
                seq.status = SeqStatus.HELD  # never joins the decode batch: its KV goes elsewhere
                finished.append(seq)
                continue
            if seq.status is SeqStatus.WAITING:  # its prompt is done: it joins the decode batch
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _keep_verified(self, item: ScheduledSeq, sampled: SampledTokens) -> FinishReason | None:
        """Append what a speculating sequence's verification kept (its accepted guesses, then the
        target's token), up to the first that ends it: nothing past a stop token, max_tokens or
        the length limit is kept. Its KV is final up to the last kept guess only: the slots of
        rejected guesses are dead (overwritten next step), and no block holding one is shared."""
        seq = item.seq
        reason = None
        for token in (*sampled.accepted.get(seq.seq_id, ()), sampled.token_ids[seq.seq_id]):
            seq.token_ids.append(token)
            if (reason := self._stop_reason(seq, token)) is not None:
                break
        # Every kept token but the newest has its KV from this step; the newest runs next step.
        seq.num_computed_tokens = seq.num_tokens - 1
        self.blocks.mark_final(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return reason

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason | None, quarantine: Collection[int] = ()) -> None:
        """Take ``seq`` out of every queue and free its blocks (a HELD sequence's too: that
        is how held KV is freed), but quarantine those a read may still write (``BlockManager.free``)."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.awaiting_kv.pop(seq.seq_id, None)
        self.blocks.free(seq.seq_id, quarantine)
