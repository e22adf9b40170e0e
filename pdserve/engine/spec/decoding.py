"""Speculative decoding in one engine: which sequences guess, how many tokens, and what it kept.

The scheduler asks ``propose`` for the sequences a step decodes, once it knows them; a sequence
that gets a proposal runs its newest token and its guesses in that step's forward
(``ScheduledSeq.draft``), the model runner verifies them from the logits at every position
(``rejection.verify``), and the scheduler appends what was kept (``Scheduler._keep_verified``).
The rest of the batch, prompt chunks included, runs as in any step.

What does not speculate (it decodes one token a step, in the same batch):
- a request that asks for logprobs or top logprobs, prompt logprobs, any penalty or logit bias,
  ``min_tokens``, structured output, or stop strings: each is a per-token rule the verification
  does not apply;
- a sequence with no room for a guess: one token left before its ``max_tokens`` or the context's
  end (guesses are cut to the room left), or no free block for the guesses' slots;
- every sequence of a step whose decode batch is larger than ``disable_by_batch_size``: a full
  batch is bound by the weights' compute, and the extra positions would make every step slower.
  Below it the guesses per sequence shrink as the batch grows (``num_guesses``), so a step verifies
  at most about 2 x ``disable_by_batch_size`` positions.
"""

from __future__ import annotations

from pdserve.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.core.scheduler import SampledTokens, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.spec.proposer import Proposal, Proposer, SpecStats
from pdserve.engine.spec.proposers import make_proposer
from pdserve.engine.spec.rejection import verify


def speculates(params: SamplingParams) -> bool:
    """Whether a request's tokens may come from verified guesses (module docstring)."""
    return not (params.logprobs or params.top_logprobs or params.prompt_logprobs is not None or params.penalised
                or params.structured is not None or params.stop)


class SpecDecoding:
    """The engine's speculation: its proposer, its policy, its counters (``stats``)."""

    verify = staticmethod(verify)  # what the model runner checks the guesses with

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    @classmethod
    def of(cls, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> "SpecDecoding | None":
        """The speculation ``config.speculative`` asks for (its proposer built), None when off."""
        spec = config.speculative
        return None if spec is None else cls(spec, make_proposer(spec, config, model_cfg), max_model_len)

    def num_guesses(self, batch: int) -> int:
        """Guesses per sequence for a decode batch of ``batch``: ``num_speculative_tokens`` while
        the step's positions stay within 2 x ``disable_by_batch_size``, fewer (at least one) past
        that, none past ``disable_by_batch_size`` sequences."""
        if batch > self.config.disable_by_batch_size:
            return 0
        return min(self.config.num_speculative_tokens, max(1, 2 * self.config.disable_by_batch_size // batch - 1))

    def propose(self, seqs: list[Sequence]) -> dict[str, Proposal]:
        """The proposals of the sequences of ``seqs`` (a step's decode batch) that speculate
        this step, by seq id; each at most as long as its room allows, none empty."""
        k = self.num_guesses(len(seqs))
        fit = [s for s in seqs if k and not s.hold_kv and speculates(s.params) and self._room(s) > 1]
        if not fit:
            return {}
        drafts: dict[str, Proposal] = {}
        for seq, proposal in zip(fit, self.proposer.propose(fit, k)):
            n = min(len(proposal.token_ids), k, self._room(seq) - 1)
            if n == len(proposal.token_ids) and n:
                drafts[seq.seq_id] = proposal
            elif n > 0:
                probs = proposal.probs[:n] if proposal.probs is not None else None
                drafts[seq.seq_id] = Proposal(proposal.token_ids[:n], probs)
        return drafts

    def _room(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still add: a step adds its kept guesses and one more."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    def observe(self, out: SchedulerOutput, sampled: SampledTokens) -> None:
        """Count the step's verified proposals (a row that failed verified nothing)."""
        for item in out.seqs:
            seq_id = item.seq.seq_id
            if item.draft is not None and seq_id in sampled.token_ids:
                self.stats.record(len(item.draft_token_ids), len(sampled.accepted.get(seq_id, ())))

    def forget(self, seq_id: str) -> None:
        self.proposer.forget(seq_id)
