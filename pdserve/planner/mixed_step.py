"""Time-sized chunks on a simulated worker: the engine's mixed steps with a step budget
(``pdserve/engine/core/scheduler.py`` ``_schedule_mixed``, ``pdserve/engine/core/step_budget.py``).

A worker with a step target (``SchedulerConfig.mixed_step_target_s`` above 0: what ``pdserve
serve`` gives a disaggregated or elastic cluster's decode workers) that has streams running and
a prompt waiting runs one mixed step: every stream decodes one token, and the prompt gets the
chunk ``StepBudget.chunk()`` allows. The budget is the engine's own object, fed the simulated
step times as the engine feeds it measured ones (``observe``), so its chunk moves as the real
one does: the start chunk until it has seen a decode-only and a prompt step, then
(target - decode_s) / token_s, never below its floor.

Without a target, or without streams, a worker runs as before: prefill first, a local prompt in
one step that stalls every stream for all of it.

A mixed step's time: the decode rows' step from the cost model plus what the chunk adds to it,
a prefill step of the chunk less an empty one (the step's fixed cost and its weight read, which
the decode rows already pay). A mixed step keeps its borrowed speed when the borrowed cores
get busy mid-step (``unborrow`` cuts only decode epochs): it lasts about one step target.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.engine.core.step_budget import StepBudget

# An epoch's k equal decode steps feed the budget's mean k samples; past this many the mean no
# longer moves (0.8 ** 64 ~ 1e-6 at the budget's weight), so longer epochs stop there.
MAX_EPOCH_SAMPLES = 64


def chunk_s(cost, chunks: Sequence[tuple[int, int]], sampled: int) -> float:
    """What prompt ``chunks`` of (new tokens, cached before them) add to a step that already
    runs decode rows: a prefill step of them less a step of no tokens."""
    return cost.prefill_s(chunks, sampled) - cost.prefill_s([], 0)


def step_budget(target_s: float) -> StepBudget | None:
    """The engine's budget for a worker whose mixed steps aim at ``target_s``; None: off."""
    return StepBudget(target_s) if target_s > 0 else None


class MixedSteps:
    """``SimWorker``'s mixed step (module docstring): what it adds to the worker's own
    ``start``/``finish``, kept apart so the worker's prefill-first rules read as before."""

    def _start_mixed(self, borrow: bool) -> bool:
        """Set up one mixed step (decode all running, plus the budget's prompt chunk); False
        when no stream is left to decode once the cache has made room (today's rules then run).
        A step that had to preempt admits no prompt, as the engine's."""
        preempted = self.preemptions
        self._decode_steps()
        if not self.running:
            return False
        b = len(self.running)
        budget = min(self.limits.max_num_batched_tokens - b, self.budget.chunk())
        batch = self._schedule_prefill(budget) if self.preemptions == preempted and budget > 0 else []
        prompt = chunk_s(self.cost, [(n, s.tokens - s.todo) for s, n in batch],
                         sum(1 for s, n in batch if n == s.todo)) if batch else 0.0
        fp, fd = self.borrow_factors if borrow else (1.0, 1.0)
        self._kind, self._batch, self._k = "mixed", batch, 1
        self._dt = self.cost.decode_s(b, self.run_tokens) * fd + prompt * fp + self._take_load()
        return True

    def _finish_mixed(self):
        """Apply a mixed step: each stream's token (ITL: the whole step), then the chunk; a
        prompt it completes joins the batch for the next step."""
        rows, prompt = len(self.running), sum(n for _, n in self._batch)
        decoded = self._finish_decode()
        out = self._apply_chunks()
        out.finished = decoded.finished + out.finished
        out.itl = decoded.itl
        self.budget.observe(rows, prompt, self._dt)
        return out

    def _observe_step(self, rows: int) -> None:
        """Feed the budget a prefill-first step or a decode epoch that just ended, as the engine
        does after each step (an epoch: its k equal steps)."""
        if self.budget is None:
            return
        prompt = sum(n for _, n in self._batch) if self._kind == "prefill" else 0
        for _ in range(min(self._k, MAX_EPOCH_SAMPLES)):
            self.budget.observe(rows, prompt, self._dt)
