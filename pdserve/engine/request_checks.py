"""The checks an engine makes of each request before it queues it (``LLMEngine.validate``),
apart from the engine so that each names its field and limit in one place."""

from __future__ import annotations

from typing import Sequence

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.errors import CacheCapacityError, InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams, check_request


def check_here(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int,
               blocks: BlockManager, detokenize: bool, lora_names) -> None:
    """Raise ``InvalidRequestError`` naming the field and the limit a request breaks on this
    engine: its sizes, stop strings without a detokenizer, a prompt the cache can never hold,
    an adapter (``lora_name``) this engine does not hold (field "model": the client named it
    as the model). ``lora_names``: the adapters held (a container; empty without LoRA)."""
    check_request(prompt_token_ids, params, vocab_size, max_model_len)
    if params.stop and not detokenize:
        raise InvalidRequestError("stop", "stop strings need an engine that detokenizes")
    if params.lora_name and params.lora_name not in lora_names:
        raise InvalidRequestError("model", f"no LoRA adapter named {params.lora_name!r} is loaded here")
    try:
        blocks.check_fits(len(prompt_token_ids) + 1)
    except CacheCapacityError as exc:
        raise InvalidRequestError("prompt", str(exc), exc.total_blocks * blocks.block_size) from exc


def check_first_token(token: int, vocab_size: int) -> None:
    """A peer's first token is a token of this vocabulary (else it would index past the
    embedding table in the next forward)."""
    if not 0 <= token < vocab_size:
        raise InvalidRequestError("first_token_id", f"{token} is not a token id: ids are in [0, {vocab_size})",
                                  vocab_size)
