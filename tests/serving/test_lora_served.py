"""Multi-LoRA served disaggregated (docs/lora.md#serving): the tiny random Llama and random
adapters in PEFT's format, a real prefill worker and two real decode workers in this process
(their gRPC servers, NIXL between them), and the real router; one decode worker runs without
--enable-lora, so every adapter's request must be routed past it.

- A request per adapter and a base one, at once: float32 greedy tokens equal transformers'
  with the adapter merged; the answer names the adapter.
- Two adapters sharing a system prompt: the second adapter's request finds no cached token of
  the first's; the same adapter's second request finds them.
- An adapter loaded and unloaded through the HTTP endpoints without a restart: served after the
  load on every worker of both pools, /v1/models lists it, vLLM's 404 after the unload; a bad
  adapter is refused naming the field.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.factories import hf_greedy
from tests.helpers.lora import make_adapter, merged
from tests.helpers.lora_serving import MAX_LORA_RANK, LoRACluster

NEW = 8
PROMPTS = {"": [5, 17, 93, 4, 250, 8, 61], "sql": [40, 41, 42, 43, 44, 45], "chat": [300, 2, 77, 19, 19, 6, 210]}


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    """(cluster, {adapter: (directory, merged transformers model)}); "late" is not loaded at start."""
    model_dir, hf = tiny_llama_dir
    adapters = {"": (None, hf)}
    for i, name in enumerate(("sql", "chat", "late")):
        directory = tmp_path_factory.mktemp(f"lora-{name}")
        adapters[name] = directory, merged(hf, make_adapter(hf, directory, seed=20 + i))
    modules = tuple((name, str(adapters[name][0])) for name in ("sql", "chat"))
    cluster = LoRACluster(model_dir, modules, decode_lora=(True, False))
    yield cluster, adapters
    cluster.stop()


def generate(address: str, model: str, prompt: list[int]) -> tuple[list[int], pdserve_pb2.Usage]:
    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        req = pdserve_pb2.GenerateRequest(model=model, token_ids=pdserve_pb2.TokenIds(ids=prompt),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=NEW, ignore_eos=True))
        resps = list(stub.Generate(req, timeout=120))
    return [t for r in resps for t in r.token_ids], resps[-1].usage


def test_each_adapter_and_the_base_model_at_once_equal_transformers_with_it_merged(served):
    cluster, adapters = served
    names = ["", "sql", "chat", "sql", "chat", ""]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda n: generate(cluster.grpc_address, n, PROMPTS[n])[0], names))
    for name, tokens in zip(names, outs):
        assert tokens == hf_greedy(adapters[name][1], PROMPTS[name], NEW), name
    assert outs[1] != hf_greedy(adapters[""][1], PROMPTS["sql"], NEW)  # the adapter changes the answer
    # (Each adapter's request decoded on decode-0: decode-1, without LoRA, would have refused it.)


def test_cached_tokens_are_per_adapter(served):
    cluster, _ = served
    system = list(range(100, 148))  # three full blocks of 16

    def complete(model: str, tail: list[int]) -> int:
        status, body = cluster.post("/v1/completions", {"model": model, "prompt": system + tail, "max_tokens": 2})
        assert status == 200, body
        answer = json.loads(body)
        assert answer["model"] == model
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert complete("sql", [7, 8, 9]) == 0
    assert complete("chat", [7, 8, 9]) == 0  # the same tokens, another adapter: none of sql's KV
    assert complete("sql", [10, 11]) == 48  # the same adapter: the system prompt's blocks


def test_an_adapter_loads_and_unloads_at_run_time_on_every_worker(served):
    cluster, adapters = served
    prompt = PROMPTS["chat"]
    status, body = cluster.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"][0])})
    assert status == 200, body
    lora_workers = [w for w in cluster.workers if w.engine.config.lora is not None]
    assert all("late" in w.engine.lora_names() for w in lora_workers)  # the prefill and the decode worker
    cards = {c["id"]: c for c in cluster.get("/v1/models")["data"]}
    assert cards["late"]["parent"] == "tiny" and cards["late"]["root"] == str(adapters["late"][0])
    assert generate(cluster.grpc_address, "late", prompt)[0] == hf_greedy(adapters["late"][1], prompt, NEW)

    status, body = cluster.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"][0])})
    assert status == 400 and '"param": "lora_name"' in body and "already been loaded" in body
    status, body = cluster.post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200, body
    assert not any("late" in w.engine.lora_names() for w in lora_workers)
    assert "late" not in {c["id"] for c in cluster.get("/v1/models")["data"]}
    status, body = cluster.post("/v1/completions", {"model": "late", "prompt": prompt, "max_tokens": 2})
    assert status == 404 and "The model `late` does not exist." in body


def test_a_bad_adapter_is_refused_naming_the_field_and_no_worker_keeps_it(served, tmp_path):
    cluster, adapters = served
    status, body = cluster.post("/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": str(tmp_path / "nope")})
    assert status == 400 and '"param": "lora_path"' in body, body
    big = tmp_path / "big"
    make_adapter(adapters[""][1], big, rank=2 * MAX_LORA_RANK)
    status, body = cluster.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert status == 400 and "max_lora_rank" in body, body
    assert not any({"ghost", "big"} & set(w.engine.lora_names()) for w in cluster.workers)
    status, body = cluster.post("/v1/unload_lora_adapter", {"lora_name": "ghost"})
    assert status == 404 and '"param": "lora_name"' in body
