"""Attention over a latent cache (DeepSeek's multi-head latent attention, MLA).

Each cached token holds one row per layer: the normed latent ``c`` (kv_lora_rank values)
and the rotated RoPE key ``k_pe`` (qk_rope_head_dim), shared by every head (kv_cache.py's
``LatentCacheSpec``). Head h's key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``, with
W_UK and W_UV the two halves of ``kv_b_proj`` (weight (nh * (nope + v), kv_lora_rank)).

Two ways to attend, chosen per sequence by its number of new tokens (never by its batch):
- **prefill** (more than one new token): up-project the context's latents to per-head K and
  V and run SDPA, as ``transformers`` does (op for op: the same ``F.linear`` and SDPA
  calls, so float32 prefill matches it). A prompt is compute-bound, and its K/V are
  narrower (nope + rope = 192 in V3) than the absorbed form's (576).
- **decode** (one new token): absorb W_UK into the query and W_UV into the output, as vLLM
  and SGLang do: ``q_lat = q_nope W_UK`` scores against the cached rows directly,
  ``softmax(q_lat . c + q_pe . k_pe)`` weighs the rows' latents, and ``W_UV`` maps the
  weighted latent to the head's value. A decode step then reads each cached row once and
  never up-projects the context (up-projecting costs context x kv_lora x nh x (nope + v)
  multiply-adds a step; absorbed, context x nh x (kv_lora + rope)). The same math
  summed in another order: in float32 its logits differ from ``transformers``' by rounding.

Not batch-invariant (``batch_invariant = False``): decode rows of equal context length run
as one batched matmul, as the SDPA backend's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionContext, _decode_groups, gather_kv
from pdserve.engine.config import MLAConfig

MLA_BACKENDS = ("auto", "sdpa")


class TorchLatentAttention:
    """The torch backend of MLA, on every device and dtype."""

    name = "mla-torch"
    batch_invariant = False

    def __init__(self, mla: MLAConfig):
        self.rank, self.nope, self.v = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
        self.scale = mla.softmax_scale

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
               ctx: AttentionContext, up: torch.Tensor) -> torch.Tensor:
        """q_nope (T, nh, nope), q_pe (T, nh, rope) rotated, latent (T, kv_lora + rope) the new
        tokens' rows, cache (num_blocks, block_size, kv_lora + rope), up the kv_b_proj weight
        (nh * (nope + v), kv_lora) -> (T, nh, v). Writes the new rows into the cache first."""
        cache.index_put_((ctx.slot_block, ctx.slot_offset), latent)
        if ctx.is_decode:
            return self._decode(q_nope, q_pe, cache, ctx, up)
        outs, start = [], 0
        for i, (n, c) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            rows = slice(start, start + n)
            if n == 1:  # a decode token in a mixed step: the decode path, whatever its company
                outs.append(self._absorbed(q_nope[rows], q_pe[rows], gather_kv(cache, ctx.block_tables[i:i + 1], c),
                                           up))
            else:
                context = latent[rows] if c == n else gather_kv(cache, ctx.block_tables[i:i + 1], c)[0]
                outs.append(self._expanded(q_nope[rows], q_pe[rows], context, up))
            start += n
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ctx: AttentionContext,
                up: torch.Tensor) -> torch.Tensor:
        """Every row one new token: one absorbed call per group of equal context length."""
        if ctx.decode_groups is None:
            ctx.decode_groups = _decode_groups(ctx)
        if len(ctx.decode_groups) == 1:  # its rows are every row, in order
            _, tables, length = ctx.decode_groups[0]
            return self._absorbed(q_nope, q_pe, gather_kv(cache, tables, length), up)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], self.v)
        for rows, tables, length in ctx.decode_groups:
            out[rows] = self._absorbed(q_nope[rows], q_pe[rows], gather_kv(cache, tables, length), up)
        return out

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                  up: torch.Tensor) -> torch.Tensor:
        """One sequence's n new tokens over its c context rows (the last n are the new ones):
        q (n, nh, *), context (c, kv_lora + rope) -> (n, nh, v)."""
        n, nh, c = q_nope.shape[0], q_nope.shape[1], context.shape[0]
        kv = F.linear(context[:, :self.rank], up).view(c, nh, self.nope + self.v)
        k_nope, value = kv.split([self.nope, self.v], dim=-1)
        k_pe = context[:, None, self.rank:].expand(c, nh, -1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1).unsqueeze(0)  # (1, nh, n, qk)
        k = torch.cat((k_nope, k_pe), dim=-1).transpose(0, 1).unsqueeze(0)  # (1, nh, c, qk)
        v = value.transpose(0, 1).unsqueeze(0)  # (1, nh, c, v)
        mask = None
        if c != n:  # earlier context (a later chunk, a prefix-cache hit): causal from c - n on
            mask = torch.arange(c, device=q.device)[None, :] <= torch.arange(c - n, c, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return out.squeeze(0).transpose(0, 1)  # (n, nh, v)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                  up: torch.Tensor) -> torch.Tensor:
        """G one-token queries over G contexts of one length L: q (G, nh, *), context
        (G, L, kv_lora + rope) -> (G, nh, v)."""
        nh = q_nope.shape[1]
        w = up.view(nh, self.nope + self.v, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # (nh, nope, r), (nh, v, r)
        q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (G, nh, r)
        q = torch.cat((q_lat, q_pe), dim=-1)  # (G, nh, r + rope)
        scores = torch.matmul(q, context.transpose(1, 2)) * self.scale  # (G, nh, L)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o_lat = torch.matmul(probs, context[..., :self.rank])  # (G, nh, r)
        return torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (G, nh, v)


def select_latent_backend(name: str, mla: MLAConfig) -> TorchLatentAttention:
    """The attention backend of an MLA model: ``auto`` and ``sdpa`` run ``TorchLatentAttention``
    (torch's ops, SDPA for prefill); pdserve's paged kernel and flash-attn read per-head K/V,
    which an MLA cache does not hold."""
    if name not in MLA_BACKENDS:
        raise ValueError(f"attention_backend={name} reads per-head K/V; a model with latent attention (MLA) "
                         f"runs {' or '.join(MLA_BACKENDS)}")
    return TorchLatentAttention(mla)
