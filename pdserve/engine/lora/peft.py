"""Reading a PEFT LoRA adapter directory into the modules of a pdserve model.

A PEFT adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ``fan_in_fan_out``, ...) and ``adapter_model.safetensors``,
whose tensors are named after the module they adapt, as ``transformers`` names it:
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (A: (r, in)) and
``...q_proj.lora_B.weight`` (B: (out, r)). The adapted layer computes ``W x + s B A x`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).

pdserve fuses some checkpoint modules into one linear (q, k, v into ``qkv_proj``; gate and up
into ``gate_up_proj``): the family's ``packed_modules_mapping`` (``CausalLM.checkpoint_target``)
says which part of which of our linears each PEFT module is, so each part gets its own A and B.
The scale is folded into B here, once.

What is refused, by name (``InvalidRequestError("lora_path", ...)``): a missing directory or
file, a pickled ``adapter_model.bin`` (never unpickled), DoRA (``use_dora``), extra trained
modules (``modules_to_save``), trained biases (``bias`` other than "none"), per-module ranks or
alphas (``rank_pattern``, ``alpha_pattern``), a rank over ``max_lora_rank``, a tensor of a
module the model has no LoRA-able linear for (an embedding, the LM head), and a tensor whose
shape is not the module's.

Each adapter read gets a ``fingerprint``: an XXH3-128 digest of the bytes of its
``adapter_config.json`` and ``adapter_model.safetensors``, as read. Its KV blocks are keyed by it
(``pdserve.engine.core.block_hashes.kv_salt``), not by the name alone, so an adapter replaced
under the same name (another directory, retrained weights) never meets the old one's KV: in
this process's prefix cache, in a KV tier that outlived a restart, or on another worker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import xxhash
from safetensors.torch import load

from pdserve.engine.errors import InvalidRequestError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class TargetShape:
    """A LoRA-able linear of the model at whole-model sizes: its input width and the output
    width of each part (one part for a plain linear)."""

    in_features: int
    part_sizes: tuple[int, ...]
    parts: tuple[object, ...]  # the part names checkpoint_target gives (q, k, v; 0, 1; or None alone)


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read into host memory, whole (each rank takes its share when it fills a slot).

    ``weights``: (our module, part) -> (A (r, in), B (out, r) scaled by s), float32; part None
    is the whole module (a plain linear, or a fused one adapted as a whole)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[str, object], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str = ""  # hex digest of the files read (module docstring)

    @property
    def modules(self) -> set[str]:
        return {module for module, _ in self.weights}


def _refuse(message: str, limit: object = None) -> InvalidRequestError:
    return InvalidRequestError("lora_path", message, limit)


def read_config(directory: Path, max_rank: int, digest=None) -> tuple[int, float, bool]:
    """(rank, scale, fan_in_fan_out) from ``adapter_config.json``, or what it asks for refused.
    ``digest``: an xxhash object the file's bytes are fed to (the fingerprint's first part)."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise _refuse(f"{directory}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        raw = path.read_bytes()
        cfg = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise _refuse(f"{path}: not readable JSON ({exc})") from exc
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    if cfg.get("use_dora"):
        raise _refuse(f"{path}: use_dora is set; DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(f"{path}: modules_to_save {cfg['modules_to_save']!r}; adapters that train whole modules "
                      "are not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(f"{path}: bias {cfg['bias']!r}; adapters with trained biases are not supported (bias must "
                      "be 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(f"{path}: {key} is set; per-module ranks and alphas are not supported")
    if digest is not None:
        digest.update(len(raw).to_bytes(8, "little") + raw)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refuse(f"{path}: rank {rank} is over max_lora_rank {max_rank}", max_rank)
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scale), bool(cfg.get("fan_in_fan_out"))


def _tensors(directory: Path, digest) -> dict[str, torch.Tensor]:
    """The weights file's tensors; its bytes, read once, also go to ``digest``."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise _refuse(f"{directory}: adapter_model.bin is a pickle, which pdserve never loads; save the "
                          "adapter as adapter_model.safetensors (PEFT's default)")
        raise _refuse(f"{directory}: no {WEIGHTS_FILE}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _refuse(f"{path}: not readable ({exc})") from exc
    digest.update(len(raw).to_bytes(8, "little") + raw)
    try:
        return load(raw)
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise _refuse(f"{path}: not a readable safetensors file ({exc})") from exc


def _module_of(key: str) -> tuple[str, str]:
    """(PEFT module name without the wrapper's prefix, "A" or "B") of a tensor name."""
    name = key.removeprefix(_PREFIX)
    for which in ("A", "B"):
        for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
            if name.endswith(suffix):
                return name[:-len(suffix)], which
    raise _refuse(f"tensor {key!r} is not a LoRA A or B weight (lora_embedding and magnitude vectors are not "
                  "supported)")


def read_adapter(name: str, path: str, max_rank: int, targets: Mapping[str, TargetShape],
                 checkpoint_target: Callable[[str], tuple[str, object] | None]) -> LoRAAdapter:
    """Read the adapter at ``path`` for a model whose LoRA-able linears are ``targets`` (our
    module name -> shape); ``checkpoint_target`` maps a checkpoint weight name onto (our
    parameter, part) as the model loads its own weights. Raises ``InvalidRequestError``
    naming ``lora_path`` (module docstring)."""
    directory = Path(path)
    if not directory.is_dir():
        raise _refuse(f"{path}: no such directory")
    digest = xxhash.xxh3_128(b"pdserve lora\0")
    rank, scale, transposed = read_config(directory, max_rank, digest)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(directory, digest).items():
        module, which = _module_of(key)
        pairs.setdefault(module, {})[which] = tensor.float().t() if transposed else tensor.float()
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(f"module {module!r} has lora_{''.join(pair)} but not both A and B")
        where = checkpoint_target(module + ".weight")
        ours = where[0].removesuffix(".weight") if where else None
        if ours not in targets:
            raise _refuse(f"target module {module!r}: the model has no LoRA-able linear of that name (pdserve "
                          f"adapts {', '.join(sorted({t.rsplit('.', 1)[-1] for t in targets}))})")
        part = where[1]
        a, b = pair["A"], pair["B"]
        _check_shapes(module, targets[ours], part, a, b, rank)
        weights[(ours, part)] = (a.contiguous(), (b * scale).contiguous())
    if not weights:
        raise _refuse(f"{directory / WEIGHTS_FILE}: holds no LoRA weights")
    return LoRAAdapter(name, str(directory), rank, weights, digest.hexdigest())


def _check_shapes(module: str, shape: TargetShape, part: object, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    """A (r, in) and B (out, r) of the part's sizes, or the module refused."""
    out = sum(shape.part_sizes) if part is None else shape.part_sizes[shape.parts.index(part)]
    if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, shape.in_features) or b.shape != (out, rank):
        raise _refuse(f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the model needs "
                      f"({rank}, {shape.in_features}) and ({out}, {rank})")
