"""The Qwen3 families, Phi-3 and Gemma 3 (tests/families.py) served disaggregated: a real prefill worker and a real decode worker
behind their gRPC servers in this process, the KV over NIXL, and the router's request path
(``RequestRun`` over a pool of stubs). Each family's small random model carries the default
model's 49,152-token tokenizer, so grammars compile against real token strings.

float32: every answer equals transformers' greedy generate (a near tie aside), the decode
worker never recomputes the prompt, a shared prefix is a prefix-cache hit with the same
tokens; bfloat16: logprob-close to transformers by vLLM's standard; structured output: the
answer follows its JSON schema though prefill and decode run the grammar on two workers.
And once through a Ray cluster (workers in their own processes), as ``pdserve serve`` runs it."""

import asyncio
import contextlib
import dataclasses
import json

import grpc
import jsonschema
import openai
import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.request_run import RequestRun
from tests.clusters import cluster_config, running_cluster
from tests.factories import assert_greedy_matches, decode_worker_config, make_engine, prefill_worker_config, random_prompts
from tests.families import FAMILIES, save_family_model
from tests.helpers.worker_servers import serving, settle
from tests.logprobs import TOP_K, Generation, check_logprobs_close, hf_generation

pytestmark = pytest.mark.slow

BLOCK, MAX_TOKENS = 16, 12
SYSTEM = random_prompts(1, [3 * BLOCK], vocab=49152, seed=31)[0]  # a shared prefix of 3 full blocks
PROMPTS = [SYSTEM + q for q in random_prompts(3, [5, 20, 41], vocab=49152, seed=32)]
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory, transformers model) of each family, with a real tokenizer."""
    directory, hf = save_family_model(request.param, tmp_path_factory.mktemp(request.param), real_tokenizer=True)
    return request.param, directory, hf


@contextlib.asynccontextmanager
async def disaggregated(directory, dtype: str):
    """A prefill and a decode worker of ``directory``'s model, KV over NIXL, and a pool over them."""
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl"),
                            engine=make_engine(directory, dtype=dtype, num_blocks=64, block_size=BLOCK))
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend="nixl"),
                           engine=make_engine(directory, dtype=dtype, num_blocks=64, block_size=BLOCK))
    async with serving(prefill, [decoder]) as pool:
        yield prefill, decoder, pool


async def ask(pool, directory, rid: str, prompt: list[int], params: SamplingParams) -> RequestRun:
    """One request through the router's request path, run to its end."""
    model = ModelInfo("qwen3", config=None, max_model_len=2048, block_size=BLOCK, tokenizer=Tokenizer(directory))
    run = RequestRun(PreparedRequest(rid, prompt, params), model, pool, RouterLimits())
    run.responses_seen = [r async for r in run.responses()]
    return run


def tokens_of(run: RequestRun) -> list[int]:
    return [t for r in run.responses_seen for t in r.token_ids]


def test_float32_equals_transformers_and_the_prefix_is_reused(family):
    name, directory, hf = family
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def main():
        async with disaggregated(directory, "float32") as (prefill, decoder, pool):
            runs = [await ask(pool, directory, f"r{i}", p, greedy) for i, p in enumerate(PROMPTS)]
            await settle(prefill, [decoder])  # every lease released, every block free on both sides
            return runs, prefill.engine.runner.num_forward_tokens, decoder.engine.runner.num_forward_tokens

    runs, prefill_forward, decode_forward = asyncio.run(main())
    for prompt, run in zip(PROMPTS, runs):
        assert_greedy_matches(hf, prompt, tokens_of(run), MAX_TOKENS, what=f"{name}, prompt of {len(prompt)}")
    assert [run.output.cached_tokens for run in runs] == [0, 3 * BLOCK, 3 * BLOCK]
    assert prefill_forward == sum(len(p) for p in PROMPTS) - 2 * 3 * BLOCK  # the prefix computed once
    assert decode_forward == len(PROMPTS) * (MAX_TOKENS - 1)  # the KV moved: no prompt token recomputed


def test_bfloat16_is_logprob_close_and_structured_output_follows_its_schema(family):
    """One bfloat16 pair of workers for both checks (one start, not two): the logprob requests,
    then the structured ones under a cache salt of their own, so that they share no
    prefix-cache block with the first and are prefilled as on a pair of their own."""
    name, directory, hf = family
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
    structured = SamplingParams(max_tokens=40, structured=StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
                                cache_salt="structured")

    async def main():
        async with disaggregated(directory, "bfloat16") as (_, _, pool):
            close = [await ask(pool, directory, f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
            return close, [await ask(pool, directory, f"s{i}", p, structured) for i, p in enumerate(PROMPTS[:2])]

    close, schema = asyncio.run(main())
    ours = [Generation(tokens_of(run), [set(top.token_ids) for r in run.responses_seen for top in r.top_logprobs])
            for run in close]
    assert all(len(g.top_ids) == MAX_TOKENS for g in ours)
    check_logprobs_close(ours, [hf_generation(hf, p, MAX_TOKENS) for p in PROMPTS], f"pdserve {name} bfloat16",
                         "transformers float32")
    for run in schema:
        text = "".join(r.text for r in run.responses_seen)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert len(tokens_of(run)) > 1  # the decode worker went on from the prefill worker's first token


def test_a_ray_cluster_serves_a_local_qwen3_moe_directory(tmp_path):
    """``pdserve serve --model <dir>``'s path: Ray places a prefill and a decode worker (each
    its own process) that load the directory; the router reads its config; a token prompt over
    gRPC and a chat completion with a JSON schema over HTTP are answered."""
    directory, hf = save_family_model("qwen3-moe", tmp_path / "qwen3-moe", real_tokenizer=True)
    config = cluster_config(dtype="float32")
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=str(directory)))
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=PROMPTS[0]), sampling=pdserve_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    with running_cluster(config) as cluster, grpc.insecure_channel(cluster.address) as channel:
        tokens = [t for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120) for t in r.token_ids]
        client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Is it cold? Answer as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    assert_greedy_matches(hf, PROMPTS[0], tokens, MAX_TOKENS, what="through the Ray cluster")
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
