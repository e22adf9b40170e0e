// Batch-invariant linear layers (bfloat16 and float32) for x86 CPUs with AVX2 + FMA, and the dispatch to the kernel path in force (isa.h): this file's AVX2
// kernels, or linear_avx512.cpp's and linear_amx.cpp's (layouts in linear_kernels.h).
//
// Operators (torch.ops.pdserve.*):
//   linear_pack(Tensor weight) -> Tensor
//       weight (N, K): float32 stays float32, any other float dtype is rounded to bfloat16 (as
//       .to(bfloat16) would) -> packed (ceil(N/16), K, 16) of that dtype, or, for bfloat16 on
//       the avx512_bf16 and amx paths, (ceil(N/16), ceil(K/2), 32): pairs of k. Weights are
//       packed for the path in force and refused on another.
//   linear(Tensor x, Tensor packed, int n, Tensor? bias, bool f32_out) -> Tensor
//       x (M, K) of the packed weight's dtype; packed from linear_pack; n = N (the padding is
//       dropped); bias (N,) float32 or None -> y (M, N) = x @ W^T + bias, in x's dtype
//       (float32 if f32_out).
//   (RMSNorm and the residual add: norm.cpp.)
//
// Packed layout. Output columns are grouped in panels of 16; panel p holds columns
// 16p .. 16p+15 for every k, K-major: packed[p][k][0..15]. float32 panels hold the columns in
// order (two 8-lane loads). bfloat16 panels (32 bytes a row) interleave them: slot 2j holds
// column j and slot 2j+1 holds column 8+j. Read as eight 32-bit lanes, a left shift by 16
// gives columns 0..7 as float32 and a mask of the high half gives columns 8..15: a panel row
// becomes two float32 vectors in two integer instructions, with no shuffles. Columns past N
// are zero and never written out.
//
// Why the result does not depend on the batch (the invariance contract):
// every output element y[m][n] is ONE float32 accumulator, set to 0 and then updated by
//     acc = fma(float(x[m][k]), float(W[n][k]), acc)      for k = 0, 1, ..., K-1 in order,
// then (optionally) acc + bias[n], then one rounding to the output dtype. bfloat16 -> float32
// is exact and fma rounds once, so that chain has exactly one possible result. Vectors run
// across output columns (8 columns per register), never across k: no kernel splits the
// K sum, reorders it or reduces partial sums horizontally. What does change with M, the
// thread count or the machine is only WHICH register holds an accumulator and how many rows
// and panels are in flight (row tiles of 1..6, 1, 2 or 6 panels at once, panels divided between
// threads by parallel_chunks over N). None of these touches the order of any element's
// chain, so a row's output is bitwise the same alone or in a batch of any size, at any
// thread count, on any x86-64 machine with AVX2 + FMA (the flags are fixed, never -march=native).
// The AVX-512 path runs this same chain over 16 lanes (the same bits). The avx512_bf16 and
// amx paths keep one accumulator per element too, but add a pair of products per step
// (VDPBF16PS, TDPBF16PS): invariant on their own, with bits of their own.
// torch's float32 matmul (MKL / oneDNN) gives no such promise: it picks a kernel, and with it
// a summation order, by M, so a float32 sequence's greedy tokens could change with the batch
// at a near-tie (seen: two logits 1e-5 apart on the default model).
//
// RMSNorm is row-local: each row's sum of squares runs through 8 float32 lane
// accumulators (lane = d mod 8, in order of d) and then a fixed pairwise tree, whatever M is.
//
// Speed. Small M (decode) is bound by streaming the weights once: with one row, six panels
// run at once, so twelve independent accumulators hide the FMA latency. Large M (prefill)
// runs 6x16 register tiles (12 accumulators, two weight vectors, one broadcast); a group of
// panels sized to stay in L2 is reused across every row tile before the next group is read.
// Tiles of 2 to 5 rows: one panel at a time (two panels for 2 rows). Filling the twelve
// accumulators with more panels (3 for 2 rows, 2 for 3 rows) ran those tiles at half speed
// on a 2-core AMD EPYC (AVX2): the 576x3072 bfloat16 linear took 160 us at M=2 against 88, and
// since a batch is cut into tiles of 6 rows, batches of 8, 9, 14 and 15 paid it in their last tile
// (a decode step at batch 9 was slower than at batch 10).
// The bfloat16 weight conversion costs two integer ops per 12 FMAs, so bfloat16 panels stay
// bfloat16 in cache (half the bytes of a float32 copy).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "isa.h"
#include "linear_kernels.h"
#include "ops.h"
#include "panel_loop.h"
#include "parallel_chunks.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>

#include "linear_avx2.h"  // the AVX2 tiles, run_panels, widen_bf16

namespace pdserve {

at::Tensor linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "linear_pack: weight must be (N, K), got ", weight.sizes());
  const bool f32 = weight.scalar_type() == at::kFloat;
  const auto w = weight.to(f32 ? at::kFloat : at::kBFloat16).contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  if (!f32 && pairs_layout(current_isa())) {  // packed[p][j][c][i] = W[16p + c][2j + i]
    const int64_t KP = (K + 1) / 2;
    auto packed = at::zeros({P, KP, 2 * kPanel}, w.options());
    auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c)
          for (int64_t k = 0; k < K; ++k) dst[((p * KP + k / 2) * kPanel + c) * 2 + k % 2] = src[(p * kPanel + c) * K + k];
    });
    return packed;
  }
  auto packed = at::zeros({P, K, kPanel}, w.options());
  // Column c of a panel goes to slot c (float32) or to the interleaved slot (bfloat16).
  auto pack = [&](auto* dst, const auto* src, auto slot_of) {
    at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
          const int64_t slot = slot_of(c);
          const auto* row = src + (p * kPanel + c) * K;
          for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + slot] = row[k];
        }
    });
  };
  if (f32) {
    pack(packed.data_ptr<float>(), w.data_ptr<float>(), [](int64_t c) { return c; });
  } else {
    pack(reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()),
         reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
         [](int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; });
  }
  return packed;
}

namespace {

// x (M, K) bfloat16 copied into a (rows, ld) buffer, zero from column K to ld. Rows past M
// are left uninitialised: only the AMX kernel reads them, into sums it never writes out.
std::unique_ptr<uint16_t[]> padded_rows(const uint16_t* x, int64_t M, int64_t K, int64_t rows, int64_t ld) {
  std::unique_ptr<uint16_t[]> buf(new uint16_t[static_cast<size_t>(rows * ld)]);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(buf.get() + m * ld, x + m * K, K * sizeof(uint16_t));
    std::memset(buf.get() + m * ld + K, 0, (ld - K) * sizeof(uint16_t));
  }
  return buf;
}

// One call's output panels as chunks (parallel_chunks.h). It owns what it reads: references
// on x, the weight and the bias, and its own copies of x's rows, since a borrowed core's
// helper that was stolen from may still run it after the call returned (borrow_pool.h).
struct LinearChunks final : pdserve::ChunkKernel {
  enum class Path { kF32, kBf16, kDot, kAmx };
  Path path = Path::kF32;
  bool wide = false;  // 16-lane FMA (the single-k paths): the same chain, the same bits
  at::Tensor x, packed, bias;
  std::unique_ptr<uint16_t[]> head, tail;  // padded rows (pairs paths)
  std::unique_ptr<float[]> x32;            // x widened (bfloat16, single k)
  const void* xp = nullptr;                // the rows the kernel reads
  int64_t M = 0, K = 0, KP = 0, ldx = 0;
  AmxRows rows{};
  Output o{};  // o.data is replaced by the base compute() is given

  void compute(int64_t b, int64_t e, void* out) const override {
    Output d = o;
    d.data = out;
    const auto* fx = static_cast<const float*>(xp);
    const auto* ux = static_cast<const uint16_t*>(xp);
    switch (path) {
      case Path::kF32: {
        const float* w = packed.const_data_ptr<float>();
        wide ? avx512_panels_f32(fx, M, K, w, b, e, d) : run_panels(fx, M, K, w, b, e, d);
        break;
      }
      case Path::kBf16: {
        const auto* w = reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>());
        wide ? avx512_panels_bf16(fx, M, K, w, b, e, d) : run_panels(fx, M, K, w, b, e, d);
        break;
      }
      case Path::kDot:
        dpbf16_panels(ux, ldx, M, KP, reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()), b, e, d);
        break;
      case Path::kAmx:
        amx_panels(rows, M, KP, reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()), b, e, d);
        break;
    }
  }
  // Panels [b, e) are columns [16b, 16e) (up to n) of every row.
  void copy(int64_t b, int64_t e, const void* from, void* to) const override {
    const int64_t es = o.f32 ? 4 : 2, c0 = b * kPanel, c1 = std::min(e * kPanel, o.n);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(static_cast<char*>(to) + (m * o.n + c0) * es, static_cast<const char*>(from) + (m * o.n + c0) * es,
                  (c1 - c0) * es);
  }
  int64_t out_bytes() const override { return M * o.n * (o.f32 ? 4 : 2); }
};

// bfloat16 weights in the pairs layout: VDPBF16PS or AMX, by the path in force.
void linear_pairs(LinearChunks& c) {
  const Isa isa = current_isa();
  const int64_t M = c.M, K = c.K, KP = c.packed.size(1);
  TORCH_CHECK(pairs_layout(isa), "linear: the weight was packed in pairs of k (for avx512_bf16 or amx) but the "
              "kernel path is ", isa_name(isa), ": pack it after set_isa");
  TORCH_CHECK(KP == (K + 1) / 2, "linear: x has K=", K, " but the packed weight has K=", 2 * KP - 1, " or ", 2 * KP);
  const auto* x = reinterpret_cast<const uint16_t*>(c.x.const_data_ptr<at::BFloat16>());
  c.KP = KP;
  if (isa == Isa::kAmx) {
    // x is read in place when its rows are already whole k blocks; only the last, partial
    // row tile (and every row when K is not a multiple of 32) is copied with padding.
    const int64_t ld = (KP + 15) / 16 * 32;
    const int64_t split = M / 16 * 16;
    if (ld != K && split > 0) c.head = padded_rows(x, split, K, split, ld);
    c.tail = padded_rows(x + split * K, M - split, K, 16, ld);
    c.rows = AmxRows{c.head ? c.head.get() : x, c.tail.get(), split, ld};
    c.path = LinearChunks::Path::kAmx;
    return;
  }
  if (K % 2) c.head = padded_rows(x, M, K, M, K + 1);
  c.xp = c.head ? c.head.get() : x;
  c.ldx = 2 * KP;
  c.path = LinearChunks::Path::kDot;
}

}  // namespace

namespace {

// The checks of x (M, K) against a packed weight of n outputs; true when the weight is in the
// pairs layout.
bool check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const auto dtype = packed.scalar_type();
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * kPanel && dtype == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kPanel || pairs) &&
                  (dtype == at::kBFloat16 || dtype == at::kFloat) && packed.is_contiguous(),
              "linear: packed must come from linear_pack, got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "linear: x must be (M, K) ", dtype == at::kFloat ?
              "float32" : "bfloat16", " (the packed weight's dtype), got ", x.sizes(), " ", x.scalar_type());
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(pairs || packed.size(1) == K, "linear: x has K=", K, " but the packed weight has K=", packed.size(1));
  TORCH_CHECK(n > (P - 1) * kPanel && n <= P * kPanel, "linear: n=", n, " does not fit ", P, " panels");
  return pairs;
}

// The chunks of x (M, K) contiguous, M > 0, times the packed weight, written through o
// (o.data is set by whoever runs them).
LinearChunks linear_chunks(const at::Tensor& xc, const at::Tensor& packed, bool pairs, const Output& o,
                           at::Tensor bias) {
  const auto dtype = packed.scalar_type();
  LinearChunks c;
  c.x = xc;
  c.packed = packed;
  c.bias = std::move(bias);
  c.M = xc.size(0);
  c.K = xc.size(1);
  c.o = o;
  // Parallel over panels only, in chunks handed to whichever thread asks (parallel_chunks.h):
  // each thread owns whole output columns, never part of a K sum.
  if (pairs) {
    linear_pairs(c);
    return c;
  }
  TORCH_CHECK(dtype == at::kFloat || !pairs_layout(current_isa()), "linear: the weight was packed in single k "
              "(for avx2 or avx512) but the kernel path is ", isa_name(current_isa()), ": pack it after set_isa");
  c.wide = current_isa() != Isa::kAvx2;
  if (dtype == at::kFloat) {
    c.path = LinearChunks::Path::kF32;
    c.xp = xc.const_data_ptr<float>();
  } else {
    // x widened to float32 (exact), read by the broadcasts; converted here rather than by an
    // ATen op, whose dispatch costs more than the conversion at decode sizes. Uninitialised
    // (every element is written next): a std::vector would zero it first.
    c.x32.reset(new float[static_cast<size_t>(c.M * c.K)]);
    widen_bf16(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>()), c.M * c.K, c.x32.get());
    c.path = LinearChunks::Path::kBf16;
    c.xp = c.x32.get();
  }
  return c;
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias, bool f32_out) {
  const bool pairs = check_linear(x, packed, n);
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear: bias has ", bias->numel(), " elements, expected n=", n);
    b32 = bias->to(at::kFloat).contiguous();
  }
  const bool out_f32 = f32_out || packed.scalar_type() == at::kFloat;
  const int64_t M = x.size(0);
  auto y = at::empty({M, n}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const Output o{nullptr, out_f32, n, b32.defined() ? b32.const_data_ptr<float>() : nullptr};
  parallel_kernel(packed.size(0), 2, linear_chunks(x.contiguous(), packed, pairs, o, b32), y.data_ptr(), 6,
                  /*fine_tail=*/M >= 16);
  return y;
}

void linear_add_into(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& y, int64_t column,
                     const int64_t* rows) {
  const bool pairs = check_linear(x, packed, n);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 && y.is_contiguous() &&
                  y.dim() == 2 && (rows || y.size(0) == x.size(0)) && column >= 0 && column + n <= y.size(1),
              "linear_add_into: y must be contiguous bfloat16 (M, >= column + n) with M = x's rows, a bfloat16 "
              "weight; got y ", y.sizes(), " ", y.scalar_type(), ", column ", column, ", n ", n);
  for (int64_t m = 0; rows && m < x.size(0); ++m)
    TORCH_CHECK(rows[m] >= 0 && rows[m] < y.size(0), "linear_add_into: row ", rows[m], " of x's row ", m,
                " is outside y's ", y.size(0), " rows");
  if (x.size(0) == 0) return;
  Output o{nullptr, false, n, nullptr};
  o.ld = y.size(1);
  o.accumulate = true;
  o.rows = rows;
  // Not on the borrowing pool: a helper's private copy of the output would not hold the sums
  // this adds to (the expand of a LoRA product is small beside the base linear it adds into).
  const LinearChunks c = linear_chunks(x.contiguous(), packed, pairs, o, at::Tensor());
  void* out = y.data_ptr<at::BFloat16>() + column;
  parallel_chunks(packed.size(0), 2, [&](int64_t b, int64_t e) { c.compute(b, e, out); });
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("linear_pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias, bool f32_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("linear_pack", &pdserve::linear_pack);
  m.impl("linear", &pdserve::linear);
}
