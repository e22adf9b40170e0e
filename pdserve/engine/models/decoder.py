"""The decoder most families share (Llama's), over packed, variable-length tokens.

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
partial outputs one all-reduce each sums: the layers (pdserve/engine/layers/linear.py) know
their split and load their own share. The embedding and the LM head are split by vocabulary
rows (pdserve/engine/layers/vocab.py): each rank looks up the ids in its range, one all-reduce
completes the embedded tokens, and each rank computes its range's logits, which are gathered
to rank 0 (it alone samples): ``compute_logits`` returns them there and None on the other
ranks, which call it on the same rows (pdserve/engine/distributed/ keeps them in step). A tied
head computes over the embedding's rows. The norms are replicated. At size 1 every split is
the whole, every all-reduce and the gather the identity.

Loading: ``load_checkpoint`` maps each checkpoint name to a parameter (``checkpoint_target``:
the family's ``packed_modules_mapping`` says which checkpoint tensors are parts of one fused
parameter) and hands the tensor to the parameter's module, whose ``load_weight`` reads only
this rank's part. A module without one takes the tensor whole.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

import torch
from torch import nn

from pdserve.engine import progress
from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.checkpoint import InMemoryTensor
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.weights import load_checkpoint


class Attention(nn.Module):
    """This rank's heads of a layer's attention. ``window``: the keys a query sees, its own
    included, where the layer slides (``ModelConfig.layer_windows``); None: every key up to it."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, window: int | None = None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"an attention window must be at least 1 key, got {window}")
        self.tp, self.window = tp, window
        # This rank's heads: q heads and KV heads each split evenly, so every rank keeps the
        # model's GQA ratio and its q heads read only its own KV heads.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, tp=tp)
        self.nh, self.nkv, self.hd = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, tp=tp,
                                        what="num_attention_heads")
        self.backend = None  # set by the model runner
        self.k_cache: torch.Tensor | None = None  # (num_blocks, block_size, nkv, hd), bound by the runner
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, cache: tuple[torch.Tensor, torch.Tensor], backend) -> None:
        """``cache``: this layer's (K, V) views (kv_cache.KVCacheSpec.layer_caches)."""
        (self.k_cache, self.v_cache), self.backend = cache, backend

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden): ``project``, the backend's attention, ``output``."""
        return self.output(self.attend(self.project(x), rope, ctx), x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> q|k|v (T, (nh + 2 nkv) hd), as the backend takes it."""
        return self.qkv_proj(x)

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        """The backend splits q|k|v, rotates, stores K/V and attends (fused where it can): (T, nh,
        hd), this rank's heads. The one part of a layer that reads the step's context and the
        cache (pdserve/engine/piecewise.py runs it between graphs)."""
        return self.backend.attend(qkv, rope, self.k_cache, self.v_cache, ctx, self.nh, self.nkv, self.hd,
                                   window=self.window)

    def output(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The heads' outputs (T, nh, hd) -> (T, hidden), summed over the ranks."""
        return self.tp.all_reduce(self.o_proj(out.reshape(out.shape[0], self.q_size))).to(dtype)


class QKNormAttention(Attention):
    """Attention with a norm over each head of q and of k, after the projection and before the
    backend's RoPE and cache store. ``norm(dim, eps)`` builds it: the family's own norm class
    (a norm that rounds unlike Llama's must not be swapped for the CPU kernel's). The norms act
    within a head, so every rank holds them whole."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, window: int | None = None,
                 norm: Callable[[int, float], nn.Module] = RMSNorm):
        super().__init__(cfg, tp, window)
        self.q_norm = norm(self.hd, cfg.rms_norm_eps)
        self.k_norm = norm(self.hd, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        # Normalize q and k in place, head by head, so the backend's fused split + RoPE + store
        # (the CPU paged kernel's) takes the one q|k|v tensor as for Llama.
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(t, self.nh, self.hd)).reshape(t, self.q_size))
        k.copy_(self.k_norm(k.reshape(t, self.nkv, self.hd)).reshape(t, self.kv_size))
        return qkv


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP, with the residual stream between. A family whose attention
    or MLP differs from Llama's hands its own in; the norms and the stream are the same."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module | None = None, mlp: nn.Module | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp) if self_attn is None else self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp) if mlp is None else mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream) in -> out. The stream is h = residual + x, the
        sum each norm computes first: transformers' ``h = h + sublayer(norm(h))``, with each
        add moved into the next norm (None: x is the embedding, nothing to add yet)."""
        x, residual = self.norm_in(x, residual)
        return self.finish(self.self_attn(x, rope, ctx), residual)

    def norm_in(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream so far and the attention's input: (normed, residual)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output (T, hidden) -> (the MLP's output, residual stream)."""
        x, residual = self.post_attention_layernorm(attn_out, residual)
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
            progress.layer_done()
        return h, residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head: Llama's, or another family's. A family
    (pdserve/engine/models/) subclasses it: it overrides ``make_rotary`` and ``make_layer`` (and
    ``layer_kind`` where its layers are of a few kinds), and names the checkpoint tensors that
    are parts of one of its fused parameters in ``packed_modules_mapping``."""

    # The layers are the ones torch.ops.pdserve.decoder_layers runs in one call (linear.py).
    packed_stack = True
    # A checkpoint module name -> (ours, the part it is of ours): q, k and v are parts of our
    # q|k|v projection, gate and up of our gate|up (layers/linear.py loads each part).
    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_indices: Sequence[int] | None = None):
        """``layer_indices``: build only these layers (``registry.check_split``'s probe, never
        loaded or run); None, every layer."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.rotary = self.make_rotary(cfg)
        # Each rank's rows of the vocabulary; made empty (no random init): the weight is always
        # filled, from a checkpoint or by fill_dummy.
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        indices = range(cfg.num_layers) if layer_indices is None else layer_indices
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in indices)
        self.stack = DecoderStack()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp,
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)
        self.linear_backend = "torch"  # engine.linear.apply_backend names the one it applied
        self.kernel_path: str | None = None  # and the CPU instruction-set path, for the packed kernels
        self._bound: tuple[list, object] | None = None  # what bind_caches bound last

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, Attention(cfg, self.tp, window=cfg.window(index)), tp=self.tp)

    @classmethod
    def layer_kind(cls, cfg: ModelConfig, index: int) -> Hashable:
        """What ``make_layer`` builds at ``index``: two layers of one kind have the same modules
        and parameter shapes, so they split alike over the ranks and ``registry.check_split``
        builds one of each. By default every layer is a kind of its own (always right; a family
        of many costly layers, experts in each, names its few kinds)."""
        return index

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        h, residual = self.stack(self.layers, h, rope, ctx)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32 on rank 0; None on the other ranks, which must call
        it on the same rows (their slices are gathered to rank 0). By default in the model dtype,
        then cast, as transformers does; a packed head (pdserve/engine/linear.py) sums and writes
        in float32."""
        return self.lm_head.gather(self.lm_head(hidden).float())

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

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Where checkpoint tensor ``name`` goes: (our parameter, its part of it or None), or
        None for a tensor the model does not keep (a tied LM head's copy, RoPE tables)."""
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") and self.cfg.tie_word_embeddings:
            return None
        if "rotary_emb" in name:
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                ours, shard = self.packed_modules_mapping[part]
                return ".".join(parts[:i] + [ours] + parts[i + 1:]), shard
        return name, None

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> list[str]:
        """Load an in-memory, ``transformers``-named state dict (``load_checkpoint``)."""
        return load_checkpoint(self, (InMemoryTensor(n, t) for n, t in weights.items()))
