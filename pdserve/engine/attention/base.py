"""Paged attention: the per-step context object, the backend interface and the torch SDPA backend.

Attention reads and writes the KV cache only through the slot mapping (where each new
token's K/V goes) and ``block_tables`` (where each sequence's earlier K/V lives).
A layer's cache is ``(num_blocks, block_size, num_kv_heads, head_dim)``, a strided view into
the worker's single block-first cache tensor (see kv_cache.py).

Backends (chosen by ``select.select_backend``): ``paged``, pdserve's own batch-invariant C++ kernel, one call
per layer for any mix of prefill and decode (CPU, paged.py); ``flash`` and
``flash_invariant``, flash-attn on CUDA (flash.py); ``sdpa``, torch's SDPA, one call per sequence (prefill) or per
distinct context length (decode). Each says whether it is ``batch_invariant``: whether a
token's output is bitwise the same whatever else shares its step.

Sliding windows: ``attend(..., window=w)`` (a layer's own, decoder.Attention's ``window``)
lets a query at position p see the keys at positions p - w + 1 .. p only, its own included,
as transformers' sliding-window mask does (Gemma 3's local layers); None: every key up to p.
The cache still holds every token; only what a query reads changes. Every K/V backend takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.device import to_device
from pdserve.engine.layers.rotary import apply_rotary


@dataclass
class AttentionContext:
    """Everything attention needs for one forward, built once per step by the model runner.

    T = tokens in the step, B = sequences, M = max blocks per sequence.
    """

    is_decode: bool  # every sequence has exactly one new token
    slot_block: torch.Tensor  # (T,) int64 block id of each new token's slot
    slot_offset: torch.Tensor  # (T,) int64 offset inside that block
    block_tables: torch.Tensor  # (B, M) int32, padded with block 0 past each sequence's end
    query_lens: list[int]  # (B,) new tokens per sequence
    context_lens: list[int]  # (B,) tokens in the cache after this step, new ones included
    context_lens_t: torch.Tensor  # (B,) int32 on device, for kernels
    cu_query_lens: torch.Tensor  # (B+1,) int32 prefix sums of query_lens
    cu_context_lens: torch.Tensor  # (B+1,) int32 prefix sums of context_lens (flash-attn's varlen)
    # SDPA's decode only, built by its first layer in a step: sequences grouped by context
    # length, as (row indices (G,), block tables (G, ceil(len/bs)), len). Each group is one
    # unpadded, unmasked attention call, so a sequence's result never depends on its batch
    # company (padding + masking changes the reduction order of the CPU kernels, enough to
    # flip a bfloat16 argmax).
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
    max_context_len: int = 0
    max_query_len: int = 0
    block_size: int = 16


def build_context(starts: list[int], query_lens: list[int], tables: list[list[int]], block_size: int,
                  device: torch.device, decode: bool) -> tuple[AttentionContext, torch.Tensor]:
    """The step's context and positions (T,) for B sequences, each with ``starts[b]`` tokens
    already cached, ``query_lens[b]`` new ones and block table ``tables[b]`` (at least long
    enough)."""
    ctx, positions, _ = host_context(starts, query_lens, tables, block_size, decode).to(device)
    return ctx, positions


@dataclass
class HostContext:
    """A step's ``AttentionContext`` and positions, built on the host; ``to`` puts them (and
    the step's other inputs) on the device in one copy."""

    ctx: AttentionContext  # its tensors on the host
    positions: torch.Tensor  # (T,) int64

    def to(self, device: torch.device, extra: Sequence[torch.Tensor] = ()
           ) -> tuple[AttentionContext, torch.Tensor, list[torch.Tensor]]:
        """(context, positions, ``extra``) on ``device``; on the CPU, the very same tensors."""
        if device.type == "cpu":  # nothing to move, and nothing to rebuild on every step
            return self.ctx, self.positions, list(extra)
        c = self.ctx
        moved = to_device([c.slot_block, c.slot_offset, c.block_tables, c.context_lens_t, c.cu_query_lens,
                           c.cu_context_lens, self.positions, *extra], device)
        ctx = replace(c, slot_block=moved[0], slot_offset=moved[1], block_tables=moved[2], context_lens_t=moved[3],
                      cu_query_lens=moved[4], cu_context_lens=moved[5])
        return ctx, moved[6], moved[7:]


def host_context(starts: list[int], query_lens: list[int], tables: list[list[int]], block_size: int,
                 decode: bool) -> HostContext:
    """``build_context``'s work, on the host. Per token, only tensor ops run: this is on
    every step's path."""
    bs = block_size
    context_lens = [s + n for s, n in zip(starts, query_lens)]
    used = [-(-c // bs) for c in context_lens]
    width = max(used)
    block_tables = torch.tensor([t[:u] + [0] * (width - u) for t, u in zip(tables, used)], dtype=torch.int32)
    q_lens = torch.tensor(query_lens, dtype=torch.int32)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=cu[1:])
    seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # (T,) sequence of each token
    positions = torch.arange(int(cu[-1])) - cu[seq_of] + torch.tensor(starts)[seq_of]  # (T,) int64
    ctx = AttentionContext(
        is_decode=decode and all(n == 1 for n in query_lens),
        slot_block=block_tables[seq_of, positions // bs].long(),
        slot_offset=positions % bs,
        block_tables=block_tables,
        query_lens=query_lens,
        context_lens=context_lens,
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32),
        cu_query_lens=cu,
        cu_context_lens=torch.tensor([0, *accumulate(context_lens)], dtype=torch.int32),
        max_context_len=max(context_lens),
        max_query_len=max(query_lens),
        block_size=bs,
    )
    return HostContext(ctx, positions)


class AttentionBackend:
    """What every backend shares: ``attend`` takes the fused q|k|v projection, splits it,
    applies RoPE, and hands q, k, v to the backend's ``forward``. A backend with a fused
    prologue (the CPU paged kernel) overrides ``attend``."""

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
               v_cache: torch.Tensor, ctx: AttentionContext, nh: int, nkv: int, hd: int,
               window: int | None = None) -> torch.Tensor:
        """qkv (T, (nh + 2 nkv) hd), rope = cos, sin (T, 1, hd) -> (T, nh, hd). ``window``: the
        keys a query sees, its own included (None: all up to it)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = apply_rotary(q.view(t, nh, hd), k.view(t, nkv, hd), *rope)
        return self.forward(q, k, v.view(t, nkv, hd), k_cache, v_cache, ctx, window=window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                window: int | None = None) -> torch.Tensor:
        raise NotImplementedError


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             ctx: AttentionContext) -> None:
    """Store the new tokens' K/V (T, nkv, hd) in their slots."""
    k_cache.index_put_((ctx.slot_block, ctx.slot_offset), k)
    v_cache.index_put_((ctx.slot_block, ctx.slot_offset), v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """(B, M) block tables -> (B, length, nkv, hd) contiguous K or V."""
    b, m = block_tables.shape
    blocks = cache.index_select(0, block_tables.flatten())  # (B*M, bs, nkv, hd), contiguous
    return blocks.view(b, m * cache.shape[1], *cache.shape[2:])[:, :length]


class SdpaAttention(AttentionBackend):
    """torch ``scaled_dot_product_attention`` over the paged cache (CPU and CUDA).

    Not batch-invariant across phases: a prompt token's prefill result and the same
    position recomputed after a preemption go through different SDPA kernels.
    """

    name = "sdpa"
    batch_invariant = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.gqa = num_heads != num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                window: int | None = None) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd). Writes k/v into the cache first."""
        write_kv(k_cache, v_cache, k, v, ctx)
        if ctx.is_decode:
            return self._decode(q, k_cache, v_cache, ctx, window)
        return self._prefill(q, k, v, k_cache, v_cache, ctx, window)

    def _decode(self, q, k_cache, v_cache, ctx: AttentionContext, window: int | None = None) -> torch.Tensor:
        q = q.unsqueeze(2)  # (B, nh, 1, hd)
        if ctx.decode_groups is None:
            ctx.decode_groups = _decode_groups(ctx)
        if len(ctx.decode_groups) == 1:
            return self._decode_group(q, k_cache, v_cache, *ctx.decode_groups[0][1:], window)
        out = torch.empty_like(q)
        for rows, tables, length in ctx.decode_groups:
            out[rows] = self._decode_group(q[rows], k_cache, v_cache, tables, length, window).unsqueeze(2)
        return out.squeeze(2)

    def _decode_group(self, q, k_cache, v_cache, tables: torch.Tensor, length: int,
                      window: int | None = None) -> torch.Tensor:
        # Contiguous (G, nkv, S, hd), the layout transformers' cache hands SDPA: the CPU kernel
        # blocks differently for other strides, which changes float32 results in the last bits.
        if window is not None and window < length:  # the last `window` keys only, from their first block
            first = (length - window) // k_cache.shape[1]
            skip = first * k_cache.shape[1]
            k = gather_kv(k_cache, tables[:, first:], length - skip)[:, length - window - skip:]
            v = gather_kv(v_cache, tables[:, first:], length - skip)[:, length - window - skip:]
            k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        else:
            k = gather_kv(k_cache, tables, length).transpose(1, 2).contiguous()
            v = gather_kv(v_cache, tables, length).transpose(1, 2).contiguous()
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=self.gqa)
        return out.squeeze(2)  # (G, nh, hd)

    def _windowed(self, qi, k_cache, v_cache, table: torch.Tensor, n: int, c: int, window: int) -> torch.Tensor:
        """One sequence's ``n`` queries (its last, (1, nh, n, hd)) over its ``c`` cached keys, each
        query at position p seeing p - window + 1 .. p: the keys from the first one any of them
        sees (from its block on), masked per query."""
        first = max(0, c - n - window + 1) // k_cache.shape[1]
        skip = first * k_cache.shape[1]
        ki = gather_kv(k_cache, table[:, first:], c - skip).transpose(1, 2)  # (1, nkv, c - skip, hd)
        vi = gather_kv(v_cache, table[:, first:], c - skip).transpose(1, 2)
        q_pos = torch.arange(c - n, c, device=qi.device).unsqueeze(1)
        k_pos = torch.arange(skip, c, device=qi.device).unsqueeze(0)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (n, c - skip)
        return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)

    def _prefill(self, q, k, v, k_cache, v_cache, ctx: AttentionContext, window: int | None = None) -> torch.Tensor:
        # Sequences differ in length, so each is its own SDPA call over its packed slice.
        outs = []
        start = 0
        for i, (n, c) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
            if window is not None and window < c:  # some query here sees fewer keys than its position's
                o = self._windowed(qi, k_cache, v_cache, ctx.block_tables[i:i + 1], n, c, window)
            elif c == n:  # no earlier context: attend to the fresh K/V causally
                ki = k[start:start + n].transpose(0, 1).unsqueeze(0)
                vi = v[start:start + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=self.scale,
                                                   enable_gqa=self.gqa)
            else:  # a later chunk, a prefix-cache hit, or a decode token in a mixed batch
                table = ctx.block_tables[i:i + 1]
                ki = gather_kv(k_cache, table, c).transpose(1, 2)  # (1, nkv, c, hd)
                vi = gather_kv(v_cache, table, c).transpose(1, 2)
                mask = None
                if n > 1:
                    q_pos = torch.arange(c - n, c, device=q.device).unsqueeze(1)
                    mask = torch.arange(c, device=q.device).unsqueeze(0) <= q_pos  # (n, c)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=self.gqa)
            outs.append(o.squeeze(0).transpose(0, 1))  # (n, nh, hd)
            start += n
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def _decode_groups(ctx: AttentionContext) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    rows_by_len: dict[int, list[int]] = {}
    for i, c in enumerate(ctx.context_lens):
        rows_by_len.setdefault(c, []).append(i)
    # Every group's row indices go to the device in one copy (one per group was a host sync each).
    indices = to_device([torch.tensor(rows) for rows in rows_by_len.values()], ctx.block_tables.device)
    return [(idx, ctx.block_tables[idx, : -(-c // ctx.block_size)].long(), c)
            for idx, c in zip(indices, rows_by_len)]
