"""Paged caches, block tables and a float32 SDPA reference for the attention kernels' tests
(tests/engine/test_triton_attention.py, test_triton_split_kv.py): the engine's cache layout
(block-first, a layer's K and V strided views into it), and block tables drawn from a
shuffled pool, so nothing works by the blocks' order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.kv_cache import layer_views

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS, HD, LAYERS, NUM_BLOCKS = 16, 64, 2, 24  # SmolLM2's head size, pdserve's block size
# bfloat16 against the float32 reference: the interpreter truncates where a GPU rounds to
# nearest, so the bound is two bfloat16 steps of the output's size.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def paged_cache(nkv: int, dtype: torch.dtype, seed: int = 0, num_blocks: int = NUM_BLOCKS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's K and V views (num_blocks, BS, nkv, HD) of a random engine-layout cache."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, LAYERS, 2, BS, nkv, HD, generator=g).to(dtype).to(DEVICE)
    return layer_views(cache, 1)


def block_tables(context_lens: list[int], seed: int = 1, num_blocks: int = NUM_BLOCKS) -> list[list[int]]:
    """Each sequence's blocks, drawn from a shuffled pool: no two sequences share one."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for c in context_lens:
        n = -(-c // BS)
        tables.append(order[start:start + n])
        start += n
    if start > num_blocks:
        raise ValueError(f"contexts of {sum(context_lens)} tokens need {start} blocks, the cache has {num_blocks}")
    return tables


def sdpa_reference(q, k_cache, v_cache, tables, starts, query_lens, window=None) -> torch.Tensor:
    """float32 SDPA per sequence over its gathered context: a query at position p sees 0..p
    (with a window, p - window + 1 .. p)."""
    outs, t = [], 0
    for table, s, n in zip(tables, starts, query_lens):
        c = s + n
        blocks = torch.tensor(table, device=q.device)
        k = k_cache[blocks].flatten(0, 1)[:c].float().transpose(0, 1)  # (nkv, c, hd)
        v = v_cache[blocks].flatten(0, 1)[:c].float().transpose(0, 1)
        qi = q[t:t + n].float().transpose(0, 1)  # (nh, n, hd)
        keys, pos = torch.arange(c, device=q.device)[None, :], torch.arange(s, c, device=q.device)[:, None]
        mask = (keys <= pos) & (keys > pos - window) if window else keys <= pos
        outs.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1))
        t += n
    return torch.cat(outs)
