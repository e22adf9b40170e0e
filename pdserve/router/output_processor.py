"""Worker outputs -> the client's responses, in the shape of vLLM v1's ``OutputProcessor``:
detokenizing, stop strings, logprobs, and the usage on the last response.

Workers send token ids and their logprobs only. Stop strings are the router's alone: it is
the one place that sees a request's whole text, across its prefill, its decode and every
migration. A request's outputs come as one prefill answer (``worker_pb2.PrefillResponse``,
from a prefill worker or from a decode worker that prefilled locally) per attempt, each
followed by decode outputs (``worker_pb2.DecodeResponse``)."""

from __future__ import annotations

from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.wire.convert import finish_from_wire, finish_to_wire


class OutputProcessor:
    """One request's output so far, and the responses that carry it to the client."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[int] = []  # sent to the client
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the first prefill found in the prefix cache
        self._detok = IncrementalDetokenizer(tokenizer, params.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def prefilled(self, answer: worker_pb2.PrefillResponse) -> pdserve_pb2.GenerateResponse:
        """An attempt's first token. The request's first one also carries the prompt
        logprobs, if asked for; after a migration the prompt holds output already sent."""
        first = not self.token_ids
        if first:
            self.cached_tokens = answer.num_cached_tokens
        resp = self._emit([answer.first_token_id], [answer.first_logprob] if self.params.logprobs else [],
                          finish_from_wire(answer.finish_reason),
                          [answer.first_top_logprobs] if self.params.top_logprobs else [])
        if first and self.params.prompt_logprobs is not None:
            resp.prompt_token_ids.extend(self.prompt_token_ids)
            resp.prompt_logprobs.extend(answer.prompt_logprobs)
            resp.prompt_top_logprobs.extend(answer.prompt_top_logprobs)
        return resp

    def decoded(self, output: worker_pb2.DecodeResponse) -> pdserve_pb2.GenerateResponse:
        return self._emit(list(output.token_ids), list(output.logprobs), finish_from_wire(output.finish_reason),
                          list(output.top_logprobs))

    def _emit(self, token_ids: list[int], logprobs: list[float], finish: str | None,
              top_logprobs: list[pdserve_pb2.TopLogprobs]) -> pdserve_pb2.GenerateResponse:
        """A response with ``token_ids`` up to a stop string's end, and their text; the text a
        stop string might still match is held back until it cannot, or the request ends."""
        text = []
        for t in token_ids:
            self.token_ids.append(t)
            delta, hit_stop = self._detok.add(t)
            text.append(delta)
            if hit_stop:
                finish = "stop"
                break
        kept = len(text)
        if finish is not None:
            self.finish_reason = finish
            text.append(self._detok.flush())
        resp = pdserve_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids[:kept],
                                            text="".join(text), logprobs=logprobs[:kept],
                                            top_logprobs=top_logprobs[:kept], finish_reason=finish_to_wire(finish))
        if finish is not None:
            resp.usage.CopyFrom(self.usage())
        return resp

    def usage(self) -> pdserve_pb2.Usage:
        return pdserve_pb2.Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=len(self.token_ids),
                                 cached_prompt_tokens=self.cached_tokens)
