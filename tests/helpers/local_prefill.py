"""A ``DecodeRequest`` that asks the decode worker to prefill its prompt itself (``local_prefill``)."""

from pdserve.protos import pdserve_pb2, worker_pb2

LONG_TOKENS = 16  # what a local request generates unless it says otherwise


def local_request(rid: str, prompt: list[int], max_tokens: int = LONG_TOKENS, **sampling) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, local_prefill=True,
                                    sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                        **sampling))
