"""The OpenAI fields as vLLM serves them, through the official ``openai`` client, unmodified,
on the shared float32 cluster (prefill and decode in different processes): each checked
against transformers on the same weights."""

import http.client as http_client
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from pdserve.protos import pdserve_pb2

pytestmark = pytest.mark.slow
PROMPT = "The three primary colors are red, yellow and"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)


def hf_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax (len(ids), V) over a whole sequence."""
    with torch.no_grad():
        return torch.log_softmax(reference[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def test_n2_greedy_choices_are_identical_and_seeded_sampling_distinct(client):
    greedy = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text and greedy.usage.completion_tokens == 16
    seeded = [client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2)
              for _ in range(2)]
    texts = [[c.text for c in r.choices] for r in seeded]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]  # reproducible, and each choice its own


def test_echo_prompt_logprobs_and_top_logprobs_equal_transformers(client, reference):
    """lm-eval's loglikelihood request: echo, logprobs=k, max_tokens=1, batched token prompts."""
    _, tok = reference
    prompts = [tok.encode(PROMPT), tok.encode("Water boils at one hundred degrees")]
    out = client.completions.create(model="smollm2", prompt=prompts, max_tokens=1, temperature=0, logprobs=3,
                                    echo=True)
    assert len(out.choices) == 2
    for ids, choice in zip(prompts, out.choices):
        lp = choice.logprobs
        generated = tok.encode(choice.text[len(tok.decode(ids)):], add_special_tokens=False)
        assert choice.text.startswith(tok.decode(ids)) and len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_logprobs(reference, ids + generated[:1])
        for i in range(1, len(ids) + 1):  # prompt tokens 1..n-1, then the generated one
            target = ids[i] if i < len(ids) else int(ref[i - 1].argmax())
            assert abs(lp.token_logprobs[i] - ref[i - 1, target].item()) < 1e-4
            best = ref[i - 1].topk(3)
            assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(best.values.tolist(),
                                                                                          abs=1e-4)


def test_chat_top_logprobs_equal_transformers(client, reference):
    model, tok = reference
    messages = [{"role": "user", "content": "Name a color."}]
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=4)
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    content = out.choices[0].logprobs.content
    with torch.no_grad():  # the answer's ids, from transformers' own greedy
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    ref = hf_logprobs(reference, prompt + ids)[len(prompt) - 1:-1]
    assert len(content) == len(ids)
    for pos, entry in enumerate(content):
        best = ref[pos].topk(4)
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in best.indices.tolist()]
        assert entry.logprob == pytest.approx(ref[pos, ids[pos]].item(), abs=1e-4)


def test_penalties_and_logit_bias_apply_on_prefill_and_decode_workers(client, reference):
    """The first token comes from the prefill worker, the rest from the decode worker: both
    must apply the same logit processing as transformers' logits with it applied."""
    model, tok = reference
    prompt = tok.encode(PROMPT)
    plain = hf_logprobs(reference, prompt)[-1].argmax().item()
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                    frequency_penalty=1.2, presence_penalty=0.6, logit_bias={str(plain): -100})
    ids = list(prompt)
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[plain] -= 100.0
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.shape[0]).float()
        ids.append(int((logits - 1.2 * counts - 0.6 * (counts > 0).float()).argmax()))
    assert out.choices[0].text == tok.decode(ids[len(prompt):], skip_special_tokens=True)
    assert plain not in ids[len(prompt):]


def test_stream_usage_reports_cached_tokens_and_chat_default_max_tokens_is_not_16(client):
    long_prompt = "Once upon a time, in a land far away, there lived " * 6
    cached = []
    for _ in range(3):  # two prefill workers: by the third run one of them has seen the prompt
        chunks = list(client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=2, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
        cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and max(cached) >= 64  # a repeat reused the blocks its first run filled
    out = client.chat.completions.create(model="smollm2", temperature=0, messages=[
        {"role": "user", "content": "Write two sentences about the sea."}])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens > 16


def test_unsupported_fields_are_400_naming_them(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert err.value.body["param"] == "tool_choice"  # "auto", the default, and SmolLM2's template has no tool format
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt="x", max_tokens=2, suffix="y")
    assert err.value.body["param"] == "suffix"


def http(cluster, method: str, path: str, body=None, headers=None):
    req = urllib.request.Request(f"http://{cluster.http_address}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_tokenize_detokenize_version_model_card_and_request_id(cluster, reference):
    _, tok = reference
    status, out, _ = http(cluster, "POST", "/tokenize", {"prompt": PROMPT})
    assert status == 200 and out["tokens"] == tok.encode(PROMPT) and out["count"] == len(out["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    status, out, _ = http(cluster, "POST", "/tokenize", {"messages": messages})
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert status == 200 and out["tokens"] == expected
    status, out, _ = http(cluster, "POST", "/detokenize", {"tokens": tok.encode("hello world")})
    assert status == 200 and out["prompt"] == "hello world"
    assert http(cluster, "POST", "/detokenize", {"tokens": [10**6]})[:2][0] == 400
    status, out, _ = http(cluster, "GET", "/version")
    assert status == 200 and out["version"]
    assert http(cluster, "GET", "/v1/models/smollm2")[1]["id"] == "smollm2"
    assert http(cluster, "GET", "/v1/models/gpt-4")[0] == 404
    status, out, headers = http(cluster, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                                {"X-Request-Id": "trace-42"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42"


def test_a_grpc_abort_naming_an_http_requests_id_does_not_reach_it(cluster, stub):
    """X-Request-Id names the request in the router and on the workers, but clients choose
    ids: a gRPC Abort from another caller naming it finds nothing, and the stream runs to its
    end (an HTTP request is aborted by closing its connection)."""
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http_client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json", "X-Request-Id": "abort-me"},
                     body=json.dumps({"prompt": "Count to a thousand:", "max_tokens": 24, "ignore_eos": True,
                                      "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "abort-me"
        assert resp.readline().startswith(b"data: ")  # running: its first token is out
        assert not stub.Abort(pdserve_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
        assert b'"finish_reason": "length"' in resp.read()
    finally:
        conn.close()
