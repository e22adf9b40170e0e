// CPUID checks and the process-wide kernel path (isa.h).
//
//   cpu_isas() -> str[]     the paths this processor and OS can run, slowest first
//   set_isa(str name) -> () fix the path for this process; a path that cannot run is an error
//   get_isa() -> str        the path in force
#include "isa.h"

#include <ATen/ATen.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace pdserve {
namespace {

std::atomic<int> g_isa{static_cast<int>(Isa::kAvx2)};
const Isa kAll[] = {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx};

struct Cpuid {
  unsigned a = 0, b = 0, c = 0, d = 0;
  Cpuid(unsigned leaf, unsigned sub) {
    if (!__get_cpuid_count(leaf, sub, &a, &b, &c, &d)) a = b = c = d = 0;
  }
};

uint64_t xcr0() {
  if (!(Cpuid(1, 0).c & (1u << 27))) return 0;  // no OSXSAVE: the OS saves no extended state
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool has_avx2() {
  const Cpuid l1(1, 0), l7(7, 0);
  return (l1.c & (1u << 12)) && (l7.b & (1u << 5)) && (xcr0() & 0x6) == 0x6;  // FMA, AVX2, XMM+YMM state
}

bool has_avx512() {  // F, DQ, BW, VL, and the OS saving the opmask and ZMM state
  const Cpuid l7(7, 0);
  const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
  return has_avx2() && (l7.b & need) == need && (xcr0() & 0xE6) == 0xE6;
}

bool has_avx512_bf16() { return has_avx512() && (Cpuid(7, 1).a & (1u << 5)); }

// Linux hands AMX's 8 KB tile state to a process only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); the grant covers every thread of the process.
bool amx_permitted() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return ok;
}

bool has_amx() {
  const Cpuid l7(7, 0);
  const bool cpu = (l7.d & (1u << 22)) && (l7.d & (1u << 24));  // AMX-BF16, AMX-TILE
  return cpu && has_avx512_bf16() && amx_permitted();
}

Isa parse(const std::string& name) {
  for (Isa isa : kAll)
    if (name == isa_name(isa)) return isa;
  TORCH_CHECK(false, "unknown CPU kernel path '", name, "': expected avx2, avx512, avx512_bf16 or amx");
}

}  // namespace

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (Isa isa : kAll)
    if (isa_runs_here(isa)) out.emplace_back(isa_name(isa));
  return out;
}

void set_isa(const std::string& name) {
  const Isa isa = parse(name);
  TORCH_CHECK(isa_runs_here(isa), "the CPU kernel path '", name, "' cannot run on this processor (it runs: ",
              c10::Join(", ", cpu_isas()), ")");
  g_isa.store(static_cast<int>(isa));
}

std::string get_isa() { return isa_name(current_isa()); }

Isa current_isa() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

bool isa_runs_here(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return has_avx2();
    case Isa::kAvx512: return has_avx512();
    case Isa::kAvx512Bf16: return has_avx512_bf16();
    case Isa::kAmx: return has_amx();
  }
  return false;
}

}  // namespace pdserve

// No tensor arguments, so no dispatch key: catch-all kernels.
TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("cpu_isas() -> str[]", &pdserve::cpu_isas);
  m.def("set_isa(str name) -> ()", &pdserve::set_isa);
  m.def("get_isa() -> str", &pdserve::get_isa);
}
