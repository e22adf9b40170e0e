"""The Qwen3 family: Qwen3 (dense) and Qwen3-MoE, over the same packed tokens as model.py.

What differs from Llama (model.py), and nothing else:
- attention has an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, one weight of
  head_dim shared by the heads), applied after the projection and before RoPE, as
  ``transformers`` does; ``head_dim`` comes from the config and need not be hidden / heads
  (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024); there are no q/k/v biases;
- Qwen3-MoE: the MLP of layer i is routed experts (pdserve/engine/moe.py) when ``(i + 1) %
  decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``, a dense MLP otherwise.

Tensor parallelism, Megatron's split: q|k|v by heads and gate|up by intermediate width
(column-parallel), o_proj and down_proj by input columns (row-parallel) with one all-reduce
each; each expert is split in width (moe.py). The q/k norms act within a head, so they are
replicated. ``load_hf_weights`` cuts each checkpoint tensor to this rank's share as it copies.

The decoder layers are model.py's ``DecoderLayer`` with this file's attention and MLP in it,
so the norms, the residual stream and everything around the layers (embedding, final norm,
LM head, cache binding) are ``CausalLM``'s. The packed CPU backend runs these layers one by
one (its fused whole-stack call is Llama's layer exactly: pdserve/engine/linear.py).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pdserve.engine.attention import AttentionContext
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import Attention, CausalLM, DecoderLayer, RMSNorm
from pdserve.engine.moe import GatedMLP, RoutedExperts, SoftmaxTopKGate, SparseMoe
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.weights import Target, load_weights


class Qwen3Attention(Attention):
    """This rank's heads of Qwen3 attention: Llama's (model.py), with per-head q/k RMSNorm
    applied before the backend's RoPE and cache store."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        # Normalize q and k in place, head by head, so the backend's fused split + RoPE + store
        # (the CPU paged kernel's) takes the one q|k|v tensor as for Llama.
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(t, self.nh, self.hd)).reshape(t, self.q_size))
        k.copy_(self.k_norm(k.reshape(t, self.nkv, self.hd)).reshape(t, self.kv_size))
        out = self.backend.attend(qkv, rope, self.k_cache, self.v_cache, ctx, self.nh, self.nkv, self.hd)  # (T, nh, hd)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size))).to(x.dtype)


def qwen3_mlp(cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
    """Layer ``layer``'s MLP: routed experts where the MoE config puts them, dense elsewhere."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
    return SparseMoe(SoftmaxTopKGate(cfg.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob),
                     RoutedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp), tp)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3ForCausalLM and Qwen3MoeForCausalLM (``cfg.moe`` says which), holding ``tp``'s share."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp, layers=(DecoderLayer(cfg, Qwen3Attention(cfg, tp), qwen3_mlp(cfg, i, tp))
                                          for i in range(cfg.num_layers)))

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy a ``transformers``-named state dict in, fusing q|k|v and gate|up and keeping
        this rank's share; returns the parameters that received nothing."""
        return load_weights(self, weights, lambda name: qwen3_target(name, self.cfg, self.tp), self.tp)

    @staticmethod
    def split_dims(cfg: ModelConfig) -> tuple[tuple[int, str], ...]:
        """Heads and KV heads; the dense MLPs' width where a layer has one; each expert's width."""
        dims = [(cfg.num_heads, "num_attention_heads"), (cfg.num_kv_heads, "num_key_value_heads")]
        moe = cfg.moe
        if moe is None or any(not moe.is_sparse(i) for i in range(cfg.num_layers)):
            dims.append((cfg.intermediate_size, "intermediate_size"))
        if moe is not None:
            dims.append((moe.intermediate_size, "moe_intermediate_size"))
        return tuple(dims)


def qwen3_target(hf_name: str, cfg: ModelConfig, tp: TensorParallel) -> Target | None:
    """Where a checkpoint tensor goes: our parameter, the row offset into a fused one (this
    rank's sizes), and the dimension split over the ranks."""
    name = hf_name.removeprefix("model.")
    if (name == "lm_head.weight" and cfg.tie_word_embeddings) or "rotary_emb" in name:
        return None
    q = tp.share(cfg.num_heads, "num_attention_heads") * cfg.head_dim
    kv = tp.share(cfg.num_kv_heads, "num_key_value_heads") * cfg.head_dim
    for src, offset in ((".self_attn.q_proj.", 0), (".self_attn.k_proj.", q), (".self_attn.v_proj.", q + kv)):
        if src in name:
            return Target(name.replace(src, ".self_attn.qkv_proj."), offset, 0)
    if ".self_attn.o_proj." in name:
        return Target(name, None, 1)
    if ".mlp.gate." in name:  # the router: replicated
        return Target(name.replace(".mlp.gate.", ".mlp.gate.proj."))
    expert = ".mlp.experts." in name
    width = cfg.moe.intermediate_size if expert and cfg.moe else cfg.intermediate_size
    inter = tp.share(width, "moe_intermediate_size" if expert else "intermediate_size")
    for src, offset in ((".gate_proj.", 0), (".up_proj.", inter)):
        if src in name:
            return Target(name.replace(src, ".gate_up_proj."), offset, 0)
    if ".down_proj." in name:
        return Target(name, None, 1)
    return Target(name)
