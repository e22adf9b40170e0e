"""torch.ops.pdserve.paged_attention: against a float64 reference, and batch invariance.

The cache here has the engine's layout (a 6-D block-first tensor seen through strided layer
views), block tables are shuffled (a sequence's blocks are not adjacent) and lengths end in
partly filled blocks.
"""

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.paged import load_kernel

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 and FMA")

NH, NKV, HD, BS = 9, 3, 64, 16  # the default model's attention geometry


@pytest.fixture(scope="module")
def op():
    load_kernel()
    return torch.ops.pdserve.paged_attention


def make_cache(dtype, num_blocks=160, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, layers, 2, BS, NKV, HD, generator=g).to(dtype)  # the engine's layout
    return cache[:, 1, 0], cache[:, 1, 1]  # strided (num_blocks, BS, NKV, HD) views


def make_batch(query_lens, context_lens, dtype, num_blocks=160, seed=1):
    """q (T, NH, HD) and shuffled int32 block tables for the given lengths."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-c // BS) for c in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    used = 0
    for i, c in enumerate(context_lens):
        n = -(-c // BS)
        tables[i, :n] = perm[used:used + n]
        used += n
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), NH, HD, generator=g).to(dtype)
    return q, tables, cu, torch.tensor(context_lens, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, cu, ctx, scale=HD ** -0.5, window=None):
    """Causal softmax attention in float64, sequence by sequence, over gathered K/V; with a
    window, a query at position p sees p - window + 1 .. p only."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for b, c in enumerate(ctx.tolist()):
        s, e = cu[b].item(), cu[b + 1].item()
        blocks = tables[b, : -(-c // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(group, 1)  # (c, nh, hd)
        v = v_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * scale
        pos = torch.arange(c - (e - s), c).unsqueeze(1)
        keys = torch.arange(c).unsqueeze(0)
        hidden = (keys > pos) | (keys <= pos - window) if window else keys > pos
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


CASES = {
    "decode": ([1, 1, 1, 1], [1, 17, 300, 64]),
    "prefill": ([40, 7, 129], [40, 7, 129]),
    "chunked-prefill": ([32, 50], [96, 150]),  # later chunks of long prompts
    "mixed": ([1, 33, 1, 5, 1], [250, 33, 16, 200, 2]),  # decode rows beside prompt chunks
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(op, kernel_path, case, dtype, tol):
    k_cache, v_cache = make_cache(dtype)
    q, tables, cu, ctx = make_batch(*CASES[case], dtype)
    out = op(q, k_cache, v_cache, tables, cu, ctx, HD ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_cache, v_cache, tables, cu, ctx)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_a_query_that_sees_one_key_returns_that_value(op):
    k_cache, v_cache = make_cache(torch.float32)
    q, tables, cu, ctx = make_batch([1], [1], torch.float32)
    out = op(q, k_cache, v_cache, tables, cu, ctx, HD ** -0.5)
    expected = v_cache[tables[0, 0].item(), 0].repeat_interleave(NH // NKV, 0)  # (NH, HD)
    assert torch.equal(out[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_is_bitwise_the_same_alone_and_in_any_batch(op, kernel_path, dtype):
    k_cache, v_cache = make_cache(dtype)
    q, tables, cu, ctx = make_batch([1, 20, 1, 1, 7], [333, 20, 5, 71, 100], dtype)
    batched = op(q, k_cache, v_cache, tables, cu, ctx, HD ** -0.5)
    for b in range(len(ctx)):
        s, e = cu[b].item(), cu[b + 1].item()
        alone = op(q[s:e], k_cache, v_cache, tables[b:b + 1, : -(-ctx[b].item() // BS)].contiguous(),
                   torch.tensor([0, e - s], dtype=torch.int32), ctx[b:b + 1], HD ** -0.5)
        assert torch.equal(alone, batched[s:e]), f"sequence {b}"
    # Reversed batch order: same rows, same bits.
    order = list(reversed(range(len(ctx))))
    rows = torch.cat([torch.arange(cu[b].item(), cu[b + 1].item()) for b in order])
    lens = (cu[1:] - cu[:-1])[order]
    cu_rev = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    rev = op(q[rows], k_cache, v_cache, tables[order].contiguous(), cu_rev, ctx[order].contiguous(), HD ** -0.5)
    assert torch.equal(rev, batched[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prompt_and_decode_give_the_whole_prompts_bits(op, kernel_path, dtype):
    """Every way of splitting a 150-token sequence into steps yields the same bits per position:
    whole prefill, chunks of 32 (with a decode row beside them), and one token at a time (the
    decode path a sequence takes before a preemption recompute)."""
    k_cache, v_cache = make_cache(dtype)
    n = 150
    q, tables, _, _ = make_batch([n], [n], dtype)
    whole = op(q, k_cache, v_cache, tables, torch.tensor([0, n], dtype=torch.int32),
               torch.tensor([n], dtype=torch.int32), HD ** -0.5)
    other_q, other_tables, _, _ = make_batch([1], [90], dtype, seed=7)
    for start in range(0, n, 32):
        end = min(n, start + 32)
        # This chunk, then a decode row of an unrelated sequence.
        qq = torch.cat([q[start:end], other_q])
        width = max(tables.shape[1], other_tables.shape[1])
        tt = torch.zeros(2, width, dtype=torch.int32)
        tt[0, : tables.shape[1]], tt[1, : other_tables.shape[1]] = tables[0], other_tables[0]
        out = op(qq, k_cache, v_cache, tt, torch.tensor([0, end - start, end - start + 1], dtype=torch.int32),
                 torch.tensor([end, 90], dtype=torch.int32), HD ** -0.5)
        assert torch.equal(out[: end - start], whole[start:end]), f"chunk at {start}"
    for pos in (0, 15, 16, 17, 63, 149):
        one = op(q[pos:pos + 1], k_cache, v_cache, tables, torch.tensor([0, 1], dtype=torch.int32),
                 torch.tensor([pos + 1], dtype=torch.int32), HD ** -0.5)
        assert torch.equal(one, whole[pos:pos + 1]), f"position {pos}"


def test_thread_count_does_not_change_the_bits(op, kernel_path):
    k_cache, v_cache = make_cache(torch.bfloat16)
    q, tables, cu, ctx = make_batch([1, 64, 1, 17, 1], [400, 64, 33, 200, 8], torch.bfloat16)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(op(q, k_cache, v_cache, tables, cu, ctx, HD ** -0.5))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(tables=a["tables"].long()), "int32"),
    (lambda a: a["tables"].__setitem__((0, 0), 10_000), "num_blocks"),
    (lambda a: a.update(ctx=a["ctx"] * 0), "query_len"),
    (lambda a: a.update(cu=a["cu"][:-1].contiguous()), "cu_query_lens"),
    (lambda a: a.update(q=a["q"].double()), "dtype"),
    (lambda a: a.update(tables=a["tables"][:, :1].contiguous()), "blocks"),
])
def test_bad_inputs_raise_errors_naming_the_field(op, change, message):
    k_cache, v_cache = make_cache(torch.float32)
    q, tables, cu, ctx = make_batch([3, 1], [40, 50], torch.float32)
    args = dict(q=q, tables=tables, cu=cu, ctx=ctx)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        op(args["q"], k_cache, v_cache, args["tables"], args["cu"], args["ctx"], HD ** -0.5)


def test_auto_picks_the_paged_kernel_on_cpu_and_names_are_checked():
    from pdserve.engine.attention.select import select_backend

    backend = select_backend("auto", torch.device("cpu"), NH, NKV, HD, BS)
    assert backend.name == "paged" and backend.batch_invariant
    assert select_backend("sdpa", torch.device("cpu"), NH, NKV, HD, BS).name == "sdpa"
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("fast", torch.device("cpu"), NH, NKV, HD, BS)
    with pytest.raises(ValueError, match="head_dim"):
        select_backend("paged", torch.device("cpu"), 4, 2, 12, BS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_kernel_path_gives_the_avx2_bits_but_the_pairs_kernels_in_bfloat16(op, kernel_path, dtype):
    """Paths with AVX-512 run prefill tiles through their own loops (attention_avx512.cpp),
    decode rows through the AVX2 ones: both must give the AVX2 loops' bits, or a position's
    result would change between a prefill and a recompute. A mixed batch exercises both, a
    head_dim of 80 the 16-column tail, and 8 a head_dim the wide loops leave to AVX2. In
    bfloat16 the avx512_bf16 and amx paths run pairs kernels (attention_bf16.cpp, VDPBF16PS;
    attention_amx.cpp, tiles) with bits of their own, held to the float64 reference here (and
    to their own invariance by the tests above); a head_dim they do not take (80, 8) stays on
    the AVX2 bits there too."""
    k, v = make_cache(dtype)
    q, tables, cu, ctx = make_batch(*CASES["mixed"], dtype)
    on_path = op(q, k, v, tables, cu, ctx, HD ** -0.5)
    g = torch.Generator().manual_seed(5)
    odd = [torch.randn(40, BS, 2, hd, generator=g).to(dtype) for hd in (80, 8)]
    q_odd = [torch.randn(70, 4, hd, generator=g).to(dtype) for hd in (80, 8)]
    odd_tables = torch.arange(40, dtype=torch.int32).view(2, 20)
    odd_cu, odd_ctx = torch.tensor([0, 64, 70], dtype=torch.int32), torch.tensor([300, 6], dtype=torch.int32)
    odd_on_path = [op(qo, c, c, odd_tables, odd_cu, odd_ctx, 0.1) for qo, c in zip(q_odd, odd)]
    cpu_kernels.set_isa("avx2")
    avx2 = op(q, k, v, tables, cu, ctx, HD ** -0.5)
    if kernel_path in ("avx512_bf16", "amx") and dtype == torch.bfloat16:
        assert not torch.equal(on_path, avx2)  # the pairs kernels did run
        torch.testing.assert_close(on_path.double(), reference(q, k, v, tables, cu, ctx), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(on_path, avx2)
    for got, qo, c in zip(odd_on_path, q_odd, odd):
        assert torch.equal(got, op(qo, c, c, odd_tables, odd_cu, odd_ctx, 0.1))


@pytest.mark.parametrize("hd,bs,group", [(32, 16, 1), (128, 32, 4), (64, 48, 2)])
def test_tile_geometries_match_the_reference_and_their_decode(op, kernel_path, hd, bs, group):
    """Head dims of one to four tile steps (32, 128: two passes over the output's columns),
    blocks of 32 and 48 keys (several tiles of keys a block), 16 query rows of a group of
    heads in one tile and not: against float64, and a decode row against its prefill's bits."""
    g = torch.Generator().manual_seed(11)
    nkv, blocks = 2, 40
    cache = torch.randn(blocks, 2, 2, bs, nkv, hd, generator=g).to(torch.bfloat16)
    k, v = cache[:, 1, 0], cache[:, 1, 1]
    lens = [70, 3 * bs + 5]
    tables = torch.zeros(2, 10, dtype=torch.int32)
    tables[0, : -(-lens[0] // bs)] = torch.arange(-(-lens[0] // bs), dtype=torch.int32) + 20
    tables[1, : -(-lens[1] // bs)] = torch.arange(-(-lens[1] // bs), dtype=torch.int32)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens), nkv * group, hd, generator=g).to(torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = op(q, k, v, tables, cu, ctx, hd ** -0.5)
    ref = reference(q, k, v, tables, cu, ctx, hd ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    last = sum(lens) - 1  # the second sequence's last position, decoded alone
    one = op(q[last:], k, v, tables[1:], torch.tensor([0, 1], dtype=torch.int32), ctx[1:], hd ** -0.5)
    assert torch.equal(one, out[last:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_the_cache_holds_past_a_sequence_never_reaches_its_result(op, kernel_path, dtype):
    """The slots of a sequence's last block past its end hold another sequence's K/V, or
    anything: NaN and infinity there change no bit of the result (the amx path's tiles read
    them and drop their scores; a probability past a row's end is an exact zero)."""
    k, v = make_cache(dtype)
    q, tables, cu, ctx = make_batch([1, 9, 1], [37, 9, 300], dtype)
    clean = op(q, k, v, tables, cu, ctx, HD ** -0.5)
    for b, c in enumerate(ctx.tolist()):
        block = tables[b, c // BS].item()
        k[block, c % BS:] = float("nan")
        v[block, c % BS:] = float("inf")
    poisoned = op(q, k, v, tables, cu, ctx, HD ** -0.5)
    assert torch.equal(poisoned, clean) and not poisoned.isnan().any()


# Sliding windows (Gemma 3's local layers): a query at position p sees p - window + 1 .. p.
# (query_lens, context_lens, window): windows within a block and across several, shorter and
# longer than a 32-query tile, starting inside earlier chunks, and a window of one key.
WINDOW_CASES = {
    "decode": ([1, 1, 1, 1], [1, 17, 300, 64], 16),
    "prefill": ([40, 7, 129], [40, 7, 129], 33),
    "chunked-prefill": ([32, 50], [96, 150], 40),
    "mixed": ([1, 33, 1, 5, 1], [250, 33, 16, 200, 2], 8),
    "window-of-one": ([20, 1], [20, 90], 1),
    "long-window": ([70, 1], [300, 301], 100),
}


def windowed(op, q, tables, cu, ctx, k_cache, v_cache, window, scale=HD ** -0.5):
    return op(q, k_cache, v_cache, tables, cu, ctx, scale, window)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_a_sliding_window_matches_the_masked_reference(op, kernel_path, case, dtype, tol):
    query_lens, context_lens, window = WINDOW_CASES[case]
    k_cache, v_cache = make_cache(dtype)
    q, tables, cu, ctx = make_batch(query_lens, context_lens, dtype)
    out = windowed(op, q, tables, cu, ctx, k_cache, v_cache, window)
    ref = reference(q, k_cache, v_cache, tables, cu, ctx, window=window)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # The window matters here: full attention gives something else.
    assert not torch.allclose(ref, reference(q, k_cache, v_cache, tables, cu, ctx), rtol=tol, atol=tol)


def test_no_window_and_a_window_over_the_whole_context_are_the_unwindowed_bits(op, kernel_path):
    k_cache, v_cache = make_cache(torch.bfloat16)
    q, tables, cu, ctx = make_batch(*CASES["mixed"], torch.bfloat16)
    plain = op(q, k_cache, v_cache, tables, cu, ctx, HD ** -0.5)
    assert torch.equal(windowed(op, q, tables, cu, ctx, k_cache, v_cache, 0), plain)
    assert torch.equal(windowed(op, q, tables, cu, ctx, k_cache, v_cache, int(ctx.max())), plain)
    with pytest.raises(RuntimeError, match="window"):
        windowed(op, q, tables, cu, ctx, k_cache, v_cache, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_sequence_is_bitwise_the_same_alone_in_any_batch_and_at_any_thread_count(op, kernel_path, dtype):
    window = 24
    k_cache, v_cache = make_cache(dtype)
    q, tables, cu, ctx = make_batch([1, 70, 1, 1, 7], [333, 70, 5, 71, 100], dtype)
    batched = windowed(op, q, tables, cu, ctx, k_cache, v_cache, window)
    for b in range(len(ctx)):
        s, e = cu[b].item(), cu[b + 1].item()
        alone = windowed(op, q[s:e], tables[b:b + 1, : -(-ctx[b].item() // BS)].contiguous(),
                         torch.tensor([0, e - s], dtype=torch.int32), ctx[b:b + 1], k_cache, v_cache, window)
        assert torch.equal(alone, batched[s:e]), f"sequence {b}"
    order = list(reversed(range(len(ctx))))
    rows = torch.cat([torch.arange(cu[b].item(), cu[b + 1].item()) for b in order])
    lens = (cu[1:] - cu[:-1])[order]
    cu_rev = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    rev = windowed(op, q[rows], tables[order].contiguous(), cu_rev, ctx[order].contiguous(), k_cache, v_cache, window)
    assert torch.equal(rev, batched[rows])
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(windowed(op, q, tables, cu, ctx, k_cache, v_cache, window), batched), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window", [8, 40, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_chunks_and_decode_give_the_whole_prompts_bits(op, kernel_path, dtype, window):
    """A 150-token sequence with a window of 8 (inside a block), 40 (across blocks and chunks)
    or 100 (longer than a chunk): chunks of 32 whose windows reach back into earlier chunks (a
    decode row of another sequence beside each), and one token at a time, give the whole
    prefill's bits at every position; and those equal the masked reference."""
    k_cache, v_cache = make_cache(dtype)
    n = 150
    q, tables, _, _ = make_batch([n], [n], dtype)
    whole = windowed(op, q, tables, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                     k_cache, v_cache, window)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(whole.double(), reference(q, k_cache, v_cache, tables, torch.tensor([0, n]),
                                                         torch.tensor([n]), window=window), rtol=tol, atol=tol)
    other_q, other_tables, _, _ = make_batch([1], [90], dtype, seed=7)
    for start in range(0, n, 32):
        end = min(n, start + 32)
        qq = torch.cat([q[start:end], other_q])
        width = max(tables.shape[1], other_tables.shape[1])
        tt = torch.zeros(2, width, dtype=torch.int32)
        tt[0, : tables.shape[1]], tt[1, : other_tables.shape[1]] = tables[0], other_tables[0]
        out = windowed(op, qq, tt, torch.tensor([0, end - start, end - start + 1], dtype=torch.int32),
                       torch.tensor([end, 90], dtype=torch.int32), k_cache, v_cache, window)
        assert torch.equal(out[: end - start], whole[start:end]), f"chunk at {start}"
    for pos in (0, 7, 8, 15, 16, 17, 39, 40, 41, 63, 99, 100, 149):
        one = windowed(op, q[pos:pos + 1], tables, torch.tensor([0, 1], dtype=torch.int32),
                       torch.tensor([pos + 1], dtype=torch.int32), k_cache, v_cache, window)
        assert torch.equal(one, whole[pos:pos + 1]), f"position {pos}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_kernel_path_gives_the_avx2_bits_with_a_window(op, kernel_path, dtype):
    """As without a window: the AVX-512 loops (prefill tiles) give the AVX2 loops' bits, the
    pairs kernels (bfloat16 on avx512_bf16 and amx) their own, held to the reference."""
    window = 37
    k, v = make_cache(dtype)
    q, tables, cu, ctx = make_batch([1, 64, 1, 5, 40], [250, 64, 16, 200, 140], dtype)
    on_path = windowed(op, q, tables, cu, ctx, k, v, window)
    cpu_kernels.set_isa("avx2")
    avx2 = windowed(op, q, tables, cu, ctx, k, v, window)
    if kernel_path in ("avx512_bf16", "amx") and dtype == torch.bfloat16:
        torch.testing.assert_close(on_path.double(), reference(q, k, v, tables, cu, ctx, window=window),
                                   rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(on_path, avx2)
