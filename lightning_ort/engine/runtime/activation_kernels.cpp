// ONNX Runtime CPU kernels for the gradients of GELU and SiLU.
//
//   ai.lightning_ort::GeluGrad(dY, X) -> dX
//       attribute: approximate (int): 0 for the exact GELU, x * Phi(x); 1 for its tanh approximation,
//       0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))).
//       dX = dY * GELU'(X), elementwise; dY and X float32 of one shape, contiguous.
//
//   ai.lightning_ort::SiluGrad(dY, X) -> dX
//       dX = dY * SiLU'(X) = dY * s * (1 + X * (1 - s)), s = sigmoid(X), elementwise; dY and X as for GeluGrad.
//
// The public onnxruntime wheel has no GELU or SiLU gradient kernel, so the exported gradients are elementwise
// nodes (for GELU about ten: Erf, Exp and the products and sums around them; for SiLU a Sigmoid and five), each a
// full pass over the activation; these are one pass. Phi, exp and tanh are computed from polynomial forms that the
// compiler vectorizes (the C library's erff and expf do not vectorize), with a relative error of a few float ulps,
// far into the tails: Phi(x) for negative x comes from erfc, not from 1 - erf, and sigmoid's s and 1 - s both come
// from exp(-|x|), so that neither is a difference of nearly equal numbers. Work is split into chunks over the
// session's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer

// exp(x) as 2^n * p(r), x = n * ln 2 + r with |r| <= ln 2 / 2 (Cephes' expf polynomial): 0 below -87.3, where the
// result would no longer be a normal float, and x clamped at 88.7, so that no input overflows the exponent's bits.
inline float exp_of(float argument) {
  const float x = std::min(std::max(argument, -87.3f), 88.7f);
  const float n = (x * 1.44269504088896341f + kRoundingShift) - kRoundingShift;  // x / ln 2, rounded
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return argument < -87.3f ? 0.0f : p * scale;
}

// 0.5 * erfc(z) for z >= 0 (Numerical Recipes' erfcc, fractional error below 1.2e-7 for every z).
inline float half_erfc(float z) {
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  return 0.5f * t * exp_of(p - z * z);
}

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrtTwoPi = 0.39894228040143268f;
constexpr float kSqrtTwoOverPi = 0.79788456080286536f;
constexpr float kCubic = 0.044715f;

// GELU'(x) = Phi(x) + x * phi(x).
inline float exact_slope(float x) {
  const float tail = half_erfc(std::abs(x) * kSqrtHalf);  // Phi(-|x|)
  const float cdf = x < 0.0f ? tail : 1.0f - tail;
  return cdf + x * kInvSqrtTwoPi * exp_of(-0.5f * x * x);
}

// The tanh form's derivative, 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * du/dx with t = tanh(u), from s = exp(-2|u|):
// 1 + t and 1 - t are 2 / (1 + s) and 2s / (1 + s) (swapped for negative u), so neither loses its digits.
inline float tanh_slope(float x) {
  const float u = kSqrtTwoOverPi * (x + kCubic * x * x * x);
  const float s = exp_of(-2.0f * std::abs(u));
  const float inverse = 1.0f / (1.0f + s);
  const float one_plus_t = 2.0f * (u < 0.0f ? s : 1.0f) * inverse;
  const float one_minus_t_squared = 4.0f * s * inverse * inverse;
  const float du = kSqrtTwoOverPi * (1.0f + 3.0f * kCubic * x * x);
  return 0.5f * one_plus_t + 0.5f * x * one_minus_t_squared * du;
}

// A NaN x gives a NaN gradient, as in PyTorch (the clamps in exp_of would otherwise hide it).
template <bool kTanh>
KERNEL_CLONES void gelu_grad_run(const float* __restrict grad, const float* __restrict x, float* __restrict out,
                                 int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float slope = kTanh ? tanh_slope(x[i]) : exact_slope(x[i]);
    out[i] = grad[i] * (x[i] == x[i] ? slope : x[i]);
  }
}

// SiLU'(x) = s * (1 + x * (1 - s)): with e = exp(-|x|) (at most 1, no overflow), s and 1 - s are 1 / (1 + e) and
// e / (1 + e), swapped for negative x.
inline float silu_slope(float x) {
  const float e = exp_of(-std::abs(x));
  const float inverse = 1.0f / (1.0f + e);
  const float s = x < 0.0f ? e * inverse : inverse;
  const float one_minus_s = x < 0.0f ? inverse : e * inverse;
  return s * (1.0f + x * one_minus_s);
}

KERNEL_CLONES void silu_grad_run(const float* __restrict grad, const float* __restrict x, float* __restrict out,
                                 int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = grad[i] * (x[i] == x[i] ? silu_slope(x[i]) : x[i]);
}

constexpr int64_t kChunk = 16384;

struct GeluGradWork {
  const float* grad;
  const float* x;
  float* out;
  int64_t size;
  bool tanh;
};

void gelu_grad_chunk(void* data, size_t task) {
  const GeluGradWork& w = *static_cast<const GeluGradWork*>(data);
  const int64_t first = static_cast<int64_t>(task) * kChunk;
  const int64_t n = std::min(kChunk, w.size - first);
  if (w.tanh)
    gelu_grad_run<true>(w.grad + first, w.x + first, w.out + first, n);
  else
    gelu_grad_run<false>(w.grad + first, w.x + first, w.out + first, n);
}

struct GeluGradKernel {
  bool tanh;
};

OrtStatus* gelu_grad_compute(void* kernel, OrtKernelContext* context) {
  const GeluGradKernel& k = *static_cast<const GeluGradKernel*>(kernel);
  Tensor grad, x;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  RETURN_IF_ERROR(check_same_shape(grad, x, "GeluGrad", "dY"));
  GeluGradWork work{grad.data, x.data, nullptr, x.numel(), k.tanh};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.out));
  if (work.size == 0) return nullptr;
  return parallel_for(context, gelu_grad_chunk, static_cast<size_t>((work.size + kChunk - 1) / kChunk), &work);
}

OrtStatus* create_gelu_grad(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  int64_t approximate = 0;
  RETURN_IF_ERROR(read_int(info, "approximate", &approximate));
  if (approximate != 0 && approximate != 1)
    return api->error(kInvalidArgument, "GeluGrad: approximate must be 0 (exact) or 1 (tanh), not " +
                                            std::to_string(approximate));
  *kernel = new GeluGradKernel{approximate == 1};
  return nullptr;
}

void destroy_gelu_grad(void* kernel) { delete static_cast<GeluGradKernel*>(kernel); }

struct SiluGradWork {
  const float* grad;
  const float* x;
  float* out;
  int64_t size;
};

void silu_grad_chunk(void* data, size_t task) {
  const SiluGradWork& w = *static_cast<const SiluGradWork*>(data);
  const int64_t first = static_cast<int64_t>(task) * kChunk;
  silu_grad_run(w.grad + first, w.x + first, w.out + first, std::min(kChunk, w.size - first));
}

OrtStatus* silu_grad_compute(void*, OrtKernelContext* context) {
  Tensor grad, x;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  RETURN_IF_ERROR(check_same_shape(grad, x, "SiluGrad", "dY"));
  SiluGradWork work{grad.data, x.data, nullptr, x.numel()};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.out));
  if (work.size == 0) return nullptr;
  return parallel_for(context, silu_grad_chunk, static_cast<size_t>((work.size + kChunk - 1) / kChunk), &work);
}

OrtStatus* create_silu_grad(const OrtCustomOp*, const void*, const OrtKernelInfo*, void** kernel) {
  *kernel = nullptr;  // no attributes
  return nullptr;
}

void destroy_silu_grad(void*) {}

}  // namespace

const std::vector<OpDefinition>& activation_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("GeluGrad", 2, 1, create_gelu_grad, gelu_grad_compute, destroy_gelu_grad),
      make_op("SiluGrad", 2, 1, create_silu_grad, silu_grad_compute, destroy_silu_grad),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
