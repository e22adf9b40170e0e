// bfloat16 RMSNorm, alone and fused with the residual add before it (AVX2, every path).
//
//   rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
//       x (M, D) bfloat16, weight (D,) bfloat16 -> (M, D) bfloat16, transformers' formula:
//       bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))), the mean in float32.
//   add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)
//       the residual add then rms_norm in one pass: (rms_norm(bf16(x + residual)), bf16(x + residual)).
//
// Each row is computed alone, by one fixed sequence of float32 operations, so a row's result
// never depends on its batch; the rounding to bfloat16 is c10's, in vector form (vec_math.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "parallel_chunks.h"
#include "vec_math.h"

#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>

namespace pdserve {

namespace {

// One row of RMSNorm: y = bf16(weight * bf16(x * inv_rms)), the sum of squares through 8
// lane accumulators (lane = d mod 8, FMA in order of d) and one fixed tree. The vector loop
// and the scalar tail do the same operations per element, so D need not be a multiple of 8.
void rms_norm_row(const at::BFloat16* row, const at::BFloat16* weight, int64_t D, float eps, at::BFloat16* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 v = pdserve::load8_bf16(row + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, acc);
  for (; d < D; ++d) {
    const float v = static_cast<float>(row[d]);
    lane[d % 8] = std::fma(v, v, lane[d % 8]);
  }
  const float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (d = 0; d + 8 <= D; d += 8) {
    const __m256 normed = pdserve::round_bf16_8(_mm256_mul_ps(pdserve::load8_bf16(row + d), inv8));
    pdserve::store8_bf16(out + d, _mm256_mul_ps(pdserve::load8_bf16(weight + d), normed));
  }
  for (; d < D; ++d) {
    const float normed = static_cast<float>(c10::BFloat16(static_cast<float>(row[d]) * inv));
    out[d] = c10::BFloat16(static_cast<float>(weight[d]) * normed);
  }
}

// residual' = bf16(x + residual), one row.
void add_row(const at::BFloat16* x, const at::BFloat16* r, int64_t D, at::BFloat16* out) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    pdserve::store8_bf16(out + d, _mm256_add_ps(pdserve::load8_bf16(x + d), pdserve::load8_bf16(r + d)));
  for (; d < D; ++d) out[d] = c10::BFloat16(static_cast<float>(x[d]) + static_cast<float>(r[d]));
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be (M, D) bfloat16");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(), op, ": weight must be (D,) bfloat16");
}

}  // namespace

namespace {

// Rows of RMSNorm (and of the residual add before it) as chunks (parallel_chunks.h): a chunk is
// a range of whole rows. It holds references on what it reads, since a borrowed core's helper
// that was stolen from may still run it after the call returned (borrow_pool.h). With the add
// there are two outputs, y and the sum: the kernel is run on y's memory and writes the sum's
// rows to `sum`; a helper's private buffer holds y's M rows, then the sum's.
struct NormChunks final : ChunkKernel {
  at::Tensor x, residual, weight;  // residual undefined: RMSNorm alone
  at::BFloat16* y = nullptr;       // the outputs' own memory
  at::BFloat16* sum = nullptr;
  int64_t M = 0, D = 0;
  float eps = 0;

  at::BFloat16* sum_of(void* out) const {
    return out == y ? sum : static_cast<at::BFloat16*>(out) + M * D;
  }
  void compute(int64_t b, int64_t e, void* out) const override {
    const auto* xp = x.const_data_ptr<at::BFloat16>();
    const auto* wp = weight.const_data_ptr<at::BFloat16>();
    auto* yp = static_cast<at::BFloat16*>(out);
    if (!residual.defined()) {
      for (int64_t m = b; m < e; ++m) rms_norm_row(xp + m * D, wp, D, eps, yp + m * D);
      return;
    }
    const auto* rp = residual.const_data_ptr<at::BFloat16>();
    at::BFloat16* sp = sum_of(out);
    for (int64_t m = b; m < e; ++m) {
      add_row(xp + m * D, rp + m * D, D, sp + m * D);
      rms_norm_row(sp + m * D, wp, D, eps, yp + m * D);
    }
  }
  void copy(int64_t b, int64_t e, const void* from, void* to) const override {
    const size_t bytes = (e - b) * D * sizeof(at::BFloat16);
    const auto* src = static_cast<const at::BFloat16*>(from);
    std::memcpy(static_cast<at::BFloat16*>(to) + b * D, src + b * D, bytes);
    if (residual.defined()) std::memcpy(sum_of(to) + b * D, src + (M + b) * D, bytes);
  }
  int64_t out_bytes() const override { return (residual.defined() ? 2 : 1) * M * D * 2; }
};

// The chunks of one call, y allocated (and the sum, when `sum` is given; the caller sets the residual).
NormChunks norm_chunks(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* y, at::Tensor* sum) {
  NormChunks c;
  c.x = x.contiguous();
  c.weight = weight;
  c.M = c.x.size(0);
  c.D = c.x.size(1);
  c.eps = static_cast<float>(eps);
  *y = at::empty_like(c.x);
  c.y = y->data_ptr<at::BFloat16>();
  if (sum != nullptr) {
    *sum = at::empty_like(c.x);
    c.sum = sum->data_ptr<at::BFloat16>();
  }
  return c;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  at::Tensor y;
  NormChunks c = norm_chunks(x, weight, eps, &y, nullptr);
  parallel_kernel(c.M, 16, std::move(c), y.data_ptr());
  return y;
}

// The residual add and the next RMSNorm in one pass: residual' = bf16(x + residual) (what
// `h = h + sublayer(h)` rounds to), y = rms_norm(residual'). Returns (y, residual').
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kBFloat16,
              "add_rms_norm: residual must match x, (M, D) bfloat16");
  at::Tensor y, sum;
  NormChunks c = norm_chunks(x, weight, eps, &y, &sum);
  c.residual = residual.contiguous();
  parallel_kernel(c.M, 16, std::move(c), y.data_ptr());
  return {y, sum};
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &pdserve::rms_norm);
  m.impl("add_rms_norm", &pdserve::add_rms_norm);
}
