"""Loading errors name the path and the reason."""

import json

import pytest

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.loader import load_model, resolve_model_path
import torch


def load(path):
    return load_model(str(path), torch.float32, torch.device("cpu"), progress=False)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file") as err:
        load(tmp_path / "nope")
    assert err.value.path.endswith("nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load(tmp_path)


def test_corrupt_safetensors(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ModelLoadError, match="corrupt checkpoint") as err:
        load(tmp_path)
    assert "model.safetensors" in err.value.path


def test_checkpoint_missing_tensors(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = tiny_llama_dir
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensors.*layers.1.mlp.down_proj"):
        load(tmp_path)


def test_wrong_shape_is_reported_with_the_tensor_name(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = tiny_llama_dir
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        load(tmp_path)


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable GGUF") as err:
        load(bad)
    assert err.value.path == str(bad)


def test_default_model_resolves_to_the_wheel_gguf():
    path = resolve_model_path("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
