"""The Triton paged-attention kernels (pdserve/engine/attention/triton.py) against a float32
reference: SDPA over each sequence's context gathered from the cache, causally.

Without CUDA they run in Triton's interpreter on host tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported), with CUDA on the GPU: the same code either
way. The interpreter costs about 0.1 s a program, so the batches are small: a few sequences of
ragged lengths crossing block (16) and key-tile (64) edges, SmolLM2's head size 64, GQA
ratios 1, 3 (SmolLM2's 9 query heads over 3 KV heads) and 4. The cache is the engine's
layout (block-first, a layer's K and V strided views into it), and block tables are shuffled,
so nothing works by the blocks' order. bfloat16 is checked against the float32 reference to
its rounding: the interpreter truncates where a GPU rounds to nearest, so the bound is two
bfloat16 steps of the output's size.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from pdserve.engine.attention.base import SdpaAttention, build_context  # noqa: E402
from pdserve.engine.attention.triton import TritonAttention, paged_attention, store_kv  # noqa: E402
from pdserve.engine.attention.kv_cache import layer_views  # noqa: E402
from tests.helpers.paged_attention import (BS, DEVICE, HD, LAYERS, NUM_BLOCKS, TOL, block_tables,  # noqa: E402
                                           paged_cache, sdpa_reference)

ROOT = Path(__file__).resolve().parents[2]
GQA = [(4, 4), (9, 3), (8, 2)]  # (query heads, KV heads): ratios 1, 3, 4
DTYPES = [torch.float32, torch.bfloat16]


def _run(nh, nkv, dtype, starts, query_lens, window=None):
    k_cache, v_cache = paged_cache(nkv, dtype)
    tables = block_tables([s + n for s, n in zip(starts, query_lens)])
    ctx, _ = build_context(starts, query_lens, tables, BS, DEVICE, decode=all(n == 1 for n in query_lens))
    q = torch.randn(sum(query_lens), nh, HD, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    out = paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens, ctx.context_lens_t,
                          ctx.max_query_len, HD ** -0.5, window)
    return out, sdpa_reference(q, k_cache, v_cache, tables, starts, query_lens, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh,nkv", GQA)
def test_decode_equals_sdpa_over_the_gathered_context(nh, nkv, dtype):
    """One launch for sequences of 1, 16, 17 and 70 cached tokens (a full block, one past
    it, past a key tile)."""
    out, ref = _run(nh, nkv, dtype, starts=[0, 15, 16, 69], query_lens=[1, 1, 1, 1])
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh,nkv", GQA)
def test_prefill_over_a_cached_prefix_equals_sdpa(nh, nkv, dtype):
    """A fresh prompt, a chunk after 30 cached tokens that spans two query tiles, a short
    chunk after a whole cached block, and a decode row, in one launch."""
    out, ref = _run(nh, nkv, dtype, starts=[0, 30, 16, 40], query_lens=[5, 20, 3, 1])
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh,nkv", [(9, 3), (8, 2)])
def test_a_sliding_window_equals_masked_sdpa_in_decode_and_prefill(nh, nkv, dtype):
    """Windows of 8 (inside a block), 20 (across blocks; its first key inside an earlier chunk)
    and 70 (past a 64-key tile: the walk starts at a later tile): decode rows of 1, 17, 70 and
    100 cached tokens, a fresh prompt longer than the window, a chunk after 30 cached tokens that
    spans two query tiles, and a decode row, each in one launch."""
    for window in (8, 20, 70):
        out, ref = _run(nh, nkv, dtype, starts=[0, 16, 69, 99], query_lens=[1, 1, 1, 1], window=window)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        out, ref = _run(nh, nkv, dtype, starts=[0, 30, 100], query_lens=[40, 37, 1], window=window)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        unwindowed = _run(nh, nkv, dtype, starts=[0, 30, 100], query_lens=[40, 37, 1])[1]
        assert not torch.allclose(ref, unwindowed, **TOL[dtype])  # the window matters here


def test_chunked_windowed_prefill_equals_the_whole_prompt():
    """A 100-token prompt with a window of 24, prefilled whole and in chunks of 16 (each
    chunk's window reaching back into earlier chunks): the same outputs, to float32 rounding."""
    k_cache, v_cache = paged_cache(3, torch.float32)
    n, window = 100, 24
    tables = block_tables([n])
    q = torch.randn(n, 9, HD, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ctx, _ = build_context([0], [n], tables, BS, DEVICE, decode=False)
    whole = paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens, ctx.context_lens_t,
                            ctx.max_query_len, HD ** -0.5, window)
    for start in range(0, n, 16):
        end = min(n, start + 16)
        ctx, _ = build_context([start], [end - start], tables, BS, DEVICE, decode=False)
        chunk = paged_attention(q[start:end].contiguous(), k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens,
                                ctx.context_lens_t, ctx.max_query_len, HD ** -0.5, window)
        torch.testing.assert_close(chunk, whole[start:end], **TOL[torch.float32])
    torch.testing.assert_close(whole, sdpa_reference(q, k_cache, v_cache, tables, [0], [n], window), **TOL[torch.float32])


def test_store_kv_writes_each_slot_and_skips_padding_rows():
    """Block -1 (a padding row's) would land in the block before the cache: here a block of
    the same tensor, which must stay as it was."""
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(NUM_BLOCKS + 1, LAYERS, 2, BS, 3, HD, generator=g).to(DEVICE)
    k_cache, v_cache = layer_views(whole[1:], 1)
    expected = whole.clone()
    qkv = torch.randn(4, 15, HD, generator=g).to(DEVICE)  # (T, nh + 2 nkv, hd): k and v are strided views
    k, v = qkv[:, 9:12], qkv[:, 12:15]
    slot_block = torch.tensor([5, -1, 7, 5], device=DEVICE)  # row 1: a padding row
    slot_offset = torch.tensor([0, 3, 15, 1], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slot_block, slot_offset)
    ek, ev = layer_views(expected[1:], 1)
    ek[[5, 7, 5], [0, 15, 1]] = k[[0, 2, 3]]
    ev[[5, 7, 5], [0, 15, 1]] = v[[0, 2, 3]]
    assert torch.equal(whole, expected)


def test_the_backend_equals_sdpa_through_the_engines_interface():
    """``forward`` stores the step's K/V, then attends: the same as the SDPA backend, whose
    cache it leaves identical."""
    nh, nkv = 9, 3
    starts, query_lens = [0, 20, 33], [6, 1, 1]
    tables = block_tables([s + n for s, n in zip(starts, query_lens)])
    ctx, _ = build_context(starts, query_lens, tables, BS, DEVICE, decode=False)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(8, h, HD, generator=g).to(DEVICE) for h in (nh, nkv, nkv))
    caches = [paged_cache(nkv, torch.float32) for _ in range(2)]
    ours = TritonAttention(nh, nkv, HD).forward(q, k, v, *caches[0], ctx)
    theirs = SdpaAttention(nh, nkv, HD).forward(q, k, v, *caches[1], ctx)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])
    # And with a sliding window, which both take from the layer.
    ours = TritonAttention(nh, nkv, HD).forward(q, k, v, *caches[0], ctx, window=5)
    theirs = SdpaAttention(nh, nkv, HD).forward(q, k, v, *caches[1], ctx, window=5)
    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])


def test_the_engine_on_triton_equals_transformers(tiny_llama_dir):
    """float32 greedy through the whole engine on this backend: chunked prefill (chunks of 16
    after a cached prefix), then decode steps of two sequences of different lengths."""
    from pdserve.engine.sampling.params import SamplingParams
    from tests.factories import assert_greedy_matches, make_engine, random_prompts

    directory, hf = tiny_llama_dir
    engine = make_engine(directory, device=DEVICE.type, attention_backend="triton", max_num_batched_tokens=16)
    assert engine.runner.backend.name == "triton"
    prompts = random_prompts(2, [9, 37], seed=5)
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))):
        assert_greedy_matches(hf, prompt, out.token_ids, 6, what=f"prompt of {len(prompt)} tokens")


def test_the_kernels_compile_for_an_h100(tmp_path):
    """What the interpreter does not check (the tile shapes tl.dot takes, types, shared
    memory), Triton's own compiler does, down to sm_90 machine code, with no GPU: the decode
    and prefill launches for SmolLM2's heads, bfloat16 and float32 (bfloat16 with a window
    too), split-KV decode's two kernels (Llama-3.1-8B's heads too), and the K/V store
    (tests/engine/triton_compile.py, in a process without the interpreter, compiling afresh
    into its own cache). A loop-carried value whose type changes, which the interpreter runs,
    fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(ROOT))
    # Two processes, a part each (about half the wall time where two cores are free), each with
    # its own fresh cache.
    parts = [subprocess.Popen([sys.executable, "-m", "tests.engine.triton_compile", "90", part], cwd=ROOT,
                              env={**env, "TRITON_CACHE_DIR": str(tmp_path / part)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in ("attention", "others")]
    outputs = [p.communicate(timeout=600) for p in parts]
    for p, (_, err) in zip(parts, outputs):
        assert p.returncode == 0, err[-4000:]
    assert "".join(out for out, _ in outputs).splitlines() == ["attention bf16 9/3 query 1", "attention bf16 9/3 query 64",
                                        "attention fp32 9/3 query 1", "attention fp32 9/3 query 64",
                                        "attention bf16 9/3 query 1 window 512",
                                        "attention bf16 9/3 query 64 window 512", "split-kv bf16 9/3x64",
                                        "split-kv bf16 32/8x128", "split-kv fp32 32/8x128",
                                        "split-kv bf16 32/8x128 window 512", "store bf16",
                                        # the fused norm, silu * up and RoPE (kernels/triton_fused.py)
                                        *(f"{kernel} {dtype}{tail}" for dtype in ("bf16", "fp32")
                                          for kernel, tail in (("rms_norm", ""), ("rms_norm", " residual"),
                                                               ("silu_mul", ""), ("rotary", " 9/3")))]
