"""Where the simulated router sends a prompt (``Simulator``'s part, kept apart for size): the
real rules of ``pdserve.router.policy`` and ``pdserve.router.local_prefill`` over the simulated
workers' exact loads.

In order, as the router decides: a mixed worker (elastic roles) prefills its own stream's
prompt unless a prefill worker queues less; with prefill that keeps up on
(``ClusterSpec.overflow_ttft_s``), a plain decode worker prefills it when the prefill pool is
behind (``behind``: the least queued prefill worker would start it later than the threshold and
the decode worker sooner, at the prompt token cost its step budget measured, as its stats report
it, or before it has, ``overflow_slowdown`` times the pace); else the least queued
prefill (or colocated) worker takes it. The pace ``behind`` reads is the router's
``PrefillPace``, fed each prefill worker's answer: its simulated compute seconds (from its
first chunk to its first token, packed steps included) per prompt token computed. No answer
yet, no pace: nothing overflows.
"""

from __future__ import annotations

from pdserve.planner.worker import SimSeq, SimWorker
from pdserve.router.local_prefill import Mixed, behind
from pdserve.router.policy import pick_decode, pick_prefill


class Placement:
    """``Simulator``'s prompt placement (module docstring)."""

    def _place(self, seq: SimSeq) -> bool:
        if self.mixed and self._place_mixed(seq):
            return True
        if self.overflow.overflow_ttft_s and self._place_behind(seq):
            return True
        role = "colocated" if self.spec.layout.colocated else "prefill"
        choice = pick_prefill(self._snapshots(role), prompt_tokens=seq.prompt,
                              max_queued_tokens=self.spec.max_queued_tokens)
        if choice.worker_id is None:
            return False
        w = self._worker(role, choice.worker_id)
        self._take_prompt(w, seq)
        return True

    def _place_mixed(self, seq: SimSeq) -> bool:
        """The router's rule for a stream whose decode worker is mixed: prefilled there unless a
        prefill worker queues less. False: the prefill pool takes it as usual."""
        choice = self._pick_decode(seq)
        if choice.worker_id not in self.mixed:
            return False
        w = self._by_id[choice.worker_id]
        prefill = [p.queued_tokens for p in self.pools["prefill"]]
        if prefill and min(prefill) < w.queued_tokens:
            return False
        self._take_prompt(w, seq)
        return True

    def _place_behind(self, seq: SimSeq) -> bool:
        """The router's ``PREFILL_BEHIND``: the real ``behind`` rule on the decode worker the
        decode choice picks (not a mixed one: its own rule came first), given the least queued
        prefill worker and the pace seen so far. True: that decode worker prefills ``seq``."""
        prefill = [p.queued_tokens for p in self.pools["prefill"]]
        if self.spec.layout.colocated or not prefill:
            return False
        choice = self._pick_decode(seq)
        if choice.worker_id is None or choice.worker_id in self.mixed:
            return False
        w = self._by_id[choice.worker_id]
        local = w.budget.prompt_token_s() if w.budget is not None else None  # WorkerStats.local_prefill_token_s
        queues = Mixed(own_queue=w.queued_tokens, prefill_queue=min(prefill), token_s=self.pace.token_s,
                       local_token_s=local)
        if not behind(self.overflow, seq.prompt, queues):
            return False
        self._take_prompt(w, seq)
        return True

    def _pick_decode(self, seq: SimSeq):
        """The real decode choice for ``seq``: room for its prompt, its output and the next token."""
        blocks = -(-(seq.prompt + seq.remaining + 1) // self.spec.limits.block_size)
        return pick_decode(self._snapshots("decode"), blocks)

    def _take_prompt(self, w: SimWorker, seq: SimSeq) -> None:
        """``w`` prefills ``seq`` (the router placed the prompt there)."""
        self._last_placed[w.wid] = next(self._placed)
        self._inflight[w.wid] += 1
        w.add_prompt(seq)
        self._kick(w)
        self._touch(w)
