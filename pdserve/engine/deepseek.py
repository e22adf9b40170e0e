"""The DeepSeek-V2 / V2-Lite / V3 family: multi-head latent attention (MLA) over a latent
cache, and MoE layers with shared experts after ``first_k_dense_replace`` dense ones.

Per layer, as ``transformers`` computes it (DeepseekV2/V3 ``Attention``):
- q = q_proj(x) (V2-Lite), or q_b_proj(norm(q_a_proj(x))) (V3's low-rank query), split per
  head into q_nope (qk_nope_head_dim) and q_pe (qk_rope_head_dim);
- [c, k_pe] = kv_a_proj_with_mqa(x); c = kv_a_layernorm(c) is the latent, k_pe the one RoPE
  key all heads share. RoPE turns interleaved pairs (``MLAConfig.rope_layout``). What the
  cache stores per token is [c, k_pe]; attention_mla.py up-projects it with kv_b_proj;
- o_proj over the heads' values.

Tensor parallelism (``TensorParallel``): q_proj / q_b_proj and kv_b_proj are split by head
(their rows are head-major), o_proj by the matching input columns, followed by one
all-reduce; the low-rank projections, their norms and the gate are replicated, so every rank
computes, and caches, the whole latent (it has no head axis). MLPs and experts split in
width (moe.py). The fused decoder-stack kernel is Llama's; these layers run one by one.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pdserve.engine.attention import AttentionContext
from pdserve.engine.config import ModelConfig
from pdserve.engine.deepseek_moe import DeepseekMoe
from pdserve.engine.model import CausalLM, DecoderLayer, RMSNorm
from pdserve.engine.moe import GatedMLP
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.rope import (RotaryEmbedding, apply_rotary, apply_rotary_complex,
                                 apply_rotary_interleaved)

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


class UpProjection(nn.Module):
    """kv_b_proj's weight (nh * (nope + v), kv_lora_rank), held as a plain parameter: the
    attention backend reads it whole (prefill) or per head (decode), so a linear backend
    must not pack it (linear.apply_backend packs ``nn.Linear`` modules only)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MultiHeadLatentAttention(nn.Module):
    """MLA: this rank's heads; its cache view is (num_blocks, block_size, kv_lora + rope)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        mla, hidden, bias = cfg.mla, cfg.hidden_size, cfg.qkv_bias
        self.mla, self.tp = mla, tp
        self.nh = tp.share(cfg.num_heads, "num_attention_heads")
        q_out = self.nh * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = UpProjection(self.nh * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = nn.Linear(self.nh * mla.v_head_dim, hidden, bias=bias)
        self.backend = None  # set by the model runner
        self.cache: torch.Tensor | None = None

    def bind_cache(self, cache: torch.Tensor, backend) -> None:
        self.cache, self.backend = cache, backend

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        """x (T, hidden), rope = cos, sin (T, 1, rope dim) -> (T, hidden), all-reduced."""
        t, mla = x.shape[0], self.mla
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.nh, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())  # (T, kv_lora)
        q_pe, k_pe = self._rotate(q_pe, k_pe.unsqueeze(1), rope)
        latent = torch.cat((c, k_pe.squeeze(1)), dim=-1)  # (T, kv_lora + rope): what the cache keeps
        out = self.backend.attend(q_nope, q_pe, latent, self.cache, ctx, self.kv_b_proj.weight)  # (T, nh, v)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.nh * mla.v_head_dim)))

    def _rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q_pe (T, nh, rd), k_pe (T, 1, rd) rotated in the checkpoint's layout."""
        layout = self.mla.rope_layout
        if layout == "halves":
            return apply_rotary(q_pe, k_pe, *rope)
        turn = apply_rotary_interleaved if layout == "interleaved" else apply_rotary_complex
        return turn(q_pe, *rope), turn(k_pe, *rope)


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's pre-norm residual layer (its ``forward``) around MLA and a dense MLP (the
    first ``first_k_dense_replace`` layers) or the MoE."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if index < cfg.moe.first_dense_layers:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        else:
            self.mlp = DeepseekMoe(cfg.hidden_size, cfg.moe, tp)


class Float32Rotary(RotaryEmbedding):
    """DeepSeek-V2 rotates in float32 whatever the model's dtype (a complex multiply)."""

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return super().tables(positions, torch.float32)


class DeepseekForCausalLM(CausalLM):
    """``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``: this rank's share of them."""

    packed_stack = False

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        kind = Float32Rotary if cfg.mla.rope_layout == "complex" else RotaryEmbedding
        return kind(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DeepseekDecoderLayer(cfg, index, self.tp)

    @staticmethod
    def split_dims(cfg: ModelConfig) -> tuple[tuple[int, str], ...]:
        """The attention heads (the latent is replicated, not split); the dense layers' width
        where there are any; each routed expert's and the shared experts' width."""
        moe = cfg.moe
        dims = [(cfg.num_heads, "num_attention_heads"), (moe.intermediate_size, "moe_intermediate_size")]
        if moe.first_dense_layers:
            dims.append((cfg.intermediate_size, "intermediate_size"))
        if moe.shared_intermediate_size:
            dims.append((moe.shared_intermediate_size, "moe_intermediate_size * n_shared_experts"))
        return tuple(dims)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy a ``transformers``-named state dict in: this rank's share of each tensor, gate
        and up fused. Skips DeepSeek-V3's multi-token-prediction layer (``model.layers.<N>``,
        N = num_hidden_layers), which greedy decoding does not run. Returns the parameters that
        received nothing; raises ValueError on a shape mismatch naming the tensor."""
        params = dict(self.named_parameters())
        params.update(self.named_buffers())
        filled: set[str] = set()
        for hf_name, tensor in weights.items():
            target = _target_of(hf_name, self.cfg)
            if target is None or target[0] not in params:
                continue
            name, dim, slot = target
            if dim is not None:
                tensor = self.tp.narrow(tensor, dim, hf_name)
            elif name.endswith("o_proj.bias") and self.tp.rank:
                tensor = torch.zeros_like(tensor)  # a row-split linear's bias is added once, by rank 0
            param = params[name]
            dst = param.data if slot is None else param.data.narrow(0, slot * tensor.shape[0], tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(f"tensor {hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.add(name)
        return [n for n, _ in self.named_parameters() if n not in filled]


# transformers' suffix -> (ours, the dimension split across ranks, slot in a fused gate|up)
_SHARDS = {
    ".gate_proj.weight": (".gate_up_proj.weight", 0, 0),
    ".up_proj.weight": (".gate_up_proj.weight", 0, 1),
    ".down_proj.weight": (".down_proj.weight", 1, None),
    ".q_proj.weight": (".q_proj.weight", 0, None),
    ".q_b_proj.weight": (".q_b_proj.weight", 0, None),
    ".kv_b_proj.weight": (".kv_b_proj.weight", 0, None),
    ".o_proj.weight": (".o_proj.weight", 1, None),
}


def _target_of(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None, int | None] | None:
    """(our parameter, split dimension or None, gate|up slot or None), or None to skip."""
    name = hf_name.removeprefix("model.")
    if (name == "lm_head.weight" and cfg.tie_word_embeddings) or "rotary_emb" in name:
        return None
    parts = name.split(".")
    if parts[0] == "layers" and int(parts[1]) >= cfg.num_layers:  # V3's MTP module
        return None
    for suffix, (ours, dim, slot) in _SHARDS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ours, dim, slot
    return name, None, None
