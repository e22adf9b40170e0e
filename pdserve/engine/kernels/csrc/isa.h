// Which instruction-set path pdserve's linear kernels run: chosen once per process, at load,
// from CPUID (engine/kernels/cpu_kernels.py picks the best one the processor has, or the one that
// PDSERVE_CPU_ISA names) and set with torch.ops.pdserve.set_isa.
//
//   avx2         float32 FMA over 8 lanes (every x86-64 machine pdserve runs on)
//   avx512       float32 FMA over 16 lanes: the same FMA chain per element as avx2, so the
//                same bits, twice the lanes
//   avx512_bf16  bfloat16 pairs through VDPBF16PS (bfloat16 weights); float32 as avx512
//   amx          bfloat16 tiles through AMX TDPBF16PS (bfloat16 weights); float32 as avx512
//
// Each path is batch-invariant on its own (a row's bits do not depend on the batch or the
// thread count). Two paths are not bitwise equal to each other, except avx2 and avx512: a
// sum of pairs (VDPBF16PS, TDPBF16PS) rounds differently from a chain of single FMAs. So
// the path is fixed for the life of a process, and bfloat16 weights are packed for it.
#pragma once

#include <cstdint>
#include <string>

namespace pdserve {

enum class Isa : int { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };

Isa current_isa();
const char* isa_name(Isa isa);
// bfloat16 weights of this path are packed as pairs of k (VDPBF16PS / AMX), not single k.
inline bool pairs_layout(Isa isa) { return isa == Isa::kAvx512Bf16 || isa == Isa::kAmx; }
// The processor and OS can run this path (CPUID and XCR0; AMX also asks Linux for its tile state).
bool isa_runs_here(Isa isa);

}  // namespace pdserve
