"""Split-KV decode attention (pdserve/engine/attention/triton.py, ``split_kv_attention``):
each decode row's keys split into runs, each run's partial softmax into a float32 scratch,
the runs merged. Checked against SDPA over the gathered context and against the single-pass
kernel, and each split's partial against the keys it should have walked, so that a merge
that drops or double-counts a run, or a run that covers the wrong keys, fails here. Runs in
Triton's interpreter without CUDA, as tests/engine/test_triton_attention.py does.
"""

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from pdserve.engine.attention import triton as attention  # noqa: E402
from pdserve.engine.attention import triton_split as kernels  # noqa: E402
from pdserve.engine.attention.base import build_context  # noqa: E402
from tests.helpers.paged_attention import (BS, DEVICE, HD, TOL, block_tables, paged_cache,  # noqa: E402
                                           sdpa_reference)

N = kernels.BLOCK_N  # 64 keys a tile
NUM_BLOCKS = 96  # room for the longest batch here: 1,536 cached tokens
# Shorter than one split, one tile, one past it, exactly two and four 64-key splits (one of
# 256), 500 (eight splits of 64, the last one short).
CONTEXTS = [1, 64, 65, 128, 256, 500]
PLANS = [(4, 64), (8, 64), (2, 256)]  # (splits, fewest keys a split)


def _decode(nh, nkv, dtype, contexts, padding=0, seed=2):
    """A decode step over ``contexts`` (each row's last token its query), plus ``padding`` rows
    as a CUDA graph pads a batch: one query token, no context, a block table of zeros."""
    k_cache, v_cache = paged_cache(nkv, dtype, num_blocks=NUM_BLOCKS)
    tables = block_tables(contexts, num_blocks=NUM_BLOCKS)
    ctx, _ = build_context([c - 1 for c in contexts], [1] * len(contexts), tables, BS, DEVICE, decode=True)
    b = len(contexts) + padding
    bt = torch.zeros(b, ctx.block_tables.shape[1], dtype=ctx.block_tables.dtype, device=DEVICE)
    bt[:len(contexts)] = ctx.block_tables
    lens = torch.zeros(b, dtype=ctx.context_lens_t.dtype, device=DEVICE)
    lens[:len(contexts)] = ctx.context_lens_t
    cu = torch.arange(b + 1, dtype=ctx.cu_query_lens.dtype, device=DEVICE)
    q = torch.randn(b, nh, HD, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt, cu_query_lens=cu, context_lens=lens,
                scale=HD ** -0.5), tables


def _single_pass(monkeypatch, step, window=None):
    """The one-program-a-(sequence, KV head) kernel, as a launch of one split takes it."""
    monkeypatch.setattr(kernels, "INTERPRETED_SPLITS", 1)
    return attention.paged_attention(max_query_len=1, window=window, **step)


@pytest.mark.parametrize("splits,min_keys", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nh,nkv", [(4, 4), (8, 2)])
def test_split_kv_equals_sdpa_and_the_single_pass_kernel(nh, nkv, dtype, splits, min_keys, monkeypatch):
    """Contexts shorter than a split, at split edges and over every split, with a padding row
    (zeros out, as the single-pass kernel gives it, and no NaN)."""
    step, tables = _decode(nh, nkv, dtype, CONTEXTS, padding=1)
    out = kernels.split_kv_attention(window=None, splits=splits, min_keys=min_keys, **step)
    ref = sdpa_reference(step["q"][:-1], step["k_cache"], step["v_cache"], tables, [c - 1 for c in CONTEXTS],
                         [1] * len(CONTEXTS))
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out[:-1].float(), ref, **TOL[dtype])
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    single = _single_pass(monkeypatch, step)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1e-2)  # a bf16 step
    torch.testing.assert_close(out.float(), single.float(), **tol)


def _expected_splits(ctx_len, splits, min_keys, window=None):
    """The keys each split should walk: from the window's first key tile, runs of whole tiles,
    at least ``min_keys``, as few splits as that allows."""
    first = max(ctx_len - window, 0) // N * N if window else 0
    per = max(math.ceil((ctx_len - first) / (splits * N)) * N, min_keys)
    return [range(min(first + s * per, ctx_len), min(first + (s + 1) * per, ctx_len)) for s in range(splits)]


@pytest.mark.parametrize("window", [None, 100])
def test_each_split_holds_the_softmax_of_its_own_keys(window):
    """Each split's running max, sum and unnormalised output, float32, against the same sums over
    the keys it should have walked (window masked); splits past the keys hold -inf, 0, 0."""
    nh, nkv, splits, min_keys = 4, 2, 8, 64
    contexts = [1, 100, 500, 700]
    step, tables = _decode(nh, nkv, torch.float32, contexts)
    m, l, acc = kernels.split_partials(window=window, splits=splits, min_keys=min_keys, **step)
    k_cache, v_cache = step["k_cache"], step["v_cache"]
    active = []
    for b, (c, table) in enumerate(zip(contexts, tables)):
        blocks = torch.tensor(table, device=DEVICE)
        k = k_cache[blocks].flatten(0, 1)[:c].repeat_interleave(nh // nkv, 1)  # (c, nh, hd)
        v = v_cache[blocks].flatten(0, 1)[:c].repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("hd,chd->hc", step["q"][b], k) * step["scale"]  # (nh, c)
        if window:
            scores[:, :max(c - window, 0)] = float("-inf")
        ranges = _expected_splits(c, splits, min_keys, window)
        active.append(sum(len(r) > 0 for r in ranges))
        for s, keys in enumerate(ranges):
            sc = scores[:, keys.start:keys.stop]
            want_m = sc.max(1).values if len(keys) else torch.full((nh,), float("-inf"))
            p = torch.exp(sc - want_m[:, None]) if len(keys) else sc
            torch.testing.assert_close(m[b, :, s], want_m, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(l[b, :, s], p.sum(1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(acc[b, :, s], torch.einsum("hc,chd->hd", p, v[keys.start:keys.stop]),
                                       atol=1e-5, rtol=1e-5)
    # A short context fills one split, 500 keys all eight, 700 six of 128 (whole tiles, 8 x 64 too
    # few); with the window of 100, two (from the tile that holds its first key: 384 for 500).
    assert active == ([1, 2, 8, 6] if window is None else [1, 2, 2, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [8, 70, 200])
def test_split_kv_honours_a_sliding_window(window, dtype, monkeypatch):
    """Windows inside a tile, past one and past a split: the splits start at the window's
    first key tile, and the output equals masked SDPA and the single-pass kernel."""
    contexts = [1, 100, 300, 383]
    step, tables = _decode(8, 2, dtype, contexts)
    out = kernels.split_kv_attention(window=window, splits=4, min_keys=64, **step)
    starts, lens = [c - 1 for c in contexts], [1] * len(contexts)
    ref = sdpa_reference(step["q"], step["k_cache"], step["v_cache"], tables, starts, lens, window)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    unwindowed = sdpa_reference(step["q"], step["k_cache"], step["v_cache"], tables, starts, lens)
    assert not torch.allclose(ref, unwindowed, **TOL[dtype])  # the window matters here
    single = _single_pass(monkeypatch, step, window)
    torch.testing.assert_close(out.float(), single.float(), **TOL[dtype])


def test_paged_attention_splits_decode_launches_only():
    """Under the interpreter a decode launch takes ``INTERPRETED_SPLITS`` splits of one key tile
    at least; a launch with a prompt of two tokens takes the single-pass kernel. Both equal
    SDPA."""
    contexts = [300, 20]
    step, tables = _decode(8, 2, torch.float32, contexts)
    out = attention.paged_attention(max_query_len=1, window=None, **step)
    split = kernels.split_kv_attention(window=None, splits=kernels.INTERPRETED_SPLITS, min_keys=N, **step)
    assert torch.equal(out, split)
    ref = sdpa_reference(step["q"], step["k_cache"], step["v_cache"], tables, [c - 1 for c in contexts], [1, 1])
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_splits_fill_the_gpu_from_the_batch_alone(monkeypatch):
    """On a GPU the split count comes from the batch, the KV heads and the SM count: 132 SMs
    (an H100/H200) and 8 KV heads (Llama-3.1-8B) give 32 splits at batch 1, 4 at batch 8 and
    the single-pass kernel (1) from batch 32; never more than 32."""
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert [kernels.decode_splits(b, 8, cuda) for b in (1, 2, 4, 8, 16, 32, 64)] == [32, 16, 8, 4, 2, 1, 1]
    assert kernels.decode_splits(1, 1, cuda) == 32


def test_a_bad_split_plan_is_refused():
    step, _ = _decode(4, 4, torch.float32, [10])
    for splits, min_keys in ((1, 64), (3, 64), (4, 32), (4, 100)):
        with pytest.raises(ValueError, match="split-KV"):
            kernels.split_partials(window=None, splits=splits, min_keys=min_keys, **step)
