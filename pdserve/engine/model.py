"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over packed, variable-length tokens.

Tokens of every sequence in a step are packed along one axis (T). The model does not know
the KV cache exists: each attention layer is handed its cache slice (``bind_cache``) and
the step's ``AttentionContext`` by the model runner. Projections are fused (q|k|v and
gate|up) so a decode step issues fewer, larger matmuls; numerics follow ``transformers``
op for op (RMSNorm in float32, RoPE tables in float32, logits cast to float32). After
loading, pdserve/engine/linear.py may swap the linears, norms and LM head for a backend's own
modules (bfloat16 on CPU: pdserve's batch-invariant kernels); the model does not know which.

Tensor parallelism (``TensorParallel``, pdserve/engine/parallel.py) is Megatron's split: each
rank holds its share of the q heads and of the KV heads (q|k|v split by heads), of the MLP's
intermediate rows (gate|up), and the matching input columns of o_proj and down_proj, whose
partial outputs one all-reduce each sums. The embedding, the norms and the LM head are
replicated; only rank 0 computes logits (it alone samples), so the other ranks hold no LM head.
At size 1 every split is the whole and every all-reduce the identity. ``check_split`` says,
per family, whether a size splits a model, before anything is built.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn
import torch.nn.functional as F

from pdserve.engine.attention import AttentionContext
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.rope import RotaryEmbedding
from pdserve.engine.weights import Target, load_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, first ``x = x + residual`` (the layer's skip
        connection) and returns ``(norm(x), x)``, so a backend can fuse the add in."""
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RowParallelLinear(nn.Linear):
    """A linear whose input columns are split over the tensor-parallel ranks (o_proj,
    down_proj): each rank's output is a partial sum, which ``TensorParallel.all_reduce``
    completes. It computes as ``nn.Linear``; the class tells a linear backend that, at TP > 1,
    the partial sums are better handed over in float32 (pdserve/engine/linear.py), so its
    caller casts the reduced sum back to the model dtype."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        # This rank's heads: q heads and KV heads each split evenly, so every rank keeps the
        # model's GQA ratio and its q heads read only its own KV heads.
        self.nh = tp.share(cfg.num_heads, "num_attention_heads")
        self.nkv = tp.share(cfg.num_kv_heads, "num_key_value_heads")
        self.hd = cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = None  # set by the model runner
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, nkv, hd), bound by the runner
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, cache: tuple[torch.Tensor, torch.Tensor], backend) -> None:
        """``cache``: this layer's (K, V) views (kv_cache.KVCacheSpec.layer_caches)."""
        (self.k_cache, self.v_cache), self.backend = cache, backend

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        # The backend splits q|k|v, rotates, stores K/V and attends (fused where it can).
        out = self.backend.attend(self.qkv_proj(x), rope, self.k_cache, self.v_cache, ctx,
                                  self.nh, self.nkv, self.hd)  # (T, nh, hd), this rank's heads
        return self.tp.all_reduce(self.o_proj(out.reshape(x.shape[0], self.q_size))).to(x.dtype)


class SiluAndMul(nn.Module):
    """(T, 2I) gate|up -> (T, I) silu(gate) * up, as transformers computes it; a linear
    backend may swap it for a fused kernel (pdserve/engine/linear.py)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.inter = tp.share(cfg.intermediate_size, "intermediate_size")  # this rank's rows
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x)))).to(x.dtype)


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP, with the residual stream between. A family whose attention
    or MLP differs from Llama's (pdserve/engine/qwen3.py) hands its own in; the norms and the
    stream are the same."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module | None = None, mlp: nn.Module | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp) if self_attn is None else self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp) if mlp is None else mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream) in -> out. The stream is h = residual + x, the
        sum each norm computes first: transformers' ``h = h + sublayer(norm(h))``, with each
        add moved into the next norm (None: x is the embedding, nothing to add yet)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, ctx), residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """Runs the decoder layers one after another. It holds no weights (they stay under
    ``CausalLM.layers``, named as ``transformers`` names them), so a linear backend can swap it
    for one call over the whole stack (pdserve/engine/linear.py) without touching how weights load."""

    def forward(self, layers: nn.ModuleList, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded tokens (T, hidden) -> (last MLP output, residual stream), for the final norm."""
        residual = None
        for layer in layers:
            h, residual = layer(h, residual, rope, ctx)
        return h, residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head: Llama's, or another family's. A family
    is a subclass (pdserve/engine/families.py): it passes its own ``layers`` (qwen3.py) or
    overrides ``make_rotary`` and ``make_layer`` (deepseek.py), and maps its weight names."""

    # The layers are the ones torch.ops.pdserve.decoder_layers runs in one call (linear.py).
    packed_stack = True

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layers: Iterable[nn.Module] | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # Rank 0 alone computes logits: the sampler needs the whole vocabulary there, and a
        # replicated head costs no collective (a vocab-parallel one would gather logits).
        self.has_head = tp.rank == 0
        self.rotary = self.make_rotary(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers if layers is not None else
                                    (self.make_layer(cfg, i) for i in range(cfg.num_layers)))
        self.stack = DecoderStack()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        untied = not cfg.tie_word_embeddings and self.has_head
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied else None
        self.linear_backend = "torch"  # engine.linear.apply_backend names the one it applied
        self.kernel_path: str | None = None  # and the CPU instruction-set path, for the packed kernels
        self._bound: tuple[list, object] | None = None  # what bind_caches bound last

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, tp=self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        h, residual = self.stack(self.layers, h, rope, ctx)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32: by default in the model dtype, then cast, as
        transformers does; a packed head (pdserve/engine/linear.py) sums and writes in float32."""
        if self.lm_head is None:  # tied to the embedding, unpacked
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def bind_caches(self, caches: list, backend) -> None:
        """Hand each attention layer its cache views (``CacheSpec.layer_caches``: (K, V) here,
        the latent in deepseek.py) and the attention backend.

        A model runner calls this every step, so engines that share one model object (tests
        do) never run on each other's cache; it rebinds only when the caches or the backend
        changed, since 90 module attribute writes cost about a millisecond a step."""
        if self._bound is not None and self._bound[0] is caches and self._bound[1] is backend:
            return
        for attn, cache in zip(self.attention_layers, caches):
            attn.bind_cache(cache, backend)
        self._bound = (caches, backend)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy a ``transformers``-named state dict in, fusing q|k|v and gate|up, each tensor
        cut to this rank's share (pdserve/engine/weights.py).

        Returns the names of parameters that received nothing (empty when complete); raises
        ValueError on a shape mismatch naming the tensor.
        """
        return load_weights(self, weights, lambda name: llama_target(name, self.cfg, self.tp), self.tp)

    @staticmethod
    def split_dims(cfg: ModelConfig) -> tuple[tuple[int, str], ...]:
        """The (size, name) of every dimension this family splits over tensor-parallel ranks
        (``check_split``); a family with other splits overrides it."""
        return ((cfg.num_heads, "num_attention_heads"), (cfg.num_kv_heads, "num_key_value_heads"),
                (cfg.intermediate_size, "intermediate_size"))


def llama_target(hf_name: str, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> Target | None:
    """Where a transformers tensor goes: our parameter, the row offset into a fused one (at this
    rank's sizes) and the dimension split over the ranks (q, k, v, gate, up by output rows;
    o_proj, down_proj by input columns; a bias has one dimension: only q, k, v have any)."""
    name = hf_name.removeprefix("model.")
    if (name == "lm_head.weight" and cfg.tie_word_embeddings) or "rotary_emb" in name:
        return None
    q = tp.share(cfg.num_heads, "num_attention_heads") * cfg.head_dim
    kv = tp.share(cfg.num_kv_heads, "num_key_value_heads") * cfg.head_dim
    inter = tp.share(cfg.intermediate_size, "intermediate_size")
    fused = {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", q),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", q + kv),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", inter),
    }
    for src, (dst, offset) in fused.items():
        if src in name:
            return Target(name.replace(src, dst), offset, 0)
    if ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
        return Target(name, None, 1)
    return Target(name)
