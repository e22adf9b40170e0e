"""Sliding-window attention through the engine's backend interface: a layer's ``window``
(decoder.Attention's, from ``ModelConfig.layer_windows``) reaches ``attend``, and each K/V
backend lets a query at position p see p - window + 1 .. p only.

SDPA and the paged kernel are checked here against a float64 masked reference, on random
inputs, in prefill (prompts longer than the window), chunked prefill whose windows reach back
into earlier chunks, decode (one group per context length) and mixed steps. The paged kernel's
own bits (batch invariance, every kernel path) are tests/engine/test_paged_attention.py's,
Triton's tests/engine/test_triton_attention.py's. flash-attn needs CUDA: here only what it is
handed (its own ``window_size``) is checked, on a stand-in module.
"""

import sys
import types

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.base import SdpaAttention, build_context
from pdserve.engine.config import ModelConfig
from pdserve.engine.attention.kv_cache import layer_views
from pdserve.engine.layers.rotary import RotaryEmbedding, apply_rotary
from tests.helpers.paged_attention import block_tables

NH, NKV, HD, BS, NUM_BLOCKS = 8, 2, 32, 16, 40


def cache(seed=0):
    g = torch.Generator().manual_seed(seed)
    return layer_views(torch.randn(NUM_BLOCKS, 2, 2, BS, NKV, HD, generator=g), 1)


def reference(q, k_cache, v_cache, tables, starts, query_lens, window, scale=HD ** -0.5):
    """float64 softmax attention per sequence, every key masked but p - window + 1 .. p."""
    outs, t = [], 0
    for table, s, n in zip(tables, starts, query_lens):
        c = s + n
        blocks = torch.tensor(table)
        k = k_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(NH // NKV, 1)  # (c, nh, hd)
        v = v_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(NH // NKV, 1)
        scores = torch.einsum("qhd,khd->hqk", q[t:t + n].double(), k) * scale
        keys, pos = torch.arange(c)[None, :], torch.arange(s, c)[:, None]
        hidden = (keys > pos) | (keys <= pos - window) if window else keys > pos
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
        t += n
    return torch.cat(outs)


def step(starts, query_lens, seed=2):
    """A step's context and random q, k, v for its new tokens (T, heads, hd)."""
    tables = block_tables([s + n for s, n in zip(starts, query_lens)], num_blocks=NUM_BLOCKS)
    ctx, positions = build_context(starts, query_lens, tables, BS, torch.device("cpu"),
                                   decode=all(n == 1 for n in query_lens))
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, HD, generator=g) for h in (NH, NKV, NKV))
    return ctx, positions, tables, q, k, v


def backends():
    found = [SdpaAttention(NH, NKV, HD)]
    if cpu_kernels.cpu_supported():
        from pdserve.engine.attention.paged import PagedAttention

        found.append(PagedAttention(NH, NKV, HD))
    return found


STEPS = {  # (cached tokens, new tokens) per sequence
    "prefill": ([0, 0], [40, 9]),  # one prompt longer than every window, one shorter than some
    "chunk-after-prefix": ([30, 16], [37, 20]),  # chunks whose windows start in earlier chunks
    "decode": ([0, 15, 16, 69, 69], [1, 1, 1, 1, 1]),  # two rows of one context length: one group
    "mixed": ([100, 0, 33], [1, 24, 9]),
}


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("window", [1, 8, 20, 64])
@pytest.mark.parametrize("case", sorted(STEPS))
def test_each_backend_with_a_window_equals_the_masked_reference(backend, case, window):
    starts, query_lens = STEPS[case]
    ctx, _, tables, q, k, v = step(starts, query_lens)
    k_cache, v_cache = cache()
    out = backend.forward(q, k, v, k_cache, v_cache, ctx, window=window)
    ref = reference(q, k_cache, v_cache, tables, starts, query_lens, window)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_no_window_is_full_causal_attention(backend):
    starts, query_lens = STEPS["mixed"]
    ctx, _, tables, q, k, v = step(starts, query_lens)
    k_cache, v_cache = cache()
    out = backend.forward(q, k, v, k_cache, v_cache, ctx)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, starts, query_lens, None),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_a_windowed_prompt_in_chunks_and_then_decoded_equals_it_whole(backend):
    """A 90-token prompt, window 24: prefilled in chunks of 16 (each window reaching across the
    chunk boundary), then positions one at a time, against the whole prompt's outputs. The
    paged kernel gives the very bits; SDPA rounds its calls differently."""
    n, window = 90, 24
    tables = block_tables([n], num_blocks=NUM_BLOCKS)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, HD, generator=g) for h in (NH, NKV, NKV))
    whole_cache = cache()
    ctx, _ = build_context([0], [n], tables, BS, torch.device("cpu"), decode=False)
    whole = backend.forward(q, k, v, *whole_cache, ctx, window=window)
    chunked_cache = cache()
    exact = backend.name == "paged"
    for start in range(0, n, 16):
        end = min(n, start + 16)
        ctx, _ = build_context([start], [end - start], tables, BS, torch.device("cpu"), decode=False)
        out = backend.forward(q[start:end], k[start:end], v[start:end], *chunked_cache, ctx, window=window)
        if exact:
            assert torch.equal(out, whole[start:end]), f"chunk at {start}"
        else:
            torch.testing.assert_close(out, whole[start:end], rtol=1e-5, atol=1e-5)
    for pos in (0, 23, 24, 25, 47, 89):
        ctx, _ = build_context([pos], [1], tables, BS, torch.device("cpu"), decode=True)
        out = backend.forward(q[pos:pos + 1], k[pos:pos + 1], v[pos:pos + 1], *chunked_cache, ctx, window=window)
        if exact:
            assert torch.equal(out, whole[pos:pos + 1]), f"position {pos}"
        else:
            torch.testing.assert_close(out, whole[pos:pos + 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.double(), reference(q, whole_cache[0], whole_cache[1], tables, [0], [n], window),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_the_paged_fused_prologue_takes_the_window_as_the_generic_path_does():
    """``attend`` (RoPE, store, attention) with a window: the paged backend's fused prologue
    and the generic split + RoPE path agree, and both store the same cache."""
    from pdserve.engine.attention.paged import PagedAttention

    starts, query_lens = STEPS["mixed"]
    ctx, positions, _, _, _, _ = step(starts, query_lens)
    qkv = torch.randn(sum(query_lens), (NH + 2 * NKV) * HD, generator=torch.Generator().manual_seed(4))
    rope = RotaryEmbedding(HD, 256, 10000.0).tables(positions, torch.float32)
    caches = [cache(), cache()]
    ours = PagedAttention(NH, NKV, HD).attend(qkv, rope, *caches[0], ctx, NH, NKV, HD, window=12)
    theirs = SdpaAttention(NH, NKV, HD).attend(qkv, rope, *caches[1], ctx, NH, NKV, HD, window=12)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
    q = apply_rotary(qkv[:, :NH * HD].view(-1, NH, HD), qkv[:, NH * HD:(NH + NKV) * HD].view(-1, NKV, HD), *rope)[0]
    ref = reference(q, *caches[0], block_tables([s + n for s, n in zip(starts, query_lens)], num_blocks=NUM_BLOCKS), starts, query_lens, 12)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.fixture
def fake_flash(monkeypatch):
    """A stand-in flash_attn that records what each call is handed, and returns zeros."""
    calls = []

    def varlen(q, k, v, **kwargs):
        calls.append(("varlen", kwargs))
        return torch.zeros_like(q)

    def with_kvcache(q, k_cache, v_cache, **kwargs):
        calls.append(("kvcache", kwargs))
        return torch.zeros_like(q)

    module = types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


@pytest.mark.parametrize("block_size,invariant", [(16, False), (256, False), (256, True)])
def test_flash_attn_is_handed_its_own_window_size(fake_flash, block_size, invariant):
    """flash-attn's ``window_size=(left, right)`` with ``causal``: a query sees left keys before
    it and right after, so (window - 1, 0); none at all without a window (its default, -1)."""
    from pdserve.engine.attention.flash import FlashAttention

    flash = FlashAttention(NH, NKV, HD, block_size, batch_invariant=invariant)
    k_cache = torch.zeros(4, block_size, NKV, HD)
    v_cache = torch.zeros_like(k_cache)
    for starts, query_lens in ([0, 5], [9, 3]), ([7, 20], [1, 1]):
        tables = [[0], [1]] if block_size == 256 else [[0, 1], [2, 3]]
        ctx, _ = build_context(starts, query_lens, tables, block_size, torch.device("cpu"),
                               decode=query_lens == [1, 1])
        t = sum(query_lens)
        q, k, v = torch.zeros(t, NH, HD), torch.zeros(t, NKV, HD), torch.zeros(t, NKV, HD)
        flash.forward(q, k, v, k_cache, v_cache, ctx, window=512)
        flash.forward(q, k, v, k_cache, v_cache, ctx)
    assert [kw.get("window_size") for _, kw in fake_flash] == [(511, 0), None] * 2
    assert all(kw["causal"] for _, kw in fake_flash)


def tiny_config(**fields):
    return ModelConfig("llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=False, **fields)


def test_layer_windows_reach_each_layer_and_cap_no_context():
    from pdserve.engine.models.decoder import CausalLM

    cfg = tiny_config(layer_windows=(8, 8, None))
    assert [cfg.window(i) for i in range(3)] == [8, 8, None]
    assert cfg.max_model_len == 4096  # windows run windowed: the context is the model's whole one
    assert tiny_config(sliding_window=2047).max_model_len == 2047  # Mistral's cap, as before
    assert tiny_config().window(0) is None
    with torch.device("meta"):
        model = CausalLM(cfg)
    assert [layer.self_attn.window for layer in model.layers] == [8, 8, None]


def test_a_layer_hands_its_window_to_the_backend():
    from pdserve.engine.models.decoder import CausalLM

    seen = []

    class Recording:
        def attend(self, qkv, rope, k_cache, v_cache, ctx, nh, nkv, hd, window=None):
            seen.append(window)
            return qkv.new_zeros(qkv.shape[0], nh, hd)

    model = CausalLM(tiny_config(layer_windows=(8, None, 3)))
    model.bind_caches([(None, None)] * 3, Recording())
    ctx, positions = build_context([0], [4], [[0]], BS, torch.device("cpu"), decode=False)
    with torch.no_grad():
        model(torch.tensor([1, 2, 3, 4]), positions, ctx)
    assert seen == [8, None, 3]


def test_a_window_below_one_key_is_refused():
    from pdserve.engine.models.decoder import Attention

    with pytest.raises(ValueError, match="window"):
        Attention(tiny_config(), window=0)


@pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 and FMA")
def test_the_packed_whole_stack_call_is_not_used_for_windowed_layers():
    """The C++ whole-stack call (linear.py) attends over every key: a model with a sliding
    layer runs its layers one by one, where each hands its window to the backend."""
    from pdserve.engine.linear import PackedCpuBackend
    from pdserve.engine.models.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(tiny_config(layer_windows=(None, 8, None)))
    assert PackedCpuBackend(torch.bfloat16).stack(model.layers) is None
