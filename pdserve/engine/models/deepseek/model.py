"""The DeepSeek-V2 / V2-Lite / V3 family: multi-head latent attention (MLA) over a latent
cache, and MoE layers with shared experts after ``first_k_dense_replace`` dense ones.

Per layer, as ``transformers`` computes it (DeepseekV2/V3 ``Attention``):
- q = q_proj(x) (V2-Lite), or q_b_proj(norm(q_a_proj(x))) (V3's low-rank query), split per
  head into q_nope (qk_nope_head_dim) and q_pe (qk_rope_head_dim);
- [c, k_pe] = kv_a_proj_with_mqa(x); c = kv_a_layernorm(c) is the latent, k_pe the one RoPE
  key all heads share. RoPE turns interleaved pairs (``MLAConfig.rope_layout``). What the
  cache stores per token is [c, k_pe]; attention/mla.py up-projects it with kv_b_proj;
- o_proj over the heads' values.

Tensor parallelism (``TensorParallel``): q_proj / q_b_proj and kv_b_proj are split by head
(their rows are head-major), o_proj by the matching input columns, followed by one
all-reduce; the low-rank projections, their norms and the gate are replicated, so every rank
computes, and caches, the whole latent (it has no head axis). MLPs and experts split in
width (layers/moe.py). The fused decoder-stack kernel is Llama's; these layers run one by one.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.checkpoint import CheckpointTensor, copy_checked
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import (RotaryEmbedding, apply_rotary, apply_rotary_complex,
                                          apply_rotary_interleaved)
from pdserve.engine.models.decoder import CausalLM, DecoderLayer
from pdserve.engine.models.deepseek.moe import DeepseekMoe
from pdserve.engine.parallel import TensorParallel

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


class UpProjection(nn.Module):
    """kv_b_proj's weight (nh * (nope + v), kv_lora_rank), this rank's heads, held as a plain
    parameter: the attention backend reads it whole (prefill) or per head (decode), so a linear
    backend must not pack it (linear.apply_backend packs ``nn.Linear`` modules only)."""

    def __init__(self, out_features: int, in_features: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.share(out_features, "num_attention_heads"), in_features))

    def load_weight(self, name: str, tensor: CheckpointTensor, shard=None) -> None:
        """This rank's heads' rows (the weight is head-major)."""
        rows = self.weight.shape[0]
        copy_checked(self.weight.data, tensor.read(0, self.tp.rank * rows, rows), tensor.name)


class MultiHeadLatentAttention(nn.Module):
    """MLA: this rank's heads; its cache view is (num_blocks, block_size, kv_lora + rope)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        mla, hidden, bias = cfg.mla, cfg.hidden_size, cfg.qkv_bias
        self.mla, self.tp = mla, tp
        self.nh = tp.share(cfg.num_heads, "num_attention_heads")
        q_out, heads = cfg.num_heads * mla.qk_head_dim, "num_attention_heads"  # split by head
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, bias=False, tp=tp, what=heads)
        else:  # the low-rank part and its norm are replicated
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, bias=False, tp=tp, what=heads)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = UpProjection(cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, tp)
        # All-reduced at once, in the model dtype (its partial sums are not handed on in float32).
        self.o_proj = RowParallelLinear(cfg.num_heads * mla.v_head_dim, hidden, bias=bias, tp=tp, what=heads,
                                        f32_partials=False)
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
        if index < cfg.moe.first_dense_layers:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        else:
            mlp = DeepseekMoe(cfg.hidden_size, cfg.moe, tp)
        super().__init__(cfg, MultiHeadLatentAttention(cfg, tp), mlp, tp)


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

    @classmethod
    def layer_kind(cls, cfg: ModelConfig, index: int) -> bool:
        """Two kinds: the first ``first_k_dense_replace`` layers' dense MLP, or the MoE."""
        return index < cfg.moe.first_dense_layers

    # Only gate and up are fused; q_proj, q_b_proj and kv_b_proj are whole projections here.
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """As every family's, but DeepSeek-V3's multi-token-prediction layer
        (``model.layers.<N>``, N = num_hidden_layers), which greedy decoding does not run, is skipped."""
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers" and int(parts[1]) >= self.cfg.num_layers:
            return None
        return super().checkpoint_target(name)
