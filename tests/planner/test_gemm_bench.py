"""``pdserve profile``'s GEMM table (pdserve/planner/gemm_bench.py, peak.py): the core's peak per
kernel path from its vendor, flags and clock; the default model's projection shapes; a real (tiny)
measurement on every path this processor runs; and the table's arithmetic."""

import pytest

from pdserve.planner import peak
from pdserve.planner.gemm_bench import TORCH, Cell, Gemm, measure, prefill_gemms, table
from pdserve.planner.peak import Clock, Core
from tests.helpers.planner_profiles import SMOL

GHZ = Clock(1e9, "given")
AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
ZEN4 = Core("AuthenticAMD", AVX512, GHZ)
XEON = Core("GenuineIntel", AVX512 | {"amx_tile", "amx_bf16"}, GHZ)


def test_the_peak_is_fma_units_times_lanes_times_products_times_the_clock():
    # Zen 4 runs a 512-bit FMA on both of its 256-bit pipes: the AVX-512 path's float32 peak is AVX2's.
    assert ZEN4.peak_flops("avx2", "float32") == ZEN4.peak_flops("avx512", "float32") == 32e9
    assert ZEN4.peak_flops("avx512", "bfloat16") == 32e9  # widened to float32, one product a lane
    assert ZEN4.peak_flops("avx512_bf16", "bfloat16") == 64e9  # VDPBF16PS: two products a lane
    assert ZEN4.peak_flops("avx512_bf16", "float32") == 32e9  # float32 weights take the FMA chain
    assert XEON.peak_flops("avx512", "float32") == 64e9 and XEON.peak_flops("avx2", "float32") == 32e9
    assert XEON.peak_flops("avx512_bf16", "bfloat16") == 128e9 and XEON.peak_flops("amx", "bfloat16") == 1024e9
    assert "1 FMA/cycle x 16 lanes x 2 product(s) x 2 = 64 FLOP/cycle" == ZEN4.describe("avx512_bf16", "bfloat16")


def test_the_clock_is_measured_else_read_from_cpuinfo(monkeypatch):
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2596.146\nflags\t\t: avx2 fma\n\nprocessor\t: 1\n"
    measured = peak.measure_clock_hz(runs=20)
    assert 5e8 < measured.hz < 7e9 and measured.how.startswith("measured")

    def no_compiler():
        raise FileNotFoundError(2, "No such file or directory", "cc")

    monkeypatch.setattr(peak, "_add_chain", no_compiler)
    core = peak.this_core(cpuinfo)
    assert core.vendor == "AuthenticAMD" and core.flags == {"avx2", "fma"}
    assert core.clock.hz == pytest.approx(2596.146e6) and "no C compiler" in core.clock.how


def test_the_default_models_projections():
    assert [(g.name, g.n, g.k) for g in prefill_gemms(SMOL)] == [
        ("qkv", (9 + 2 * 3) * 64, 576), ("o", 576, 576), ("gate_up", 2 * 1536, 576), ("down", 576, 1536)]


def test_every_path_and_torch_are_timed_and_the_path_in_force_is_kept():
    from pdserve.engine.kernels import cpu_kernels

    paths, before = cpu_kernels.runnable_isas(), cpu_kernels.isa()
    cells = measure((Gemm("g", 32, 64),), paths, tokens=(8, 16), repeats=1, progress=False)
    assert {(c.path, c.dtype, c.tokens) for c in cells} == {
        (p, d, m) for p in [TORCH, *paths] for d in ("bfloat16", "float32") for m in (8, 16)}
    assert all(c.seconds > 0 for c in cells) and cpu_kernels.isa() == before


def test_the_table_gives_each_gemms_rate_its_share_of_peak_and_the_ratio_to_torch():
    a, b = Gemm("a", 100, 100), Gemm("b", 200, 100)
    cells = [Cell("avx2", "float32", 100, a, 2e6 / 8e9), Cell("avx2", "float32", 100, b, 4e6 / 16e9),
             Cell(TORCH, "float32", 100, a, 2e6 / 4e9), Cell(TORCH, "float32", 100, b, 4e6 / 4e9)]
    lines = table(cells, ZEN4)
    assert lines[0] == ("| path | dtype | tokens | peak GFLOP/s | a | b | together | torch (oneDNN) together "
                        "| ours / torch |")
    # ours: 6 MFLOP in 0.5 ms = 12 GFLOP/s; torch: 6 MFLOP in 1.5 ms = 4 GFLOP/s
    assert lines[2] == "| avx2 | float32 | 100 | 32 | 8.0 (25%) | 16.0 (50%) | **12.0 (38%)** | 4.0 (12%) | 3.00x |"


def test_torchs_share_is_of_the_highest_peak_here_for_its_dtype():
    """oneDNN runs bfloat16 dot products wherever the processor has them: against the ``avx2``
    path's FMA peak it would read above 100%."""
    g = Gemm("g", 100, 100)
    cells = [Cell(p, "bfloat16", 100, g, 2e6 / 16e9) for p in ("avx2", "avx512_bf16")]
    cells.append(Cell(TORCH, "bfloat16", 100, g, 2e6 / 48e9))
    rows = table(cells, ZEN4)[2:]
    assert rows[0].endswith("| **16.0 (50%)** | 48.0 (75%) | 0.33x |")  # avx2: 32 GFLOP/s peak; torch of 64
    assert rows[1].endswith("| **16.0 (25%)** | 48.0 (75%) | 0.33x |")
