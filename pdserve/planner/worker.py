"""One simulated worker: the engine scheduler's rules (``pdserve/engine/core/scheduler.py``), applied to
token counts instead of token lists, with step times from the cost model.

Rules kept from the real scheduler:
- prefill first: if waiting sequences fit, the next step prefills them, packing prompts up to
  ``max_num_batched_tokens`` and chunking one that is longer than what is left of the budget;
  admission leaves one free block per running sequence (``reserve``) and stops at
  ``max_num_seqs``;
- otherwise every running sequence decodes one token;
- with a step target (``step_target_s`` above 0, ``pdserve.planner.mixed_step``), a worker with
  streams running and a prompt waiting runs mixed steps instead: every stream decodes and the
  prompt gets the chunk the engine's own ``StepBudget`` allows, so the streams' gap stays near
  the target; without a target, a prompt beside streams is prefilled whole and stalls them;
- a decoding sequence that needs a block when none is free preempts the youngest running
  sequence, which goes back to the front of the waiting queue and is recomputed later.

Why not the real ``Scheduler`` and ``BlockManager`` in this loop: they work on token lists,
one Python object per token and one ``append_slots`` per sequence per step, so a day of
traffic costs O(tokens) Python calls (about 10^10 for 1,000 workers). Here a decode
*epoch* of k steps with an unchanged batch is one event: it ends at the next finish, at the
step where the cache would run out of blocks, or early when new work arrives
(``interrupt``), which is exactly where the real scheduler's decision could change.
``tests/planner/test_worker_vs_engine.py`` runs the real scheduler and this one on the same
requests and compares their step sequences.

Block accounting is exact, as the real block manager counts it: a running sequence with L
tokens (the newest not yet computed) holds ceil((L - 1) / bs) blocks between steps and needs
ceil(L / bs) for its next step. ``RunningBlocks`` (``pdserve.planner.blocks``) sums that over
the batch for any future step in O(bs), so an epoch's length up to a full cache is a
bisection, not a loop over steps.

Roles: ``prefill`` (a finished prompt holds its blocks until its KV is transferred, then
``free``), ``decode`` (``reserve`` blocks when the router picks it, ``join`` when the KV
lands) and ``colocated`` (prefill and decode on one worker).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.blocks import RunningBlocks
from pdserve.planner.cost import CostModel
from pdserve.planner.mixed_step import MixedSteps, step_budget
from pdserve.planner.prefix_cache import PrefixCache, PrefixHits


@dataclass(frozen=True)
class EngineLimits:
    """The engine's scheduler and cache settings (``SchedulerConfig``, ``CacheConfig``)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_cache: bool = True


@dataclass(eq=False)
class SimSeq:
    """A request's state on one worker."""

    rid: int
    order: int  # arrival order; the youngest (largest) is preempted first
    prompt: int
    remaining: int  # tokens still to generate
    prefix_hash: str | None = None
    prefix_tokens: int = 0
    todo: int = 0  # tokens still to prefill
    tokens: int = 0  # tokens to hold in the cache once prefilled (prompt, or prompt + output so far)
    blocks: int = 0  # blocks allocated while waiting / prefilling / held
    join_step: int = 0  # decode step counter when it joined the batch
    join_tokens: int = 0  # tokens (computed + the newest) when it joined
    finish_step: int = 0
    recompute: bool = False  # preempted: its prefill produces no first token
    live: bool = False  # in the decode batch
    joins: int = 0  # times it joined a batch; a finish-heap entry from an earlier join is stale
    compute_from: float = -1.0  # when its first prompt chunk began (-1: not yet): the router's pace reads it
    compute_tokens: int = 0  # prompt tokens it had to compute then (its prefix-cache hit not counted)
    device_hit: int = 0  # prompt tokens its first prefill took from the worker's prefix cache
    tier_hit: int = 0  # and from the KV tier below it


@dataclass
class StepResult:
    """What one step (or decode epoch) produced."""

    prefilled: list[SimSeq] = field(default_factory=list)  # prompts done: first token out
    finished: list[SimSeq] = field(default_factory=list)  # decoding done
    preempted: int = 0
    itl: tuple[float, int] | None = None  # (inter-token latency, tokens that saw it)


class SimWorker(MixedSteps, PrefixHits):
    def __init__(self, wid: str, role: str, cost: CostModel, limits: EngineLimits, num_blocks: int | None = None,
                 step_target_s: float = 0.0):
        self.wid, self.role, self.cost, self.limits = wid, role, cost, limits
        self.budget = step_budget(step_target_s)  # time-sized chunks beside streams (mixed_step.py); None: off
        self.num_blocks = num_blocks or max(1, cost.kv_capacity_tokens() // limits.block_size)
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self._finish_heap: list[tuple[int, int, int, SimSeq]] = []
        self.step = 0  # decode steps taken
        self.run_tokens = 0  # tokens (computed + newest) of running sequences at ``step``
        self.run_blocks = RunningBlocks(limits.block_size)
        self.fixed_blocks = 0  # blocks of waiting, prefilling, held and reserved sequences
        self.queued_tokens = 0  # prompt tokens still to prefill
        self.prefix_cache = PrefixCache(self.num_blocks // 2, limits.block_size)  # its tier: the simulator's
        self._load_s = 0.0  # KV tier loads of the prompts admitted for the step being set up
        self._held: dict[int, int] = {}  # prefill role: request -> blocks held for its transfer
        self._reserved: dict[int, int] = {}  # decode role: request -> blocks reserved for its KV
        self.busy = False
        self.borrowing = False  # the step in flight also runs on the idle workers' cores
        self.borrow_factors = (cost.hw.borrow_prefill_factor, cost.hw.borrow_decode_factor)
        self.draining = False
        self.preemptions = 0
        # the step in flight
        self._kind = ""
        self._start = self._end = self._dt = 0.0
        self._k = 0
        self._batch: list[tuple[SimSeq, int]] = []
        self._joining: list[SimSeq] = []  # KV arrived mid-step: they join when it ends
        self.version = 0  # bumped when the step in flight is cut short

    # ---- load, as the router and the autoscaler read it ----------------------------
    @property
    def used_blocks(self) -> int:
        return self.fixed_blocks + self.run_blocks.at(self.step)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.used_blocks / self.num_blocks)

    @property
    def num_seqs(self) -> int:
        return len(self.waiting) + len(self.running) + len(self._joining)

    def idle(self) -> bool:
        return not self.busy and not self.waiting and not self.running

    # ---- work in ------------------------------------------------------------------
    def add_prompt(self, seq: SimSeq) -> None:
        seq.todo = seq.tokens = seq.prompt
        self.waiting.append(seq)
        self.queued_tokens += seq.todo

    def reserve(self, seq: SimSeq) -> None:
        """Decode role: the router placed ``seq`` here; its prompt's blocks are allocated now."""
        self._reserved[seq.rid] = blocks = self._blocks_for(seq.prompt)
        self.fixed_blocks += blocks

    def join(self, seq: SimSeq) -> None:
        """The sequence's KV is here (transferred, or just prefilled): it decodes from the next step.
        Mid-step it waits for the step in flight to end (``finish``), as the real engine adds a
        sequence between steps: joined at once, it would be counted in steps it never ran."""
        if self.busy:
            self._joining.append(seq)
            return
        self.fixed_blocks -= self._reserved.pop(seq.rid, 0) + seq.blocks
        seq.blocks = 0
        seq.join_step, seq.join_tokens = self.step, seq.tokens + 1
        seq.finish_step = self.step + seq.remaining
        seq.live, seq.joins = True, seq.joins + 1
        self.running.append(seq)
        self.run_tokens += seq.join_tokens
        self.run_blocks.add(self._slot_offset(seq))
        heapq.heappush(self._finish_heap, (seq.finish_step, seq.order, seq.joins, seq))

    def free(self, seq: SimSeq) -> None:
        """Prefill role: the held KV has been transferred (or dropped)."""
        self.fixed_blocks -= self._held.pop(seq.rid, 0)

    def hand_over(self) -> list[SimSeq]:
        """Elastic roles, between steps: give up every decoding sequence with its KV (a served
        switch past its grace). Each leaves with what it has made so far: its KV is its prompt
        now (the router's moved attempt: prompt + every token sent but the newest), and another
        decode worker reads it and makes the rest."""
        moved = []
        for seq in list(self.running):
            self._leave(seq)
            seq.remaining = seq.finish_step - self.step
            seq.prompt = seq.tokens = seq.join_tokens - 1 + (self.step - seq.join_step)
            moved.append(seq)
        return moved

    # ---- stepping -----------------------------------------------------------------
    def start(self, now: float, borrow: bool = False) -> float | None:
        """Begin the next step if there is work; returns when it ends (None: nothing to run).
        ``borrow``: the host's other workers idle, so its kernels run on their cores too (the
        profile's ``borrow_*_factor``), for the whole step or decode epoch."""
        if self.busy:
            return None
        if self.budget is not None and self.running and self.waiting and self._start_mixed(borrow):
            pass  # a mixed step: streams and a time-sized prompt chunk (mixed_step.py)
        elif batch := self._schedule_prefill():
            for s, _ in batch:
                if s.compute_from < 0:
                    s.compute_from, s.compute_tokens = now, s.todo
            chunks = [(n, s.tokens - s.todo) for s, n in batch]
            sampled = sum(1 for s, n in batch if n == s.todo)
            self._kind, self._batch, self._k = "prefill", batch, 1
            self._dt = self.cost.prefill_s(chunks, max(sampled, 1)) * (self.borrow_factors[0] if borrow else 1.0)
            self._dt += self._take_load()
        elif self.running:
            k = self._decode_steps()
            if not self.running:
                return self.start(now) if self.waiting else None
            b = len(self.running)
            self._kind, self._k = "decode", k
            self._dt = self.cost.decode_s(b, self.run_tokens + b * (k - 1) / 2) * (self.borrow_factors[1] if borrow else 1.0)
        else:
            return None
        self.busy, self._start, self.borrowing = True, now, borrow
        self._end = now + self._dt * self._k
        return self._end

    def interrupt(self, now: float) -> float | None:
        """New work arrived mid-epoch: end the decode epoch after the step now running, where
        the real scheduler would first see the new work. Returns the new end, or None if unchanged."""
        if not self.busy or self._kind != "decode" or self._k <= 1:
            return None
        done = min(self._k, int((now - self._start) / self._dt) + 1)
        if done >= self._k:
            return None
        self._k, self._end = done, self._start + done * self._dt
        self.version += 1
        return self._end

    def unborrow(self, now: float) -> float | None:
        """The cores this step borrows are busy again (another worker started a step): a
        prefill step's rest runs at the worker's own speed, a decode epoch ends after its step
        in flight (``interrupt``). Returns the new end, or None if unchanged."""
        self.borrowing = False
        if self._kind != "prefill":
            return self.interrupt(now)
        self._end = now + (self._end - now) / self.borrow_factors[0]
        self._dt = self._end - self._start
        self.version += 1
        return self._end

    def finish(self) -> StepResult:
        """Apply the step in flight (call at the time ``start``/``interrupt`` returned)."""
        self.busy = False
        if self._kind == "mixed":
            out = self._finish_mixed()
        else:
            self._observe_step(len(self.running))
            out = self._finish_prefill() if self._kind == "prefill" else self._finish_decode()
        joining, self._joining = self._joining, []
        for seq in joining:
            self.join(seq)
        return out

    # ---- prefill (Scheduler._schedule_prefill on counts) ---------------------------
    def _schedule_prefill(self, budget: int | None = None) -> list[tuple[SimSeq, int]]:
        """Prompt chunks for the next step, up to ``budget`` tokens (None: the whole token budget)."""
        lim = self.limits
        budget = lim.max_num_batched_tokens if budget is None else budget
        batch: list[tuple[SimSeq, int]] = []
        while self.waiting and budget > 0 and len(self.running) + len(batch) < lim.max_num_seqs:
            seq = self.waiting[0]
            if seq.blocks == 0:
                need = self._blocks_for(seq.tokens)
                free = self.num_blocks - self.used_blocks
                if need + len(self.running) > free and (self.running or batch):
                    break
                if need > free:
                    break
                seq.blocks = need
                self.fixed_blocks += need
                self._prefix_hit(seq)
            if seq.todo > budget and not lim.enable_chunked_prefill:
                if batch:
                    break
                budget = seq.todo
            n = min(seq.todo, budget)
            batch.append((seq, n))
            budget -= n
            if n < seq.todo:
                break
            self.waiting.popleft()
        return batch

    def _finish_prefill(self) -> StepResult:
        out = self._apply_chunks()
        if self.running and self.role == "colocated":
            b = len(self.running)
            out.itl = (self._dt + self.cost.decode_s(b, self.run_tokens), b)  # decodes stalled by the prefill
        return out

    def _apply_chunks(self) -> StepResult:
        """The step's prompt chunks are computed: a prompt done has its first token and joins
        the batch (or, on a prefill worker, is held for its transfer)."""
        out = StepResult()
        for seq, n in self._batch:
            seq.todo -= n
            self.queued_tokens -= n
            if seq.todo:
                continue
            seq.remaining -= 1  # the step sampled its next token
            if self.role == "prefill":
                self._held[seq.rid], seq.blocks = seq.blocks, 0  # held until ``free``
                out.prefilled.append(seq)
                continue
            if not seq.recompute:
                out.prefilled.append(seq)
            if seq.remaining == 0:
                self.fixed_blocks -= seq.blocks
                seq.blocks = 0
                out.finished.append(seq)
            else:
                self.join(seq)
        self._batch = []
        return out

    # ---- decode (Scheduler._schedule_decode on counts) -----------------------------
    def _decode_steps(self) -> int:
        """Steps until the first finish or until the cache runs out, preempting the youngest
        sequences first if not even one step fits."""
        cap = self.num_blocks - self.fixed_blocks
        while self.running:
            self._drop_dead()
            until_finish = max(1, self._finish_heap[0][0] - self.step)
            if self.run_blocks.at(self.step + 1) <= cap:
                if self.run_blocks.at(self.step + until_finish) <= cap:
                    return until_finish  # the usual case: the cache holds the batch to its next finish
                lo, hi = 1, until_finish  # k steps need the blocks of step + k: bisect the largest that fits
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self.run_blocks.at(self.step + mid) <= cap else (lo, mid - 1)
                return lo
            self._preempt(max(self.running, key=lambda s: s.order))
        return 0

    def _preempt(self, seq: SimSeq) -> None:
        self._leave(seq)
        seq.remaining = seq.finish_step - self.step
        seq.recompute = True
        seq.tokens = seq.join_tokens + (self.step - seq.join_step)  # prompt + tokens generated so far
        seq.todo = seq.tokens
        self.queued_tokens += seq.todo
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _leave(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        seq.live = False
        self.run_tokens -= seq.join_tokens + (self.step - seq.join_step)
        self.run_blocks.add(self._slot_offset(seq), -1)

    @staticmethod
    def _slot_offset(seq: SimSeq) -> int:
        """Slots held at decode step s are (tokens - 1) = join_tokens - 1 + s - join_step."""
        return seq.join_tokens - 1 - seq.join_step

    def _drop_dead(self) -> None:
        while self._finish_heap and not self._current(self._finish_heap[0]):
            heapq.heappop(self._finish_heap)

    @staticmethod
    def _current(entry: tuple[int, int, int, SimSeq]) -> bool:
        return entry[3].live and entry[3].joins == entry[2]

    def _finish_decode(self) -> StepResult:
        out = StepResult(itl=(self._dt, len(self.running) * self._k))
        self.step += self._k
        self.run_tokens += len(self.running) * self._k
        self._drop_dead()
        while self._finish_heap and self._finish_heap[0][0] <= self.step:
            entry = heapq.heappop(self._finish_heap)
            seq = entry[3]
            if self._current(entry):
                seq.remaining = 0
                self._leave(seq)
                out.finished.append(seq)
        return out

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.limits.block_size)
