"""Wire types <-> engine dataclasses. One place, so every process reads a field the same way."""

from __future__ import annotations

from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams, TopLogprobs
from pdserve.protos import pdserve_pb2

# Without max_tokens a gRPC request stops here; an OpenAI HTTP request instead gets the
# rest of the context (``pdserve.router.frontend.prepare``), as vLLM gives it.
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
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens,
        structured=structured_from_proto(p.structured_output) if p.HasField("structured_output") else None,
        cache_salt=p.cache_salt,
        lora_name=p.lora_name,
    )


def structured_from_proto(p: pdserve_pb2.StructuredOutput) -> StructuredOutput | None:
    """None for a message with no constraint set (nothing to follow)."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    spec = "" if kind == "json_object" else getattr(p, kind)
    return StructuredOutput(GrammarKind(kind), spec, p.resumed_tokens)


def structured_to_proto(s: StructuredOutput) -> pdserve_pb2.StructuredOutput:
    p = pdserve_pb2.StructuredOutput(resumed_tokens=s.resumed_tokens)
    if s.kind is GrammarKind.JSON_OBJECT:
        p.json_object = True
    else:
        setattr(p, s.kind.value, s.spec)
    return p


def sampling_to_proto(s: SamplingParams) -> pdserve_pb2.SamplingParams:
    p = pdserve_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, repetition_penalty=s.repetition_penalty,
        stop_token_ids=list(s.stop_token_ids), stop=list(s.stop), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
        cache_salt=s.cache_salt, lora_name=s.lora_name,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.structured is not None:
        p.structured_output.CopyFrom(structured_to_proto(s.structured))
    return p


def top_to_proto(top: TopLogprobs) -> pdserve_pb2.TopLogprobs:
    return pdserve_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])


def top_from_proto(p: pdserve_pb2.TopLogprobs) -> TopLogprobs:
    return tuple(zip(p.token_ids, p.logprobs))


def finish_to_wire(reason: str | None) -> int:
    return _FINISH_TO_WIRE[reason]


def finish_from_wire(reason: int) -> str | None:
    return _FINISH_FROM_WIRE[reason]
