"""KV-aware routing end to end: two prefill workers (Ray actors), the router's default "kv"
policy. A second chat with the same long system prompt goes to the prefill worker that
cached it, which reuses it, and the answer is still transformers' greedy answer."""

import time
import urllib.request

import pytest

from pdserve.protos import pdserve_pb2
from tests.factories import assert_greedy_matches, default_reference

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient assistant for a small public library. Answer in one short sentence, name the "
          "shelf when you can, and never invent a book that the catalogue does not list. ") * 4


def chat(question: str) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=8))
    req.chat.messages.add(role="system", content=SYSTEM)
    req.chat.messages.add(role="user", content=question)
    return req


def cache_decisions(http_address: str) -> float:
    text = urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve:routing_decisions_total{') and 'reason="cache"' in line)


def test_a_shared_system_prompt_is_routed_to_its_cache_and_the_answer_is_exact(cluster, stub):
    first = list(stub.Generate(chat("Where are the atlases?"), timeout=120))
    time.sleep(3 * cluster.config.router_poll_s)  # the router's polls bring the worker's cache events
    before = cache_decisions(cluster.http_address)
    second = list(stub.Generate(chat("Do you lend films?"), timeout=120))
    cached = second[-1].usage.cached_prompt_tokens
    assert first[-1].usage.cached_prompt_tokens == 0
    assert cached >= second[-1].usage.prompt_tokens - 48  # the system prompt's blocks, all but the tail
    assert cache_decisions(cluster.http_address) - before == 1

    model, tok = default_reference()
    for question, resps in (("Where are the atlases?", first), ("Do you lend films?", second)):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        assert_greedy_matches(model, prompt, [t for r in resps for t in r.token_ids], 8,
                              eos_token_id=model.generation_config.eos_token_id, what=question)
