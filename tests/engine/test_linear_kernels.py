"""pdserve's CPU linear kernels (pdserve/engine/kernels/csrc/linear*.cpp), bfloat16 and float32 weights:
batch invariance and accuracy, on every instruction-set path this processor runs (the
``kernel_path`` fixture; the paths it lacks are skipped and named in the output).

Random weights with the shapes of every linear of the default model (SmolLM2-135M); no
model is loaded. Invariance is bitwise: a row computed in a batch of M equals the same row
computed alone, for M = 1..64, at any thread count.
"""

import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedLinear, PackedRMSNorm, select_backend
from pdserve.engine.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 + FMA")

HIDDEN, INTER = 576, 1536
# (N, K, f32_out): qkv_proj, o_proj, gate_up_proj, down_proj, LM head (float32 logits).
SHAPES = {"qkv": (960, HIDDEN, False), "o": (HIDDEN, HIDDEN, False), "gate_up": (2 * INTER, HIDDEN, False),
          "down": (HIDDEN, INTER, False), "lm_head": (49152, HIDDEN, True)}
MAX_ROWS = 64


@pytest.fixture(scope="module", autouse=True)
def kernels():
    select_backend(torch.bfloat16, torch.device("cpu"))  # loads the kernels, registers their fakes


DTYPES = [torch.bfloat16, torch.float32]


def random_linear(n: int, k: int, f32_out: bool, bias: bool = False, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[PackedLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return PackedLinear(w, b, f32_out), w


def rows(m: int, k: int, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SHAPES)
def test_every_row_equals_the_row_alone_for_batches_of_1_to_64(name, dtype, kernel_path):
    n, k, f32_out = SHAPES[name]
    layer, _ = random_linear(n, k, f32_out, dtype=dtype)
    x = rows(MAX_ROWS, k, dtype=dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(MAX_ROWS)])
    for m in range(1, MAX_ROWS + 1):
        batch = layer(x[:m])
        assert torch.equal(batch, alone[:m]), f"{kernel_path} {name}: a batch of {m} rows differs from its rows alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["qkv", "down", "lm_head"])
def test_thread_count_does_not_change_bits(name, threads, dtype, kernel_path):
    n, k, f32_out = SHAPES[name]
    layer, _ = random_linear(n, k, f32_out, dtype=dtype)
    x = rows(13, k, dtype=dtype)
    outs = {}
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        outs[t] = [layer(x[:m]) for m in (1, 5, 13)]
    for t in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[t])), f"{name}: {t} threads differ from 1"


def error_bound(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Worst-case error of a float32 dot product of length K (gamma_K * |x| |w|^T), plus the
    final rounding to ``out_dtype`` (relative 2^-8 for bfloat16) of the exact result."""
    k = x.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    mag = x.double().abs() @ w.double().abs().T
    exact = x.double() @ w.double().T
    rounding = exact.abs() * 2.0 ** -8 if out_dtype == torch.bfloat16 else 0
    return gamma * mag * 1.01 + rounding


@pytest.mark.parametrize("n,k,m", [(960, 576, 1), (576, 1536, 7), (37, 19, 9), (3, 5, 2)])
@pytest.mark.parametrize("f32_out,dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)])
def test_matches_a_float64_reference_within_the_float32_error_bound(n, k, m, f32_out, dtype, kernel_path):
    layer, w = random_linear(n, k, f32_out, dtype=dtype)
    x = rows(m, k, dtype=dtype)
    y = layer(x)
    assert y.shape == (m, n) and y.dtype == (torch.float32 if f32_out else dtype)
    err = (y.double() - x.double() @ w.double().T).abs()
    bound = error_bound(x, w, y.dtype)
    assert (err <= bound).all(), f"max error {err.max():.3g} over bound at {(err - bound).argmax()}"


def test_bias_is_added_to_the_float32_sum(kernel_path):
    layer, w = random_linear(37, 19, True, bias=True)
    x = rows(4, 19)
    ref = x.double() @ w.double().T + layer.bias.double()
    assert ((layer(x).double() - ref).abs() <= error_bound(x, w, torch.float32) + 1e-6).all()


def test_padding_columns_never_leak_into_a_neighbouring_row(kernel_path):
    layer, _ = random_linear(20, 8, False)  # 2 panels, the second one 12/16 padding
    x = rows(8, 8)
    assert torch.equal(layer(x)[3], layer(x[3:4])[0])


def test_rms_norm_is_row_local_and_close_to_the_float64_formula():
    norm = RMSNorm(HIDDEN, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN)).bfloat16()
    packed = PackedRMSNorm(norm)
    x = rows(MAX_ROWS, HIDDEN) * 3
    alone = torch.cat([packed(x[i:i + 1]) for i in range(MAX_ROWS)])
    for m in (1, 2, 7, 16, 33, 64):
        assert torch.equal(packed(x[:m]), alone[:m])
    x64 = x.double()
    ref = norm.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(alone.double(), ref, rtol=2 ** -6, atol=1e-6)


def test_backend_is_packed_for_bfloat16_and_float32_on_cpu_and_torch_otherwise():
    assert select_backend(torch.bfloat16, torch.device("cpu")).name == "packed-cpu"
    assert select_backend(torch.float32, torch.device("cpu")).name == "packed-cpu-f32"
    assert select_backend(torch.float32, torch.device("cpu")).batch_invariant
    assert select_backend(torch.float16, torch.device("cpu")).name == "torch"
    assert select_backend(torch.bfloat16, torch.device("cpu")).kernel_path == cpu_kernels.default_isa()


def test_float32_panels_keep_float32_weights_exactly(kernel_path):
    """float32 weights are packed as they are (not rounded to bfloat16): one output column
    with a single 1.0 in x picks out that weight column bit for bit."""
    layer, w = random_linear(20, 8, False, dtype=torch.float32)
    assert layer.packed.dtype == torch.float32
    x = torch.zeros(1, 8)
    x[0, 3] = 1.0
    assert torch.equal(layer(x)[0], w[:, 3])


def test_wrong_shapes_are_rejected_naming_the_argument(kernel_path):
    layer, _ = random_linear(16, 8, False)
    with pytest.raises(RuntimeError, match="K=9 but the packed weight has K=(7 or )?8"):
        torch.ops.pdserve.linear(rows(2, 9), layer.packed, 16, None, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.pdserve.linear(rows(2, 8).float(), layer.packed, 16, None, False)
    f32_layer, _ = random_linear(16, 8, False, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pdserve.linear(rows(2, 8), f32_layer.packed, 16, None, False)


def test_ops_pass_torch_opcheck_for_compiled_graphs(kernel_path):
    """Schema, fake (meta) shapes and autograd registration agree with the real kernels, so
    ``torch.compile`` can trace a model that calls them."""
    layer, _ = random_linear(40, 24, False, bias=True)
    for f32_out in (False, True):
        torch.library.opcheck(torch.ops.pdserve.linear.default, (rows(3, 24), layer.packed, 40, layer.bias, f32_out))
    f32_layer, _ = random_linear(40, 24, False, bias=True, dtype=torch.float32)
    torch.library.opcheck(torch.ops.pdserve.linear.default,
                          (rows(3, 24, dtype=torch.float32), f32_layer.packed, 40, f32_layer.bias, False))
    torch.library.opcheck(torch.ops.pdserve.rms_norm.default, (rows(3, 24), torch.ones(24).bfloat16(), 1e-5))


def outputs_on(path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every test shape's output for 1, 5 and 13 rows, with weights packed for ``path``."""
    cpu_kernels.set_isa(path)
    try:
        outs = []
        for n, k, f32_out in SHAPES.values():
            layer, _ = random_linear(n, k, f32_out, bias=True, dtype=dtype)
            outs += [layer(rows(m, k, dtype=dtype)) for m in (1, 5, 13)]
        return outs
    finally:
        cpu_kernels.set_isa(cpu_kernels.default_isa())


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx512_gives_the_avx2_bits(dtype):
    """The AVX-512 kernels run the AVX2 kernels' FMA chain over twice the lanes: same bits."""
    if "avx512" not in cpu_kernels.runnable_isas():
        pytest.skip(f"kernel path avx512: not on this processor ({cpu_kernels.cpu_model()})")
    assert all(torch.equal(a, b) for a, b in zip(outputs_on("avx2", dtype), outputs_on("avx512", dtype)))


def test_float32_weights_take_the_same_fma_chain_on_every_path():
    want = outputs_on("avx2", torch.float32)
    for path in cpu_kernels.runnable_isas()[1:]:
        assert all(torch.equal(a, b) for a, b in zip(want, outputs_on(path, torch.float32))), path


def test_pairs_paths_round_differently_but_stay_within_the_bound():
    """avx512_bf16 and amx sum pairs of products, so their bits are their own (which is why the
    path is fixed per process); each is still checked against float64 above."""
    pairs = [p for p in cpu_kernels.runnable_isas() if p in ("avx512_bf16", "amx")]
    if not pairs:
        pytest.skip(f"kernel paths avx512_bf16 and amx: not on this processor ({cpu_kernels.cpu_model()})")
    single = outputs_on("avx2", torch.bfloat16)
    assert any(not torch.equal(a, b) for a, b in zip(single, outputs_on(pairs[-1], torch.bfloat16)))


def test_weights_packed_for_another_path_are_refused(kernel_path):
    other = "amx" if kernel_path in ("avx2", "avx512") else "avx2"
    if other not in cpu_kernels.runnable_isas():
        pytest.skip(f"kernel path {other}: not on this processor")
    layer, _ = random_linear(16, 8, False)
    cpu_kernels.set_isa(other)
    with pytest.raises(RuntimeError, match=f"kernel path is {other}: pack it after set_isa"):
        layer(rows(2, 8))


def test_choose_isa_takes_the_fastest_or_the_pinned_one_and_names_what_runs():
    runs = ["avx2", "avx512", "avx512_bf16"]
    assert cpu_kernels.choose_isa(None, runs) == "avx512_bf16"
    assert cpu_kernels.choose_isa("avx2", runs) == "avx2"
    with pytest.raises(cpu_kernels.KernelPathError, match="PDSERVE_CPU_ISA=amx but .* runs only avx2, avx512, avx512_bf16"):
        cpu_kernels.choose_isa("amx", runs)
    with pytest.raises(cpu_kernels.KernelPathError, match="need AVX2"):
        cpu_kernels.choose_isa(None, [])


def test_pdserve_cpu_isa_pins_the_path_and_a_bad_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "AVX2")
    assert cpu_kernels.requested_isa() == "avx2"
    monkeypatch.setenv("PDSERVE_CPU_ISA", "auto")
    assert cpu_kernels.requested_isa() is None
    monkeypatch.setenv("PDSERVE_CPU_ISA", "sse4")
    with pytest.raises(cpu_kernels.KernelPathError, match="'sse4' is not a kernel path"):
        cpu_kernels.requested_isa()


def test_a_new_process_runs_the_path_the_variable_names():
    code = "from pdserve.engine.kernels import cpu_kernels; print(cpu_kernels.isa())"
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "avx2"


AVX2_ONLY = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"


def test_a_path_the_processor_lacks_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", "amx")
    with pytest.raises(cpu_kernels.KernelPathError, match="PDSERVE_CPU_ISA=amx but .* lacks amx_bf16, amx_tile, "
                       "avx512_bf16, avx512bw, avx512dq, avx512f, avx512vl; it runs avx2"):
        cpu_kernels.check_requested_isa(AVX2_ONLY)
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    cpu_kernels.check_requested_isa(AVX2_ONLY)  # runs: no error


def test_pdserve_serve_refuses_an_unknown_path_at_start():
    env = {**os.environ, "PDSERVE_CPU_ISA": "sse4"}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 2
    assert "PDSERVE_CPU_ISA='sse4' is not a kernel path" in out.stderr
