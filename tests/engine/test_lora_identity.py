"""An adapter's KV is keyed by what it is, not by its name (docs/lora.md#kv-keyed-by-adapter):
an adapter unloaded and loaded again under its name from other files never meets the KV of the
weights it replaced, in this engine's prefix cache or in a KV tier another engine wrote; the
base model's hashes are those of before; and a router hashes an adapter's prompt as the workers
holding it do, or (where they disagree) so that it finds nothing."""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import KVTierConfig, LoRAConfig
from pdserve.engine.core.block_hashes import kv_salt
from pdserve.engine.core.block_manager import prompt_block_hashes
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.lora.manager import fingerprint_of
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import KVHandle
from pdserve.protos import worker_pb2
from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.shell import lora_rpcs
from tests.factories import engine_config, hf_greedy
from tests.helpers.engine_runs import run
from tests.helpers.lora import lora_engine, make_adapter, merged

NEW = 6
BS = 16
PROMPT = [(11 * i) % 450 + 5 for i in range(3 * BS + 4)]  # three full blocks a revisit can take


@pytest.fixture(scope="module")
def versions(tiny_llama_dir, tmp_path_factory):
    """Two versions of adapter "a" in two directories (other random weights): {v: (dir, merged hf)}."""
    _, hf = tiny_llama_dir
    out = {}
    for version, seed in (("v1", 41), ("v2", 42)):
        directory = tmp_path_factory.mktemp(f"lora-a-{version}")
        out[version] = directory, merged(hf, make_adapter(hf, directory, seed=seed))
    return out


def greedy(lora_name: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, lora_name=lora_name)


def test_a_reloaded_adapter_never_meets_the_old_weights_kv(tiny_llama_dir, versions):
    """a=v1 runs a prompt (its blocks cached); a is unloaded and loaded again from v2's files;
    the same prompt finds none of v1's blocks and its float32 tokens are transformers' with v2
    merged. Its second visit finds v2's own blocks."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, {"a": versions["v1"]})
    v1, v1_hits = run(engine, "v1", PROMPT, greedy("a"))
    assert v1 == hf_greedy(versions["v1"][1], PROMPT, NEW) and v1_hits == 0
    assert run(engine, "v1-again", PROMPT, greedy("a"))[1] >= 3 * BS  # cached under v1
    assert engine.remove_lora("a")
    engine.add_lora("a", str(versions["v2"][0]))
    tokens, hits = run(engine, "v2", PROMPT, greedy("a"))
    assert hits == 0  # none of v1's blocks, though the name and the prompt are the same
    assert tokens == hf_greedy(versions["v2"][1], PROMPT, NEW) != v1
    again, again_hits = run(engine, "v2-again", PROMPT, greedy("a"))
    assert again == tokens and again_hits >= 3 * BS
    engine.blocks.check_invariants()


def test_an_adapter_replaced_across_engines_finds_nothing_in_the_kv_tier(tiny_llama_dir, versions, tmp_path):
    """Two engines sharing a KV tier directory: the first writes a=v1's blocks there; the second,
    with a=v2 under the same name, loads none of them (and computes v2's tokens), while a third
    with the same v1 files loads them all: the tier is keyed by content, as the cache is."""
    model_dir, _ = tiny_llama_dir
    tier = KVTierConfig(64 << 20, str(tmp_path))

    def engine_with(version):
        config = dataclasses.replace(engine_config(model_dir, num_blocks=8, block_size=BS), kv_tier=tier,
                                     lora=LoRAConfig(max_loras=1, max_lora_rank=8, modules=(("a", str(versions[version][0])),)))
        model, model_cfg, _ = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
        return LLMEngine(model, model_cfg, config, model_dir=str(model_dir))

    first = engine_with("v1")
    run(first, "w", PROMPT, greedy("a"))
    others = [[(7 * i + 3 * k) % 400 + 9 for i in range(5 * BS + 3)] for k in range(2)]
    for k, other in enumerate(others):  # evict PROMPT's blocks down into the tier
        run(first, f"evict{k}", other, greedy("a"))
    first.kv_tier.flush()
    stored = first.kv_tier.stats().blocks_offloaded
    first.close()
    assert stored >= 3
    second = engine_with("v2")
    tokens, hits = run(second, "r", PROMPT, greedy("a"))
    assert hits == 0 and second.kv_tier.stats().blocks_loaded == 0
    assert tokens == hf_greedy(versions["v2"][1], PROMPT, NEW)
    second.close()
    third = engine_with("v1")
    tokens, hits = run(third, "r", PROMPT, greedy("a"))
    assert hits >= 3 * BS and tokens == hf_greedy(versions["v1"][1], PROMPT, NEW)
    third.close()


def test_the_base_models_hashes_are_unchanged_and_an_adapters_salt_is_its_content():
    """No adapter: the salt is ``cache_salt`` exactly, whatever fingerprint is passed, so the
    base model's block hashes are bit-equal to before. An adapter: name and fingerprint both
    count, and no client salt can name it."""
    base = SamplingParams(cache_salt="tenant")
    assert kv_salt(SamplingParams(), "") == kv_salt(SamplingParams(), "ff") == ""
    assert kv_salt(base, "ff") == "tenant"
    assert prompt_block_hashes(PROMPT, BS, kv_salt(SamplingParams(), "")) == prompt_block_hashes(PROMPT, BS)
    a = SamplingParams(lora_name="a")
    salts = {kv_salt(a, "f1"), kv_salt(a, "f2"), kv_salt(a, ""), kv_salt(SamplingParams(lora_name="b"), "f1")}
    assert len(salts) == 4 and all(s.startswith("\0") for s in salts)


def test_the_fingerprint_is_the_files_and_costs_little(tiny_llama_dir, versions, tmp_path):
    """The same files read twice: one fingerprint; one byte of the config changed: another."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, {"a": versions["v1"], "b": versions["v1"], "c": versions["v2"]})
    prints = engine.lora.fingerprints()
    assert prints["a"] == prints["b"] != prints["c"] and len(prints["a"]) == 32
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(versions["v1"][0]):
        data = (versions["v1"][0] / name).read_bytes()
        (copy / name).write_bytes(data.replace(b'"lora_alpha": 16', b'"lora_alpha": 16.0')
                                  if name == "adapter_config.json" else data)
    assert (copy / "adapter_config.json").read_bytes() != (versions["v1"][0] / "adapter_config.json").read_bytes()
    started = time.perf_counter()
    engine.add_lora("d", str(copy))
    assert time.perf_counter() - started < 5
    assert engine.lora.fingerprints()["d"] != prints["a"]


def stats_of(engine) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(lora_enabled=True, num_blocks_total=1000, **lora_rpcs.held_fields(engine))


def test_a_router_hashes_an_adapters_prompt_as_the_workers_holding_it_do(tiny_llama_dir, versions):
    """A real engine's stats: the router's salt for a's request is the engine's own, so the KV
    index finds the blocks the engine caches and a's request is routed to the worker holding
    them. Workers that disagree on a's content (one reloaded it): the router's salt is none of
    theirs and it finds nothing; a worker that reports names without fingerprints: the same."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, {"a": versions["v1"]})
    params = greedy("a")
    engine_salt = kv_salt(params, fingerprint_of(engine.lora, params))
    assert engine_salt == kv_salt(params, engine.lora.fingerprints()["a"])
    pool = WorkerPool()
    for address in ("p0", "p1"):
        pool.workers[address] = WorkerClient("prefill", address, channel=None, stub=None, healthy=True,
                                             stats=stats_of(engine))
        pool.index.apply(address, worker_pb2.CacheEvents(epoch="e1", snapshot=True), BS)
    assert pool.kv_salt(params) == engine_salt
    assert pool.kv_salt(greedy("")) == "" and pool.kv_salt(SamplingParams(cache_salt="t")) == "t"
    pool.index.expect("p1", PROMPT, engine_salt)  # p1 caches a's blocks, as its engine hashed them
    assert pool.prefill_overlaps(PROMPT, pool.kv_salt(params)) == {"p0": 0, "p1": 3 * BS}
    assert pool.prefill_overlaps(PROMPT, pool.kv_salt(greedy(""))) == {"p0": 0, "p1": 0}
    choice = pool.route_prefill(PROMPT, RoutingConfig(policy="kv"), cache_salt=pool.kv_salt(params), lora_name="a")
    assert choice.worker_id == "p1"
    engine.remove_lora("a")
    engine.add_lora("a", str(versions["v2"][0]))
    pool.workers["p0"].stats = stats_of(engine)  # p0 reloaded a from v2's files; p1 still has v1
    assert pool.lora_fingerprint("a") == "" and pool.kv_salt(params) != engine_salt
    assert pool.prefill_overlaps(PROMPT, pool.kv_salt(params)) == {"p0": 0, "p1": 0}
    pool.workers["p1"].stats = worker_pb2.WorkerStats(lora_enabled=True, lora_names=["a"])  # names only
    assert pool.lora_fingerprint("a") == ""
    pool.workers["p1"].stats = stats_of(engine)  # both on v2 now
    assert pool.kv_salt(params) == kv_salt(params, fingerprint_of(engine.lora, params)) != engine_salt


def test_kv_between_workers_that_loaded_other_files_under_one_name_is_refused(tiny_llama_dir, versions):
    """A KV handle states the salt its holder keyed the blocks by. A decode worker whose own salt
    for an adapter's request differs (the prefill worker ran a=v1, it runs a=v2) refuses the
    KV, naming lora_name, before it takes any block; the same salt, or the base model, is taken.
    The handle's salt survives the wire."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, {"a": versions["v2"]})
    here = SimpleNamespace(engine=engine, config=SimpleNamespace(decode_kv_reuse=True), _arriving={})
    params = greedy("a")
    other = kv_salt(params, "0" * 32)  # a's blocks as a worker that loaded other files hashes them
    own = kv_salt(params, engine.lora.fingerprints()["a"])
    free = engine.blocks.num_free_blocks
    with pytest.raises(InvalidRequestError) as refused:
        DecodeWorker._add_arriving(here, "r0", PROMPT, 7, params, other)
    assert refused.value.field == "lora_name" and engine.blocks.num_free_blocks == free
    assert not engine.has_unfinished()
    DecodeWorker._add_arriving(here, "r1", PROMPT, 7, params, own)
    DecodeWorker._add_arriving(here, "r2", PROMPT, 7, greedy(""), other)  # the base model: not an adapter's KV
    assert set(here._arriving) == {"r1", "r2"}
    handle = KVHandle("h:1", (1, 2), 20, "tok", (3, 4), other)
    assert KVHandle.from_proto(worker_pb2.KVHandle.FromString(handle.to_proto().SerializeToString())) == handle
