"""A request's state inside one engine: its tokens, progress and status (no torch)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pdserve.engine.sampling.params import SamplingParams, TopLogprobs

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)computing of its tokens: a new prompt or a preempted sequence
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated; KV arrives from elsewhere (decode worker)
    RUNNING = "running"  # in the decode batch
    # Prefill-only (``hold_kv``): its first token is sampled and its KV stays in its blocks
    # for another worker to read; leaves with ``LLMEngine.free_held`` (or ``abort``).
    HELD = "held"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"
    ERROR = "error"  # the sequence's own fault ended it (engine.errors.SequenceFailed)


@dataclass(eq=False)
class Sequence:
    """One request. ``token_ids`` is prompt + output; the first ``num_prompt_tokens`` are prompt.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. A decoding sequence has
    exactly one token (the newest) not yet computed.
    """

    seq_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With ``params.prompt_logprobs``: (logprob, top alternatives) of prompt tokens 1..n-1.
    prompt_logprobs: list[tuple[float, TopLogprobs]] = field(default_factory=list)
    # Prefill-only requests (the prefill worker's): finish after the first token and keep
    # the KV blocks, which the caller frees later.
    hold_kv: bool = False
    # The content identity of the LoRA adapter ``params.lora_name`` names, as this engine held
    # it when the request came (``LoRAAdapter.fingerprint``; "" for the base model): its KV
    # blocks are hashed with ``kv_salt(params, lora_fingerprint)``.
    lora_fingerprint: str = ""
    arrival: int = field(default_factory=lambda: next(_arrival))

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def is_held(self) -> bool:
        return self.status is SeqStatus.HELD

    @property
    def is_done_here(self) -> bool:
        """Finished, or held for another worker: no step will run it again."""
        return self.status in (SeqStatus.FINISHED, SeqStatus.HELD)
