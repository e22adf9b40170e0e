"""Multi-LoRA in the engine (docs/lora.md): adapters read from PEFT's format, served mixed in one
batch with the base model, each token equal to transformers' greedy output with that adapter
merged; KV keyed by adapter; adapters added and removed at run time; what is refused."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.config import LoRAConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import engine_config, hf_greedy
from tests.helpers.lora import make_adapter, merged

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


def lora_engine(model_dir, adapters=None, max_loras: int = 2, max_lora_rank: int = 8, **kwargs) -> LLMEngine:
    modules = tuple((name, str(d)) for name, (d, _) in (adapters or {}).items())
    config = dataclasses.replace(engine_config(model_dir, **kwargs),
                                 lora=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, modules=modules))
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, model_dir=str(model_dir))


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
