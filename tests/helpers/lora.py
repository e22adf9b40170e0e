"""LoRA adapters for tests, written by hand in PEFT's own format (adapter_config.json and
adapter_model.safetensors, tensors named as PEFT saves them), and transformers models with an
adapter merged into their weights, as PEFT's ``merge_and_unload`` merges it (W + s B A): the
oracle a served adapter's greedy tokens are checked against. PEFT itself is not installed in
this project's environment; the format is its documented one."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.engine.config import LoRAConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from tests.factories import engine_config

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's checkpoint modules, fused ones adapted whole


def _is_attn(module: str) -> bool:
    return module in ATTN or module == "qkv_proj"


def _hf_linear(hf_model, layer: int, module: str) -> torch.nn.Linear:
    block = hf_model.model.layers[layer]
    return getattr(block.self_attn if _is_attn(module) else block.mlp, module)


def make_adapter(hf_model, directory: Path, rank: int = 8, alpha: int = 16, seed: int = 0,
                 modules: tuple[str, ...] = ATTN + MLP, std: float = 0.1, **config) -> dict:
    """Save a random adapter of ``hf_model`` (B non-zero: PEFT starts B at zero, which would test
    nothing) in ``directory``; returns {(layer, module): (A, B)} and the scale under "scale"."""
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for layer in range(len(hf_model.model.layers)):
        for module in modules:
            lin = _hf_linear(hf_model, layer, module)
            a = torch.randn(rank, lin.in_features, generator=g) * std
            b = torch.randn(lin.out_features, rank, generator=g) * std
            part = "self_attn" if _is_attn(module) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            weights[(layer, module)] = (a, b)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    cfg = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, target_modules=list(modules),
               use_rslora=False, fan_in_fan_out=False, bias="none", modules_to_save=None, use_dora=False,
               lora_dropout=0.0, rank_pattern={}, alpha_pattern={})
    cfg.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    weights["scale"] = alpha / rank
    return weights


def merged(hf_model, weights: dict):
    """A copy of ``hf_model`` with the adapter merged into its weights (PEFT's merge_and_unload)."""
    out = copy.deepcopy(hf_model)
    with torch.no_grad():
        for key, (a, b) in ((k, v) for k, v in weights.items() if k != "scale"):
            _hf_linear(out, *key).weight += weights["scale"] * (b @ a)
    return out


def lora_engine(model_dir, adapters=None, max_loras: int = 2, max_lora_rank: int = 8, **kwargs) -> LLMEngine:
    """An engine on ``model_dir`` with LoRA on and ``adapters`` ({name: (directory, ...)}) loaded;
    ``kwargs`` as ``tests.factories.engine_config`` takes them."""
    modules = tuple((name, str(entry[0])) for name, entry in (adapters or {}).items())
    config = dataclasses.replace(engine_config(model_dir, **kwargs),
                                 lora=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, modules=modules))
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, model_dir=str(model_dir))
