"""The Qwen3 family: Qwen3 (dense) and Qwen3-MoE, over the same packed tokens as decoder.py.

What differs from Llama (decoder.py), and nothing else:
- attention has an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, one weight of
  head_dim shared by the heads), applied after the projection and before RoPE, as
  ``transformers`` does; ``head_dim`` comes from the config and need not be hidden / heads
  (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024); there are no q/k/v biases;
- Qwen3-MoE: the MLP of layer i is routed experts (pdserve/engine/layers/moe.py) when ``(i + 1) %
  decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``, a dense MLP otherwise.

Tensor parallelism, Megatron's split: q|k|v by heads and gate|up by intermediate width
(column-parallel), o_proj and down_proj by input columns (row-parallel) with one all-reduce
each; each expert is split in width (layers/moe.py). The q/k norms act within a head, so they
are replicated. Each layer loads its own share of a checkpoint tensor (layers/linear.py).

The decoder layers are model.py's ``DecoderLayer`` with this file's attention and MLP in it,
so the norms, the residual stream and everything around the layers (embedding, final norm,
LM head, cache binding) are ``CausalLM``'s. The packed CPU backend runs these layers one by
one (its fused whole-stack call is Llama's layer exactly: pdserve/engine/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pdserve.engine.config import Get, ModelConfig, dense_fields
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.moe import RoutedExperts, SoftmaxTopKGate, SparseMoe
from pdserve.engine.models.decoder import CausalLM, DecoderLayer, QKNormAttention
from pdserve.engine.models.family import Family
from pdserve.engine.parallel import TensorParallel


@dataclass(frozen=True)
class MoeConfig:
    """Qwen3-MoE's routed experts: how many, how a token picks them, and which layers have them."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # each expert's width (moe_intermediate_size)
    norm_topk_prob: bool  # renormalize a token's k weights to sum to one
    sparse_step: int = 1  # decoder_sparse_step: layer i has experts when (i + 1) % sparse_step == 0...
    dense_layers: tuple[int, ...] = ()  # ...and is not one of these (mlp_only_layers): a dense MLP there
    shared_intermediate_size: int = 0  # no shared experts

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def qwen3_mlp(cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
    """Layer ``layer``'s MLP: routed experts where the MoE config puts them, dense elsewhere."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
    return SparseMoe(SoftmaxTopKGate(cfg.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob),
                     RoutedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp), tp)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3ForCausalLM and Qwen3MoeForCausalLM (``cfg.moe`` says which), holding ``tp``'s share."""

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, QKNormAttention(cfg, self.tp), qwen3_mlp(cfg, index, self.tp))

    @classmethod
    def layer_kind(cls, cfg: ModelConfig, index: int) -> bool:
        """Two kinds: a layer with routed experts, or with a dense MLP."""
        return cfg.moe is not None and cfg.moe.is_sparse(index)

    # The MoE router is checkpoints' mlp.gate, our mlp.gate.proj (the gate module holds the top-k rule).
    packed_modules_mapping = {**CausalLM.packed_modules_mapping, "gate": ("gate.proj", None)}


def read_config(get: Get, source: str) -> ModelConfig:
    if get("attention_bias", False):
        # transformers' Qwen3 then has an o_proj bias too, which no Qwen3 checkpoint has.
        raise ModelLoadError(source, "attention_bias: Qwen3 models have no attention biases; supported: false")
    fields = dense_fields(get, source)  # checks the quantization method before anything else
    moe = moe_config(get, source) if get("model_type") == "qwen3_moe" else None
    return ModelConfig(**fields, moe=moe)


def moe_config(get: Get, source: str) -> MoeConfig:
    """The routed-expert fields of a Qwen3-MoE config."""
    # transformers 5 writes num_local_experts; the published checkpoints say num_experts.
    num_experts = get("num_experts") or get("num_local_experts")
    top_k = get("num_experts_per_tok")
    step = get("decoder_sparse_step", 1)
    if not num_experts or not top_k or not 1 <= top_k <= num_experts:
        raise ModelLoadError(source, f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts})")
    if not step or step < 1:
        raise ModelLoadError(source, f"decoder_sparse_step ({step}) must be at least 1")
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=get("moe_intermediate_size"),
                     norm_topk_prob=bool(get("norm_topk_prob", False)), sparse_step=step,
                     dense_layers=tuple(get("mlp_only_layers") or ()))


_QWEN3 = dict(vocab_size=151936, num_attention_heads=32, head_dim=128, max_position_embeddings=40960,
              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

FAMILY = Family(architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), model_types=("qwen3", "qwen3_moe"),
                model=Qwen3ForCausalLM, read_config=read_config,
                published={
                    "Qwen3-8B": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                                     intermediate_size=12288, num_hidden_layers=36, num_key_value_heads=8),
                    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers): 128 experts, top 8, none shared.
                    "Qwen3-30B-A3B": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                          hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                          num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                                          moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=True),
                })
