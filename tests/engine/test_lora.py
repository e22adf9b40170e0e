"""Multi-LoRA in the engine (docs/lora.md): adapters read from PEFT's format, served mixed in one
batch with the base model, each token equal to transformers' greedy output with that adapter
merged; KV keyed by adapter; adapters added and removed at run time; what is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from safetensors.torch import load_file, save_file

from pdserve.engine.core.block_hashes import kv_salt
from pdserve.engine.core.block_manager import prompt_block_hashes
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.config import LoRAConfig
from tests.factories import hf_greedy, make_engine, make_tp_engine
from tests.helpers.lora import lora_engine, make_adapter, merged

PROMPTS = [[5, 17, 93, 4, 250, 8, 61], [40, 41, 42, 43, 44], [300, 2, 77, 19, 19, 6, 210, 3, 99]]
NEW = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Two random rank-8 adapters on q, k, v, o, gate, up and down of the tiny Llama:
    {name: (directory, transformers model with it merged)}."""
    _, hf = tiny_llama_dir
    out = {}
    for i, name in enumerate(("alpha", "beta")):
        directory = tmp_path_factory.mktemp(f"lora-{name}")
        out[name] = directory, merged(hf, make_adapter(hf, directory, seed=10 + i))
    return out


def greedy(lora_name: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, lora_name=lora_name)


def test_one_batch_mixes_adapters_and_the_base_model(tiny_llama_dir, adapters):
    """Base, alpha and beta requests (two of each, on different prompts) in one batch: each
    sequence's float32 greedy tokens equal transformers' on the weights it names."""
    model_dir, hf = tiny_llama_dir
    engine = lora_engine(model_dir, adapters)
    names = ["", "alpha", "beta", "beta", "", "alpha"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    done = engine.generate(prompts, [greedy(n) for n in names])
    refs = {"": hf, "alpha": adapters["alpha"][1], "beta": adapters["beta"][1]}
    for name, prompt, completion in zip(names, prompts, done):
        assert completion.token_ids == hf_greedy(refs[name], prompt, NEW), name
    assert done[1].token_ids != hf_greedy(hf, prompts[1], NEW)  # the adapter changes the answer


def test_without_adapters_a_step_is_bit_identical(tiny_llama_dir, adapters):
    """An engine with LoRA on, serving only the base model, gives the tokens and logprobs of one
    without LoRA, bit for bit (its adapted linears return the base output untouched)."""
    model_dir, _ = tiny_llama_dir
    params = dataclasses.replace(greedy(), logprobs=True)
    plain = make_engine(model_dir).generate(PROMPTS, params)
    with_lora = lora_engine(model_dir, adapters).generate(PROMPTS, params)
    assert [c.token_ids for c in with_lora] == [c.token_ids for c in plain]
    assert [c.logprobs for c in with_lora] == [c.logprobs for c in plain]


def test_adapters_never_share_kv(tiny_llama_dir, adapters):
    """The same 40-token prompt under alpha, beta and the base model: cached only within
    one adapter (kv_salt), never across; the base model's hashes are the unsalted ones."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, adapters)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]

    asked = []

    def cached(lora_name: str) -> int:
        rid = f"r{len(asked)}"
        asked.append(rid)
        engine.add_request(rid, prompt, dataclasses.replace(greedy(lora_name), max_tokens=2))
        engine.step()  # its prompt, from the prefix cache where it can
        hit = engine.num_cached_tokens(rid)
        while engine.has_unfinished():
            engine.step()
        return hit

    assert cached("alpha") == 0
    assert cached("alpha") > 0
    assert cached("beta") == 0
    assert cached("") == 0
    assert cached("") > 0
    assert kv_salt(greedy(""), "") == "" and kv_salt(dataclasses.replace(greedy("alpha"), cache_salt="t"), "f") != "t"
    assert prompt_block_hashes(prompt, 16, kv_salt(greedy(""), "")) == prompt_block_hashes(prompt, 16)


def test_more_adapters_than_slots_take_turns(tiny_llama_dir, adapters):
    """One slot (max_loras=1), requests of alpha, beta and the base model together: no step holds
    two adapters, and every sequence still gets its own adapter's tokens."""
    model_dir, hf = tiny_llama_dir
    engine = lora_engine(model_dir, adapters, max_loras=1)
    seen = []
    begin = engine.lora.begin_step

    def spy(names, counts):
        seen.append({n for n in names if n})
        begin(names, counts)

    engine.lora.begin_step = spy
    names = ["alpha", "beta", "", "alpha"]
    done = engine.generate([PROMPTS[0]] * 4, [greedy(n) for n in names])
    refs = {"": hf, "alpha": adapters["alpha"][1], "beta": adapters["beta"][1]}
    for name, completion in zip(names, done):
        assert completion.token_ids == hf_greedy(refs[name], PROMPTS[0], NEW), name
    assert max(len(s) for s in seen) == 1 and {"alpha", "beta"} <= set().union(*seen)


def test_adapters_come_and_go_at_run_time(tiny_llama_dir, adapters):
    model_dir, hf = tiny_llama_dir
    engine = lora_engine(model_dir)
    assert engine.lora_names() == []
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("r0", PROMPTS[0], greedy("alpha"))
    assert refused.value.field == "model" and "alpha" in str(refused.value)
    engine.add_lora("alpha", str(adapters["alpha"][0]))
    assert engine.lora_names() == ["alpha"]
    engine.add_request("r1", PROMPTS[0], greedy("alpha"))
    engine.step()
    with pytest.raises(InvalidRequestError, match="in use by 1 requests") as in_use:
        engine.remove_lora("alpha")
    assert in_use.value.field == "lora_name"
    while engine.has_unfinished():
        engine.step()
    assert engine.remove_lora("alpha") is True and engine.remove_lora("alpha") is False
    assert engine.lora_names() == []
    engine.add_lora("alpha", str(adapters["beta"][0]))  # a name is free again once removed
    done = engine.generate([PROMPTS[1]], greedy("alpha"))
    assert done[0].token_ids == hf_greedy(adapters["beta"][1], PROMPTS[1], NEW)


def test_what_is_refused(tiny_llama_dir, adapters, tmp_path):
    model_dir, hf = tiny_llama_dir
    engine = lora_engine(model_dir, max_lora_rank=8)
    alpha = str(adapters["alpha"][0])

    def refusal(path, name="x") -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as exc:
            engine.add_lora(name, str(path))
        return exc.value

    make_adapter(hf, tmp_path / "r16", rank=16)
    big = refusal(tmp_path / "r16")
    assert big.field == "lora_path" and big.limit == 8 and "max_lora_rank 8" in str(big)
    for key, value in [("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")]:
        make_adapter(hf, tmp_path / key, **{key: value})
        assert key in str(refusal(tmp_path / key)), key
    assert refusal(tmp_path / "nowhere").field == "lora_path"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text((adapters["alpha"][0] / "adapter_config.json").read_text())
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"pickle")
    assert "adapter_model.bin" in str(refusal(tmp_path / "bin"))
    lm_head = tmp_path / "lm_head"
    make_adapter(hf, lm_head)
    tensors = load_file(str(lm_head / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(512, 8)
    save_file(tensors, str(lm_head / "adapter_model.safetensors"))
    assert "lm_head" in str(refusal(lm_head))
    engine.add_lora("alpha", alpha)
    assert refusal(alpha, "alpha").field == "lora_name"
    assert engine.lora_names() == ["alpha"]  # nothing refused was kept
    plain = make_engine(model_dir)
    with pytest.raises(InvalidRequestError, match="no LoRAConfig"):
        plain.add_lora("alpha", alpha)
    with pytest.raises(InvalidRequestError) as unknown:
        plain.validate(PROMPTS[0], greedy("alpha"))
    assert unknown.value.field == "model"


@pytest.mark.slow
def test_tp2_serves_adapters_as_tp1_and_transformers(tiny_llama_dir, adapters):
    """Two ranks, two slots, three adapters (alpha at start, beta and gamma loaded at run time,
    gamma alpha's weights under another name) and the base model in one batch: the steps take
    turns with the slots and evict, and the other rank follows rank 0's loads, unloads and
    slots. Each sequence's float32 greedy tokens equal TP 1's and transformers' with its
    adapter merged; after an unload and a reload, still."""
    model_dir, hf = tiny_llama_dir
    alpha, beta = (str(adapters[n][0]) for n in ("alpha", "beta"))
    engine = make_tp_engine(model_dir, 2, num_blocks=64,
                            lora=LoRAConfig(max_loras=2, max_lora_rank=8, modules=(("alpha", alpha),)))
    try:
        engine.add_lora("beta", beta)
        engine.add_lora("gamma", alpha)
        refs = {"": hf, "alpha": adapters["alpha"][1], "beta": adapters["beta"][1], "gamma": adapters["alpha"][1]}
        names = ["", "alpha", "beta", "gamma", "beta"]
        prompts = [PROMPTS[i % 3] for i in range(len(names))]
        done = engine.generate(prompts, [greedy(n) for n in names])
        tp1 = lora_engine(model_dir, {n: adapters[n] for n in ("alpha", "beta")})
        tp1.add_lora("gamma", alpha)
        assert [c.token_ids for c in done] == [c.token_ids for c in tp1.generate(prompts, [greedy(n) for n in names])]
        for name, prompt, completion in zip(names, prompts, done):
            assert completion.token_ids == hf_greedy(refs[name], prompt, NEW), name
        assert engine.remove_lora("beta") is True
        engine.add_lora("beta2", beta)  # a new id on every rank, into the slot beta left
        again = engine.generate(prompts[1:3], [greedy("alpha"), greedy("beta2")])
        assert [c.token_ids for c in again] == [c.token_ids for c in done[1:3]]
    finally:
        engine.close()
