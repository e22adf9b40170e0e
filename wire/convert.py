"""Wire types <-> engine dataclasses. One place, so every process reads a field the same way."""

from __future__ import annotations

from engine.sampling import SamplingParams
from protos import pdserve_pb2

DEFAULT_MAX_TOKENS = 16

_FINISH_TO_WIRE = {
    None: pdserve_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": pdserve_pb2.FINISH_REASON_STOP,
    "length": pdserve_pb2.FINISH_REASON_LENGTH,
    "abort": pdserve_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_WIRE = {v: k for k, v in _FINISH_TO_WIRE.items()}


def sampling_from_proto(p: pdserve_pb2.SamplingParams, keep_stop_strings: bool = True) -> SamplingParams:
    """Proto -> engine params; unset fields take the engine's defaults.

    Workers pass ``keep_stop_strings=False``: stop strings are applied by the router, which
    is the one place that sees a request's whole text across prefill and decode.
    """
    return SamplingParams(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop) if keep_stop_strings else (),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
    )


def sampling_to_proto(s: SamplingParams) -> pdserve_pb2.SamplingParams:
    p = pdserve_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, repetition_penalty=s.repetition_penalty,
        stop_token_ids=list(s.stop_token_ids), stop=list(s.stop), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
    )
    if s.seed is not None:
        p.seed = s.seed
    return p


def finish_to_wire(reason: str | None) -> int:
    return _FINISH_TO_WIRE[reason]


def finish_from_wire(reason: int) -> str | None:
    return _FINISH_FROM_WIRE[reason]
