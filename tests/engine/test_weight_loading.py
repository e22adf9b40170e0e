"""Layers that load their own shard (pdserve/engine/layers/linear.py) from a checkpoint read
tensor by tensor (pdserve/engine/checkpoint.py), and the registry that is the list of families."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace as dataclasses_replace
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.checkpoint import InMemoryTensor, safetensors_tensors
from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from pdserve.engine.loader import load_model
from pdserve.engine.models import registry
from pdserve.engine.parallel import TensorParallel
from tests.factories import make_hf_model, save_hf_model

torch.manual_seed(0)
W = torch.randn(24, 10)  # a checkpoint tensor: 24 output rows, 10 input columns


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """W, a bias and a fused q|k|v in a real .safetensors file, read back lazily."""
    path = tmp_path_factory.mktemp("ckpt") / "w.safetensors"
    save_file({"w": W, "b": torch.arange(24.0), "qkv": torch.randn(4 * 6 + 2 * 6 + 2 * 6, 10)}, str(path))
    return {t.name: t for t in safetensors_tensors([path])}


@pytest.mark.parametrize("source", ["file", "memory"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_rows_or_columns(stored, source, rank):
    w = stored["w"] if source == "file" else InMemoryTensor("w", W)
    tp = TensorParallel(rank, 2)
    column = ColumnParallelLinear(10, 24, bias=False, tp=tp)
    column.load_weight("weight", w)
    assert torch.equal(column.weight.data, W[12 * rank:12 * (rank + 1)])
    row = RowParallelLinear(10, 24, bias=False, tp=tp)
    row.load_weight("weight", w)
    assert torch.equal(row.weight.data, W[:, 5 * rank:5 * (rank + 1)])


def test_a_row_parallel_bias_is_added_once_by_rank_0(stored):
    for rank in (0, 1):
        row = RowParallelLinear(10, 24, bias=True, tp=TensorParallel(rank, 2))
        row.load_weight("bias", stored["b"])
        assert torch.equal(row.bias.data, torch.arange(24.0) if rank == 0 else torch.zeros(24))


@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_takes_its_heads_whether_the_checkpoint_holds_q_k_v_apart_or_fused(stored, rank):
    """4 q heads and 2 KV heads, head_dim 6: rank r keeps q heads
    2r, 2r+1 and KV head r, from three tensors or from one fused tensor alike."""
    fused = stored["qkv"].read()  # (4*6 + 2*6 + 2*6, 10)
    q, k, v = fused[:24], fused[24:36], fused[36:48]
    tp = TensorParallel(rank, 2)
    apart, together = (QKVParallelLinear(10, 6, 4, 2, bias=False, tp=tp) for _ in range(2))
    for shard, t in (("q", q), ("k", k), ("v", v)):
        apart.load_weight("weight", InMemoryTensor(shard, t), shard)
    together.load_weight("weight", stored["qkv"], None)
    expect = torch.cat([q[12 * rank:12 * (rank + 1)], k[6 * rank:6 * (rank + 1)], v[6 * rank:6 * (rank + 1)]])
    assert torch.equal(apart.weight.data, expect) and torch.equal(together.weight.data, expect)


def test_merged_column_parts_are_each_split_over_the_ranks():
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for rank in (0, 1):
        merged = MergedColumnParallelLinear(4, [8, 8], bias=False, tp=TensorParallel(rank, 2))
        merged.load_weight("weight", InMemoryTensor("gate", gate), 0)
        merged.load_weight("weight", InMemoryTensor("up", up), 1)
        fused = MergedColumnParallelLinear(4, [8, 8], bias=False, tp=TensorParallel(rank, 2))
        fused.load_weight("weight", InMemoryTensor("gate_up", torch.cat([gate, up])))
        expect = torch.cat([gate[4 * rank:4 * (rank + 1)], up[4 * rank:4 * (rank + 1)]])
        assert torch.equal(merged.weight.data, expect) and torch.equal(fused.weight.data, expect)


def test_a_shape_that_disagrees_names_the_checkpoint_tensor(stored):
    with pytest.raises(ValueError, match=r"tensor w: shape \(24, 10\), expected \(24, 12\)"):
        ColumnParallelLinear(12, 24, bias=False).load_weight("weight", stored["w"])


def test_a_file_cut_short_is_a_corrupt_checkpoint(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": W}, str(path))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ModelLoadError, match="corrupt checkpoint: tensor w"):
        list(safetensors_tensors([path]))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def test_a_checkpoint_tensor_with_no_place_in_the_model_is_refused_by_name(tiny_llama, tmp_path):
    """An FP8 checkpoint's scales dropped without a word served wrong tokens with HTTP 200."""
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="q_proj.weight_scale: the model has no parameter"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), progress=False)


@pytest.mark.parametrize("model_type", sorted(registry.families()))
@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_every_family_refuses_a_quantized_checkpoint_by_method(model_type, method):
    family = registry.families()[model_type]
    config = {"model_type": model_type, "architectures": [family.architectures[0]],
              "quantization_config": {"quant_method": method}}
    with pytest.raises(ModelLoadError, match=rf"quantization_config \({method}\) is not supported"):
        registry.model_config_from_hf(config, "q")


def test_the_registry_is_the_list_of_families_and_finds_a_new_module(tmp_path, monkeypatch):
    """A family is one file: the registry finds a module that declares FAMILY, and nothing else
    in pdserve names an architecture."""
    from pdserve.engine import models

    (tmp_path / "toy.py").write_text(textwrap.dedent("""
        from pdserve.engine.models.family import Family
        from pdserve.engine.models.llama import read_config
        from pdserve.engine.models.decoder import CausalLM
        FAMILY = Family(architectures=("ToyForCausalLM",), model_types=("toy",), model=CausalLM,
                        read_config=read_config)
    """))
    with monkeypatch.context() as patch:
        patch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
        registry.families.cache_clear()
        try:
            assert "ToyForCausalLM" in registry.supported_architectures()
            cfg = registry.model_config_from_hf({**json.loads(_TOY), "model_type": "toy"}, "toy")
            assert cfg.model_type == "toy" and type(registry.build_model(cfg)).__name__ == "CausalLM"
        finally:
            registry.families.cache_clear()
    assert "ToyForCausalLM" not in registry.supported_architectures()
    sys.modules.pop("pdserve.engine.models.toy", None)
    named = subprocess.run(["git", "grep", "-l", "ForCausalLM\"", "--", "pdserve"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert all(path.startswith("pdserve/engine/models/") for path in named), named


_TOY = json.dumps(dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1))


def test_loading_holds_the_weights_and_one_tensor_not_a_float32_copy(tmp_path):
    """A bfloat16 checkpoint loaded in bfloat16 grows the process by its weights, one checkpoint
    tensor being read and one linear being packed for the CPU kernels (each at most the largest
    tensor). Before, every tensor of the checkpoint was held on the host next to the model (and
    the model made in float32 first): 177 MB for these 87 MB of weights, where this allows 153."""
    hf = make_hf_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20MB")
    weights = sum(p.numel() * 2 for p in hf.parameters())
    largest = max(p.numel() * 2 for p in hf.parameters())
    assert len(list(tmp_path.glob("*.safetensors"))) >= 3
    probe = textwrap.dedent(f"""
        import json, resource, torch
        from pdserve.engine.kernels import cpu_kernels
        from pdserve.engine.loader import load_model
        with torch.device("meta"):
            torch.nn.Embedding(2, 2)  # once a process, the meta kernels import ~150 MB of modules
        cpu_kernels.load()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        load_model({str(tmp_path)!r}, torch.bfloat16, torch.device("cpu"), progress=False)
        print(json.dumps([before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before, peak = json.loads(out.stdout.strip().splitlines()[-1])  # KiB, the child's own peak
    grew = (peak - before) * 1024
    assert grew <= 1.05 * weights + 2 * largest, (grew / 2**20, weights / 2**20, largest / 2**20)


def test_dummy_weights_need_only_the_config_and_hold_only_the_weights(tmp_path):
    """``--load-format dummy`` builds a model from config.json alone (no checkpoint in the
    directory), random on the device, and grows the process by its weights plus one linear
    being packed: no checkpoint read, no float32 copy."""
    from tests.factories import TINY_LLAMA

    shape = {**TINY_LLAMA, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
             "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = registry.model_config_from_hf(shape, "dummy")
    with torch.device("meta"):
        params = list(registry.build_model(cfg).parameters())
    weights, largest = sum(p.numel() * 2 for p in params), max(p.numel() * 2 for p in params)
    probe = textwrap.dedent(f"""
        import json, resource, torch
        from pdserve.engine import loader
        from pdserve.engine.kernels import cpu_kernels
        with torch.device("meta"):
            torch.nn.Embedding(2, 2)  # once a process, the meta kernels import ~150 MB of modules
        cpu_kernels.load()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        net, cfg, _ = loader.load_model({str(tmp_path)!r}, torch.bfloat16, torch.device("cpu"), progress=False,
                                        load_format="dummy")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        norm = net.layers[0].input_layernorm.weight
        print(json.dumps([before, peak, bool(torch.all(norm == 1)), float(net.embed_tokens.weight.abs().max())]))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before, peak, norms_one, largest_weight = json.loads(out.stdout.strip().splitlines()[-1])
    assert norms_one and 0 < largest_weight <= 0.0201  # 0.02, rounded to bfloat16
    assert (peak - before) * 1024 <= 1.05 * weights + largest, ((peak - before) / 1024, weights / 2**20)
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        dataclasses_replace(EngineConfig(), load_format="random")


def test_a_dummy_engine_serves_tokens_from_a_directory_without_weights(tmp_path):
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling.params import SamplingParams
    from tests.factories import TINY_LLAMA, engine_config

    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "llama"}))
    config = dataclasses_replace(engine_config(tmp_path), load_format="dummy")
    engine = LLMEngine.from_config(config, progress=False, detokenize=False)
    out = engine.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
