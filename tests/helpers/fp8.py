"""FP8 checkpoints for the tests (tests/engine/test_fp8.py, test_fp8_matmul.py,
tests/gpu/test_fp8_on_device.py): a transformers model's decoder projections quantized to
float8 e4m3 with a scale per tensor, per output row or per block, as H100 checkpoints ship,
saved beside the dequantized weights the oracle runs on."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tests.factories import load_reference

E4M3_MAX = 448.0
BLOCK = (16, 16)


def quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, its scale) as a checkpoint holds them: the scale maps each group's
    largest magnitude to e4m3's largest."""
    if layout == "tensor":
        scale = weight.abs().max().clamp(min=1e-12) / E4M3_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(())
    if layout == "row":
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale
    rows, cols = weight.shape
    pad = torch.zeros(-(-rows // BLOCK[0]) * BLOCK[0], -(-cols // BLOCK[1]) * BLOCK[1])
    pad[:rows, :cols] = weight
    blocks = pad.reshape(pad.shape[0] // BLOCK[0], BLOCK[0], pad.shape[1] // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # (row blocks, column blocks)
    full = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def quantized(name: str, param: torch.Tensor) -> bool:
    """The projections of the decoder layers, as FP8 checkpoints quantize them (not the
    embedding, the LM head, the norms, the MoE router or DeepSeek's low-rank up-projection)."""
    return param.dim() == 2 and ".layers." in name and name.endswith("proj.weight") and "kv_b_proj" not in name


def save_fp8(hf, directory, layout: str):
    """Save ``hf`` as an FP8 checkpoint in ``directory`` and its dequantized weights, under the
    same checkpoint names, in ``directory``/dequantized; returns transformers' model of the
    latter (the oracle runs on exactly what the engine will read) and how many weights are float8."""
    from safetensors.torch import load_file

    plain = directory / "dequantized"
    hf.save_pretrained(str(plain), safe_serialization=True)
    tensors, back, count = {}, load_file(str(plain / "model.safetensors")), 0
    for name, param in list(back.items()):
        if not quantized(name, param):
            tensors[name] = param
            continue
        weight, scale = quantize(param.float(), layout)
        tensors[name] = weight
        tensors[name + ("_scale_inv" if layout == "block" else "_scale")] = scale
        tensors[name.replace(".weight", ".input_scale")] = torch.ones(())  # static activations: dropped
        full = scale if layout != "block" else (scale.repeat_interleave(BLOCK[0], 0)[:param.shape[0]]
                                                .repeat_interleave(BLOCK[1], 1)[:, :param.shape[1]])
        back[name] = (weight.float() * full).contiguous()
        count += 1
    save_file(back, str(plain / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                     **({"weight_block_size": list(BLOCK)} if layout == "block" else {})}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return load_reference(plain, torch.float32), count
