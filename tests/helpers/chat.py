"""Chat requests to a served cluster's gRPC API, their streams collected, and greedy output checked
against transformers (the ``reference`` fixture of tests/conftest.py)."""

from pdserve.protos import pdserve_pb2
from tests.factories import assert_greedy_matches


def chat_request(question: str, max_tokens: int = 32, **sampling) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    req.chat.messages.add(role="user", content=question)
    return req


def collect(responses) -> tuple[list[int], str, list]:
    ids, text, all_resps = [], "", []
    for r in responses:
        ids += list(r.token_ids)
        text += r.text
        all_resps.append(r)
    return ids, text, all_resps


def assert_chat_greedy(reference, question: str, ids: list[int], max_tokens: int) -> None:
    """``ids`` are transformers' greedy answer to ``question`` (tests.factories.assert_greedy_matches:
    token for token, a float32 near tie aside)."""
    model, tok = reference
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    assert_greedy_matches(model, tok.encode(text, add_special_tokens=False), ids, max_tokens,
                          eos_token_id=model.generation_config.eos_token_id, what=question)
