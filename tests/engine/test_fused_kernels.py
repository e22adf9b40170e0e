"""pdserve's fused decoder-layer kernels (pdserve/engine/kernels/csrc/fused.cpp).

``rope_store_kv`` must give exactly the bits of the eager ops it replaces (split, RoPE as
transformers writes it, ``index_put_`` into the cache), in every dtype: float32 output is
promised equal to transformers. ``silu_mul`` must be row-local and close to the float64
formula; in bfloat16 it may differ from torch's own silu in the last bit (another exp).
"""

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.base import AttentionBackend, build_context
from pdserve.engine.attention.paged import PagedAttention
from pdserve.engine.linear import PackedSiluAndMul, select_backend
from pdserve.engine.layers.activation import SiluAndMul
from pdserve.engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 + FMA")

NH, NKV, HD, BS = 9, 3, 64, 16  # the default model's attention geometry


@pytest.fixture(scope="module", autouse=True)
def kernels():
    select_backend(torch.bfloat16, torch.device("cpu"))
    PagedAttention(NH, NKV, HD)  # loads the kernels, registers their fakes


class EagerPrologue(AttentionBackend):
    """The generic split + RoPE path, stopping where a backend's attention would start."""

    def forward(self, q, k, v, k_cache, v_cache, ctx, window=None):
        k_cache.index_put_((ctx.slot_block, ctx.slot_offset), k)
        v_cache.index_put_((ctx.slot_block, ctx.slot_offset), v)
        return q


def step(dtype, starts, query_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    qkv = (torch.randn(t, (NH + 2 * NKV) * HD, generator=g) * 3).to(dtype)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(starts))]
    ctx, positions = build_context(starts, query_lens, tables, BS, torch.device("cpu"), decode=False)
    rope = RotaryEmbedding(HD, 4096, 10000.0).tables(positions, dtype)
    return qkv, rope, ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("starts,query_lens", [([0], [1]), ([37], [1]), ([0, 5, 90], [17, 1, 3]), ([0], [100])])
def test_rope_store_kv_is_bitwise_the_eager_ops(dtype, starts, query_lens):
    qkv, rope, ctx = step(dtype, starts, query_lens)
    caches = [torch.zeros(32, BS, 2, NKV, HD, dtype=dtype) for _ in range(2)]  # (blocks, bs, K|V, nkv, hd)
    want_q = EagerPrologue().attend(qkv, rope, caches[0][:, :, 0], caches[0][:, :, 1], ctx, NH, NKV, HD)
    got_q = torch.ops.pdserve.rope_store_kv(qkv, rope[0], rope[1], caches[1][:, :, 0], caches[1][:, :, 1],
                                            ctx.slot_block, ctx.slot_offset, NH, NKV)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[1], caches[0])
    assert caches[0].abs().sum() > 0  # something was stored


def test_rope_store_kv_rejects_mismatched_inputs_naming_them():
    qkv, rope, ctx = step(torch.float32, [0], [4])
    cache = torch.zeros(8, BS, 2, NKV, HD)
    with pytest.raises(RuntimeError, match="qkv width"):
        torch.ops.pdserve.rope_store_kv(qkv[:, :-8].contiguous(), rope[0], rope[1], cache[:, :, 0], cache[:, :, 1],
                                        ctx.slot_block, ctx.slot_offset, NH, NKV)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.pdserve.rope_store_kv(qkv, rope[0].bfloat16(), rope[1], cache[:, :, 0], cache[:, :, 1],
                                        ctx.slot_block, ctx.slot_offset, NH, NKV)


def test_silu_mul_is_close_to_float64_and_row_local():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 2 * 1539, generator=g) * 6).bfloat16()  # 1539: a tail past the last 8 lanes
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0]).bfloat16()
    got = PackedSiluAndMul()(x)
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-30)  # within bfloat16's two roundings
    torch_bf16 = SiluAndMul()(x)
    assert (got != torch_bf16).float().mean() < 0.01  # torch's own bfloat16 path: rare last-bit differences
    for m in (1, 7, 33):
        assert torch.equal(PackedSiluAndMul()(x[m:m + 1]), got[m:m + 1])


def test_fused_ops_pass_torch_opcheck_for_compiled_graphs():
    qkv, rope, ctx = step(torch.bfloat16, [3], [2])
    cache = torch.zeros(8, BS, 2, NKV, HD, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pdserve.rope_store_kv.default,
                          (qkv, rope[0], rope[1], cache[:, :, 0], cache[:, :, 1], ctx.slot_block, ctx.slot_offset,
                           NH, NKV))
    torch.library.opcheck(torch.ops.pdserve.silu_mul.default, (torch.randn(3, 16).bfloat16(),))


def test_add_rms_norm_equals_the_add_then_the_norm():
    """The fused residual add rounds the sum to bfloat16 first, as ``h = h + sublayer(h)`` does."""
    from pdserve.engine.linear import PackedRMSNorm
    from pdserve.engine.layers.norm import RMSNorm

    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=torch.Generator().manual_seed(2))).bfloat16()
    packed = PackedRMSNorm(norm)
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(2, 40, 576, generator=g) * 4).bfloat16()
    y, h = packed(x, residual)
    assert torch.equal(h, x + residual)
    assert torch.equal(y, packed(x + residual))
    torch_y, torch_h = norm.to(torch.bfloat16)(x, residual)  # the torch path of the same module
    assert torch.equal(torch_h, h)
    torch.library.opcheck(torch.ops.pdserve.add_rms_norm.default, (x[:3], residual[:3], norm.weight, 1e-5))


def test_every_kernel_path_gives_the_avx2_bits_for_silu_mul(kernel_path):
    """silu_mul runs sixteen lanes on the AVX-512 paths: elementwise, the same IEEE operations,
    so the AVX2 bits, tails (a width of 24 = 16 + 8, and 13) and underflow included."""
    g = torch.Generator().manual_seed(3)
    rows = [(torch.randn(5, 2 * width, generator=g) * 8).bfloat16() for width in (1536, 24, 13)]
    rows[0][0, :4] = torch.tensor([-200.0, 100.0, 0.0, float("nan")])
    on_path = [torch.ops.pdserve.silu_mul(r) for r in rows]
    cpu_kernels.set_isa("avx2")
    for got, r in zip(on_path, rows):
        assert torch.equal(got.view(torch.int16), torch.ops.pdserve.silu_mul(r).view(torch.int16))
