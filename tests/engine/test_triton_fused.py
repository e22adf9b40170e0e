"""The fused Triton kernels of the CUDA path (pdserve/engine/kernels/triton_fused.py) against the
torch ops they replace: ``RMSNorm`` (its residual add too), ``SiluAndMul`` and ``apply_rotary``.

Without CUDA they run in Triton's interpreter on host tensors (tests/conftest.py sets
TRITON_INTERPRET=1), with CUDA on the GPU. Measured on the interpreter (2026-11-30): RoPE is
bitwise torch's in float32, bfloat16 and float16, and the residual sum in float32 and bfloat16.
silu * up is bitwise in bfloat16 (394k elements) and within 3.5e-7 relative in float32 (16% of
elements off in the last bit or two: numpy's exp, not torch's). RMSNorm is within 3.5e-7
relative in float32 (a fifth of the elements: its sum of squares is a tree, torch's is its own
order), and in bfloat16 13 of 1.45M elements differed (rows of 576, 1000 and 4096; all in one
row whose scale sat near a rounding midpoint): the normed value one bfloat16 step off, which the
weight's multiply can make two steps of the output. So the bounds: float32 1e-6 relative;
bfloat16 bitwise but for 1% of the elements, by one step (two for RMSNorm).
"""

import pytest
import torch

triton = pytest.importorskip("triton")

import pdserve.engine.linear as linear  # noqa: E402
from pdserve.engine.attention.triton import TritonAttention  # noqa: E402
from pdserve.engine.kernels.triton_fused import (TritonRMSNorm, TritonSiluAndMul, rms_norm, rotary,  # noqa: E402
                                                 silu_mul)
from pdserve.engine.layers.activation import SiluAndMul  # noqa: E402
from pdserve.engine.layers.norm import RMSNorm  # noqa: E402
from pdserve.engine.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
F32_RTOL = 1e-6


def _randn(*shape, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, what: str, steps: int = 1) -> None:
    """float32: within ``F32_RTOL`` relative; 16-bit: bitwise, but for ``steps`` steps on under
    1% of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.numel() == 0:
        return
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=F32_RTOL, atol=1e-30, msg=what)
        return
    differ = got != want
    _, exponent = torch.frexp(torch.maximum(got.float().abs(), want.float().abs()))  # |v| = m 2^e, m in [0.5, 1)
    step = torch.finfo(want.dtype).eps * torch.pow(2.0, exponent - 1)  # the larger value's spacing
    assert ((got.float() - want.float()).abs() <= steps * step)[differ].all(), f"{what}: off by over {steps} steps"
    assert differ.float().mean() < 0.01, f"{what}: {int(differ.sum())} of {want.numel()} elements differ"


def _norm(n: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = 1 + _randn(n, seed=7, scale=0.3).cpu()
    return norm.to(dtype).to(weight_dtype or dtype).to(DEVICE)  # a loaded model's norm has its dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 64, 1000])  # SmolLM2-135M's hidden size, a head, an odd width
@pytest.mark.parametrize("rows", [0, 1, 9])
def test_rms_norm_is_torchs(dtype, n, rows):
    norm, x = _norm(n, dtype), _randn(rows, n, dtype=dtype)
    _assert_matches(rms_norm(x, norm.weight, norm.eps), norm(x), f"{dtype} {rows}x{n}", steps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 1000])
@pytest.mark.parametrize("rows", [0, 1, 9])
def test_rms_norm_with_the_residual_add_is_torchs(dtype, n, rows):
    """The new residual stream, x + residual rounded to x's dtype, is bitwise torch's."""
    norm, x, residual = _norm(n, dtype), _randn(rows, n, dtype=dtype), _randn(rows, n, seed=1, dtype=dtype)
    got, got_sum = TritonRMSNorm(norm)(x, residual)
    want, want_sum = norm(x, residual)
    assert torch.equal(got_sum, want_sum)
    _assert_matches(got, want, f"{dtype} {rows}x{n} with a residual", steps=2)


def test_rms_norm_promotes_as_torch_does_with_a_float32_weight():
    """A float32 weight on bfloat16 x: torch's ``weight * x`` is float32, x normed and rounded
    to bfloat16 first."""
    norm, x = _norm(576, torch.bfloat16, weight_dtype=torch.float32), _randn(5, 576, dtype=torch.bfloat16)
    got, want = rms_norm(x, norm.weight, norm.eps), norm(x)
    assert want.dtype == torch.float32
    _assert_matches(got, want, "float32 weight")


def test_rms_norm_takes_heads_strided_in_a_fused_projection():
    """Qwen3's q norm: (T, nh, hd) heads of q, a view into q|k|v."""
    norm, qkv = _norm(64, torch.bfloat16), _randn(6, 15 * 64, dtype=torch.bfloat16)
    q = qkv[:, :9 * 64].reshape(6, 9, 64)
    _assert_matches(rms_norm(q, norm.weight, norm.eps), norm(q), "q heads", steps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1539, 1536, 7])  # a tail past the last program's block; whole blocks; tiny
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_silu_mul_is_torchs(dtype, inter, rows):
    gate_up = _randn(rows, 2 * inter, scale=4.0, dtype=dtype)
    got = TritonSiluAndMul()(gate_up)
    _assert_matches(got, SiluAndMul()(gate_up), f"{dtype} {rows}x{inter}")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, as intended
def test_silu_mul_edges():
    """Large negative and positive gates (exp overflow and underflow) and signed zeros."""
    gate_up = torch.zeros(1, 8, dtype=torch.bfloat16, device=DEVICE)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -0.0, 3.0])
    gate_up[0, 4:] = torch.tensor([2.0, 2.0, 2.0, -1.5])
    assert torch.equal(silu_mul(gate_up), SiluAndMul()(gate_up))


def _qkv_step(dtype, t, nh=9, nkv=3, hd=64, seed=0):
    qkv = _randn(t, (nh + 2 * nkv) * hd, seed=seed, dtype=dtype)
    q, k, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    positions = torch.tensor([0, 1, 5, 100, 2000, 4095, 17][:t], dtype=torch.long, device=DEVICE)
    cos, sin = RotaryEmbedding(hd, 4096, 10000.0).tables(positions, dtype)
    return q.view(t, nh, hd), k.view(t, nkv, hd), cos, sin


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7])
def test_rotary_is_bitwise_torchs_on_views_of_the_fused_projection(dtype, t):
    q, k, cos, sin = _qkv_step(dtype, t)
    assert t < 2 or q.stride(0) == k.stride(0) == 15 * 64  # rows of q|k|v, not of q or k alone
    got_q, got_k = rotary(q, k, cos, sin)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_with_odd_head_counts_and_llama3_scaling():
    """Heads not a power of two (5 over 1), a head of 128, and a llama3-scaled table."""
    q, k, _, _ = _qkv_step(torch.bfloat16, 3, nh=5, nkv=1, hd=128, seed=2)
    scaling = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    cos, sin = RotaryEmbedding(128, 131072, 500000.0, scaling).tables(torch.tensor([3, 9000, 131000],
                                                                                   device=DEVICE), torch.bfloat16)
    got, want = rotary(q, k, cos, sin), apply_rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_rejects_a_strided_head_dimension():
    q, k, cos, sin = _qkv_step(torch.float32, 2)
    with pytest.raises(ValueError, match="q's head dimension"):
        rotary(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)


def test_triton_attention_rotates_as_the_generic_prologue():
    """``TritonAttention.attend``'s fused RoPE hands ``forward`` what the generic split + RoPE does."""
    seen = []

    class Capture(TritonAttention):
        def forward(self, q, k, v, k_cache, v_cache, ctx, window=None):
            seen.append((q, k, v))
            return q

    qkv = _randn(4, 15 * 64, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(64, 4096, 10000.0).tables(torch.tensor([0, 3, 4, 50], device=DEVICE),
                                                         torch.bfloat16)
    Capture(9, 3, 64).attend(qkv, (cos, sin), None, None, None, 9, 3, 64)
    super(TritonAttention, Capture(9, 3, 64)).attend(qkv, (cos, sin), None, None, None, 9, 3, 64)
    (fq, fk, fv), (gq, gk, gv) = seen
    assert torch.equal(fq, gq) and torch.equal(fk, gk) and torch.equal(fv, gv)


def test_cuda_gets_the_fused_backend_and_the_cpu_keeps_its_own(monkeypatch):
    """On CUDA (where triton imports) the torch backend swaps in the Triton norm and silu * up;
    a norm of another class (Gemma's rounds elsewhere) stays, and so does every CPU choice."""
    monkeypatch.setattr(linear, "triton_available", lambda device: device.type == "cuda")
    backend = linear.select_backend(torch.float32, torch.device("cuda"))
    assert isinstance(backend, linear.TorchBackend) and backend.fused and backend.name == "torch"
    norm = RMSNorm(8, 1e-6)
    assert isinstance(backend.norm(norm), TritonRMSNorm) and backend.norm(norm).weight is norm.weight
    assert isinstance(backend.act(SiluAndMul()), TritonSiluAndMul)

    class OtherNorm(RMSNorm):
        pass

    other = OtherNorm(8, 1e-6)
    assert backend.norm(other) is other
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cpu = linear.select_backend(dtype, torch.device("cpu"))
        assert not getattr(cpu, "fused", False)
        assert cpu.norm(norm) is norm or type(cpu.norm(norm)) is linear.PackedRMSNorm
    unfused = linear.TorchBackend()
    assert unfused.norm(norm) is norm and type(unfused.act(SiluAndMul())) is SiluAndMul


def test_the_engine_with_fused_kernels_equals_transformers(tiny_llama_dir, monkeypatch):
    """float32 greedy through the whole engine with every kernel of the CUDA path (Triton
    attention, fused norms, silu * up and RoPE), here in the interpreter: chunked prefill, then
    decode steps of two sequences."""
    from pdserve.engine import loader
    from pdserve.engine.sampling.params import SamplingParams
    from tests.factories import assert_greedy_matches, make_engine, random_prompts

    monkeypatch.setattr(loader, "select_backend", lambda dtype, device: linear.TorchBackend(fused=True))
    directory, hf = tiny_llama_dir
    engine = make_engine(directory, device=DEVICE.type, attention_backend="triton", max_num_batched_tokens=16)
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.input_layernorm, TritonRMSNorm) and isinstance(layer.mlp.act, TritonSiluAndMul)
    prompts = random_prompts(2, [9, 37], seed=5)
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))):
        assert_greedy_matches(hf, prompt, out.token_ids, 6, what=f"prompt of {len(prompt)} tokens")


def test_qwen3_with_fused_kernels_equals_transformers(tmp_path, monkeypatch):
    """Qwen3's q and k norms are Llama's RMSNorm over each head: swapped too, they take heads
    strided in the q|k|v projection, and the float32 greedy tokens stay transformers'."""
    from pdserve.engine import loader
    from pdserve.engine.sampling.params import SamplingParams
    from tests.factories import hf_greedy, make_engine, random_prompts
    from tests.families import save_family_model

    monkeypatch.setattr(loader, "select_backend", lambda dtype, device: linear.TorchBackend(fused=True))
    directory, hf = save_family_model("qwen3", tmp_path)
    engine = make_engine(directory, device=DEVICE.type, attention_backend="triton")
    assert isinstance(engine.runner.model.layers[0].self_attn.q_norm, TritonRMSNorm)
    prompts = random_prompts(2, [5, 21], seed=3)
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))):
        assert out.token_ids == hf_greedy(hf, prompt, 6), f"prompt of {len(prompt)} tokens"
