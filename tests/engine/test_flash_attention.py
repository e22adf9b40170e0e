"""flash-attn backends against SDPA and a float32 reference. Runs only where CUDA and flash-attn are.

Never run where it was written (no GPU there): see pdserve/engine/attention/flash.py.
"""

import pytest
import torch

from pdserve.engine.attention.base import build_context
from pdserve.engine.attention.select import select_backend
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts

pytestmark = pytest.mark.cuda

NH, NKV, HD = 8, 2, 64


def _flash_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


requires_cuda = pytest.mark.skipif(not _flash_ready(), reason="needs a CUDA device and flash-attn")


@requires_cuda
@pytest.mark.parametrize("backend,block_size", [("flash", 16), ("flash", 256), ("flash_invariant", 256)])
def test_flash_matches_sdpa_greedy(tiny_llama_dir, backend, block_size):
    directory, _ = tiny_llama_dir
    prompts = random_prompts(5, [3, 40, 130, 300, 17], seed=11)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = {}
    for name in ("sdpa", backend):
        engine = make_engine(directory, dtype="bfloat16", device="cuda", attention_backend=name,
                             block_size=block_size, num_blocks=64, max_num_batched_tokens=64)
        assert engine.runner.backend.name == name
        outs[name] = [c.token_ids for c in engine.generate(prompts, params)]
    assert outs[backend] == outs["sdpa"]


def _step(backend, block_size, starts, query_lens, seed=0):
    """Run one layer's attention for a step; returns (output (T, nh, hd), ctx, cache, q)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, query_lens)) + 2
    cache = torch.randn(num_blocks, 1, 2, block_size, NKV, HD, generator=g, device="cuda").bfloat16()
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    perm = torch.randperm(num_blocks, device="cpu").tolist()
    tables, used = [], 0
    for s, n in zip(starts, query_lens):
        k = -(-(s + n) // block_size)
        tables.append(perm[used:used + k])
        used += k
    ctx, _ = build_context(starts, query_lens, tables, block_size, torch.device("cuda"), decode=True)
    q = torch.randn(sum(query_lens), NH, HD, generator=g, device="cuda").bfloat16()
    k_new, v_new = k_cache[ctx.slot_block, ctx.slot_offset], v_cache[ctx.slot_block, ctx.slot_offset]
    return backend.forward(q, k_new, v_new, k_cache, v_cache, ctx), ctx, (k_cache, v_cache), q


def _reference(q, ctx, k_cache, v_cache):
    outs = []
    for b, c in enumerate(ctx.context_lens):
        s, e = ctx.cu_query_lens[b].item(), ctx.cu_query_lens[b + 1].item()
        blocks = ctx.block_tables[b, : -(-c // ctx.block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:c].float().transpose(0, 1)  # (nkv, c, hd)
        v = v_cache[blocks].flatten(0, 1)[:c].float().transpose(0, 1)
        mask = torch.arange(c, device="cuda") <= torch.arange(c - (e - s), c, device="cuda").unsqueeze(1)
        o = torch.nn.functional.scaled_dot_product_attention(q[s:e].float().transpose(0, 1), k, v, attn_mask=mask,
                                                             enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@requires_cuda
@pytest.mark.parametrize("name,block_size", [("flash", 16), ("flash", 256), ("flash_invariant", 256)])
@pytest.mark.parametrize("starts,query_lens", [([5, 300, 40], [1, 1, 1]), ([0, 299, 40, 0], [37, 1, 64, 1])])
def test_every_step_kind_matches_a_float32_reference(name, block_size, starts, query_lens):
    backend = select_backend(name, torch.device("cuda"), NH, NKV, HD, block_size, dtype=torch.bfloat16)
    out, ctx, (k_cache, v_cache), q = _step(backend, block_size, starts, query_lens)
    torch.testing.assert_close(out.float(), _reference(q, ctx, k_cache, v_cache), rtol=2e-2, atol=2e-2)


@requires_cuda
def test_flash_invariant_rows_are_bitwise_the_same_alone_and_batched():
    backend = select_backend("flash_invariant", torch.device("cuda"), NH, NKV, HD, 256, dtype=torch.bfloat16)
    assert backend.batch_invariant
    starts, query_lens = [700, 0, 33, 1000], [1, 100, 1, 17]
    batched, ctx, (k_cache, v_cache), q = _step(backend, 256, starts, query_lens)
    for b, (s, n) in enumerate(zip(starts, query_lens)):
        lo, hi = ctx.cu_query_lens[b].item(), ctx.cu_query_lens[b + 1].item()
        tables = [ctx.block_tables[b].tolist()]
        alone_ctx, _ = build_context([s], [n], tables, 256, torch.device("cuda"), decode=True)
        alone = backend.forward(q[lo:hi], k_cache[alone_ctx.slot_block, alone_ctx.slot_offset],
                                v_cache[alone_ctx.slot_block, alone_ctx.slot_offset], k_cache, v_cache, alone_ctx)
        assert torch.equal(alone, batched[lo:hi]), f"sequence {b}"
