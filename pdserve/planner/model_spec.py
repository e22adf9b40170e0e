"""What the cost model needs to know about a model: its shape, from which parameters, FLOPs
per token and KV bytes per token follow. Built from an engine ``ModelConfig`` (a HF config)
or a named preset (the published configs of well-known models, written out here)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ModelConfig


class ModelSpecError(ValueError):
    """A model name is unknown or a value is out of range; ``field`` names it."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    mlp_matrices: int = 3  # gated MLP (Llama: gate, up, down) = 3; OPT's plain fc1/fc2 = 2

    @property
    def shape(self) -> tuple[int, ...]:
        """What its step times depend on (not its name or context limit)."""
        return (self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.intermediate_size, self.vocab_size, self.mlp_matrices)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "max_model_len"):
            if getattr(self, key) <= 0:
                raise ModelSpecError(key, f"must be > 0, got {getattr(self, key)}")

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        return attention + self.mlp_matrices * h * self.intermediate_size

    @property
    def decoder_params(self) -> int:
        """Parameters every token runs through (all layers, without embedding and LM head)."""
        return self.num_layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs of the decoder's matmuls for one token (2 per multiply-add)."""
        return 2.0 * self.decoder_params

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of the LM head for one sampled token (prefill samples only the last one)."""
        return 2.0 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query, key) pair over all layers: QK^T and PV, 2 FLOPs per multiply-add each."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    def weight_bytes(self, dtype_bytes: int) -> float:
        """Bytes a decode step streams: decoder and LM head (the embedding is a row lookup)."""
        return (self.decoder_params + self.lm_head_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def spec_from_config(cfg: ModelConfig, name: str = "model") -> ModelSpec:
    """A spec from the engine's ``ModelConfig`` (what ``pdserve.engine.config.model_config_from_hf`` reads)."""
    return ModelSpec(name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.vocab_size, cfg.max_model_len)


# Published config.json values of each model.
PRESETS = {
    "SmolLM2-135M": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 8192),
    "Llama-3.1-8B": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "Llama-3.1-70B": ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
    # OPT: multi-head attention, a 2-matrix ReLU MLP, 2048-token context (DistServe's model).
    "OPT-13B": ModelSpec("OPT-13B", 40, 5120, 40, 40, 128, 20480, 50272, 2048, mlp_matrices=2),
}


def get_model(name: str) -> ModelSpec:
    """A preset by name, or a spec read from a HF model directory's config.json."""
    if name in PRESETS:
        return PRESETS[name]
    from pathlib import Path
    import json

    from pdserve.engine.config import model_config_from_hf

    config_path = Path(name) / "config.json"
    if config_path.exists():
        return spec_from_config(model_config_from_hf(json.loads(config_path.read_text()), str(config_path)),
                                Path(name).name)
    raise ModelSpecError("model", f"unknown model {name!r}; expected one of {sorted(PRESETS)} "
                                  "or a directory with a config.json")
