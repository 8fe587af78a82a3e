// ONNX Runtime CPU kernel for the gradient of 2-D max pooling, which finds each window's maximum again.
//
//   ai.lightning_ort::MaxPoolGrad(dY, X) -> dX
//       attributes: kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w (ints).
//       X is [N, C, H, W] float32 and dY [N, C, OH, OW], contiguous. Each dY value is added at the position of
//       its window's maximum in X, found as PyTorch's CPU kernel finds it: the first largest value in row-major
//       window order, or the last NaN.
//
// ONNX Runtime's MaxPool with its Indices output runs a generic loop, far slower than its values-only kernel
// (MLAS's), and the exporter adds a second pooling of the whole input to turn those indices into PyTorch's; so the
// forward pools values only, and this kernel finds each window's maximum again from X. With the plane split into its
// stride's phases, one tap of every window is one contiguous run, compared without branches (taps in PyTorch's
// order), so that the comparisons vectorize. Work is split by plane over the session's intra-op thread pool: a
// plane's gradient only receives its own plane's values, so no two tasks write the same element.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

struct Window {
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
};

// a / b rounded down (b > 0).
inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// A tap of the window along one axis: it reads input position o * stride + shift for output position o, shift =
// tap * dilation - pad, which is row (or column) o + step of the input's phase shift mod stride.
struct Tap {
  int64_t shift, phase, step;
};

inline Tap tap_of(int64_t tap, int64_t stride, int64_t pad, int64_t dilation) {
  const int64_t shift = tap * dilation - pad;
  const int64_t step = floor_div(shift, stride);
  return {shift, shift - step * stride, step};
}

// How the planes of one input shape are searched. The input plane is split into stride_h * stride_w phases (rows
// and columns taken every stride from each offset), padded with -inf (which never wins): tap (kh, kw) of every
// output position is then one contiguous run of a phase, read at output position t = oh * cols + ow. The outputs
// are laid out on that grid, cols >= out_width wide; the extra columns are computed and dropped.
struct Plan {
  int64_t height, width, out_height, out_width;
  int64_t rows, cols, first_step_h, first_step_w;
  int64_t phase_size;          // floats per phase: rows * cols, and one row of slack the extra columns read
  std::vector<int32_t> base;   // per grid position: oh * stride_h * width + ow * stride_w
  std::vector<int32_t> first;  // per grid position: the window's first position inside the image (PyTorch's start)
};

Plan plan_of(const Window& k, int64_t height, int64_t width, int64_t out_height, int64_t out_width) {
  Plan p{};
  p.height = height;
  p.width = width;
  p.out_height = out_height;
  p.out_width = out_width;
  p.first_step_h = tap_of(0, k.stride_h, k.pad_h, k.dilation_h).step;
  p.first_step_w = tap_of(0, k.stride_w, k.pad_w, k.dilation_w).step;
  p.rows = out_height + tap_of(k.kernel_h - 1, k.stride_h, k.pad_h, k.dilation_h).step - p.first_step_h;
  p.cols = out_width + tap_of(k.kernel_w - 1, k.stride_w, k.pad_w, k.dilation_w).step - p.first_step_w;
  p.phase_size = (p.rows + 1) * p.cols;
  p.base.resize(static_cast<size_t>(out_height * p.cols));
  p.first.resize(p.base.size());
  for (int64_t oh = 0; oh < out_height; ++oh) {
    int64_t h0 = oh * k.stride_h - k.pad_h;
    while (h0 < 0) h0 += k.dilation_h;
    for (int64_t ow = 0; ow < p.cols; ++ow) {
      int64_t w0 = ow * k.stride_w - k.pad_w;
      while (w0 < 0) w0 += k.dilation_w;
      p.base[oh * p.cols + ow] = static_cast<int32_t>(oh * k.stride_h * width + ow * k.stride_w);
      p.first[oh * p.cols + ow] = static_cast<int32_t>(h0 * width + w0);
    }
  }
  return p;
}

// The phases of plane x (see Plan), padded with -inf.
KERNEL_CLONES void split_phases(const Window& k, const Plan& p, const float* __restrict__ x,
                                float* __restrict__ phases) {
  const float outside = -std::numeric_limits<float>::infinity();
  for (int64_t rh = 0; rh < k.stride_h; ++rh)
    for (int64_t rw = 0; rw < k.stride_w; ++rw) {
      float* phase = phases + (rh * k.stride_w + rw) * p.phase_size;
      for (int64_t i = 0; i < p.rows; ++i) {
        const int64_t ih = (i + p.first_step_h) * k.stride_h + rh;
        float* row = phase + i * p.cols;
        if (ih < 0 || ih >= p.height) {
          std::fill_n(row, p.cols, outside);
          continue;
        }
        for (int64_t j = 0; j < p.cols; ++j) {
          const int64_t iw = (j + p.first_step_w) * k.stride_w + rw;
          row[j] = iw >= 0 && iw < p.width ? x[ih * p.width + iw] : outside;
        }
      }
      std::fill_n(phase + p.rows * p.cols, p.cols, outside);
    }
}

// One tap for every grid position: its value is taken where it is larger than the largest so far, or NaN (the
// comparisons of PyTorch's kernel, taps in its order), without branches so that it vectorizes.
KERNEL_CLONES void take_tap(const float* __restrict__ values, const int32_t* __restrict__ base, int32_t offset,
                            int64_t n, float* __restrict__ largest, int32_t* __restrict__ best) {
  for (int64_t t = 0; t < n; ++t) {
    const float value = values[t];
    const bool take = (value > largest[t]) | (value != value);  // NaN: value != value
    largest[t] = take ? value : largest[t];
    best[t] = take ? base[t] + offset : best[t];
  }
}

struct MaxPoolGradWork {
  const float* grad;
  const float* x;
  float* grad_x;
  Chunks planes;
  Window window;
  Plan plan;
};

// The gradient of one image plane; phases, largest and best are the thread's scratch space.
void plane_grad(const Window& k, const Plan& p, const float* x, const float* grad, float* grad_x, float* phases,
                float* largest, int32_t* best) {
  split_phases(k, p, x, phases);
  const int64_t n = p.out_height * p.cols;
  std::fill_n(largest, n, -std::numeric_limits<float>::infinity());
  std::copy(p.first.begin(), p.first.end(), best);
  for (int64_t kh = 0; kh < k.kernel_h; ++kh) {
    const Tap h = tap_of(kh, k.stride_h, k.pad_h, k.dilation_h);
    for (int64_t kw = 0; kw < k.kernel_w; ++kw) {
      const Tap w = tap_of(kw, k.stride_w, k.pad_w, k.dilation_w);
      const float* values = phases + (h.phase * k.stride_w + w.phase) * p.phase_size +
                            (h.step - p.first_step_h) * p.cols + (w.step - p.first_step_w);
      take_tap(values, p.base.data(), static_cast<int32_t>(h.shift * p.width + w.shift), n, largest, best);
    }
  }
  std::fill_n(grad_x, p.height * p.width, 0.0f);
  for (int64_t oh = 0; oh < p.out_height; ++oh)
    for (int64_t ow = 0; ow < p.out_width; ++ow) grad_x[best[oh * p.cols + ow]] += grad[oh * p.out_width + ow];
}

void grad_planes(void* data, size_t task) {
  const MaxPoolGradWork& w = *static_cast<const MaxPoolGradWork*>(data);
  const Plan& p = w.plan;
  thread_local std::vector<float> phases, largest;
  thread_local std::vector<int32_t> best;
  phases.resize(static_cast<size_t>(w.window.stride_h * w.window.stride_w * p.phase_size));
  largest.resize(p.base.size());
  best.resize(p.base.size());
  const int64_t in_plane = p.height * p.width, out_plane = p.out_height * p.out_width;
  for (int64_t i = w.planes.first(task); i < w.planes.last(task); ++i)
    plane_grad(w.window, p, w.x + i * in_plane, w.grad + i * out_plane, w.grad_x + i * in_plane, phases.data(),
               largest.data(), best.data());
}

OrtStatus* max_pool_grad_compute(void* kernel, OrtKernelContext* context) {
  const char* op = "MaxPoolGrad";
  Tensor grad, x;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  if (x.rank != 4 || grad.rank != 4 || grad.dims[0] != x.dims[0] || grad.dims[1] != x.dims[1])
    return api->error(kInvalidArgument, std::string(op) + ": X must be [N, C, H, W] and dY [N, C, OH, OW]");
  const Window& k = *static_cast<const Window*>(kernel);
  const int64_t height = x.dims[2], width = x.dims[3], out_height = grad.dims[2], out_width = grad.dims[3];
  const int64_t reach_h = (out_height - 1) * k.stride_h - k.pad_h, reach_w = (out_width - 1) * k.stride_w - k.pad_w;
  if (out_height > 0 && out_width > 0 && (reach_h >= height || reach_w >= width))
    return api->error(kInvalidArgument, std::string(op) + ": dY has more positions than X's windows");
  if ((height + k.stride_h) * (width + k.stride_w) >= (int64_t{1} << 31))
    return api->error(kInvalidArgument, std::string(op) + ": image planes of 2^31 positions or more");
  float* grad_x = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &grad_x));
  if (x.numel() == 0) return nullptr;
  if (grad.numel() == 0) {
    std::fill_n(grad_x, x.numel(), 0.0f);
    return nullptr;
  }
  MaxPoolGradWork work{grad.data, x.data, grad_x, Chunks::of(x.dims[0] * x.dims[1]), k,
                       plan_of(k, height, width, out_height, out_width)};
  return parallel_for(context, grad_planes, work.planes.tasks(), &work);
}

OrtStatus* create_max_pool_grad(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  Window w{};
  const std::pair<const char*, int64_t*> attributes[] = {
      {"kernel_h", &w.kernel_h}, {"kernel_w", &w.kernel_w}, {"stride_h", &w.stride_h},
      {"stride_w", &w.stride_w}, {"pad_h", &w.pad_h},       {"pad_w", &w.pad_w},
      {"dilation_h", &w.dilation_h}, {"dilation_w", &w.dilation_w},
  };
  for (const auto& [name, value] : attributes) RETURN_IF_ERROR(read_int(info, name, value));
  if (w.kernel_h < 1 || w.kernel_w < 1 || w.stride_h < 1 || w.stride_w < 1 || w.dilation_h < 1 ||
      w.dilation_w < 1 || w.pad_h < 0 || w.pad_w < 0)
    return api->error(kInvalidArgument, "MaxPoolGrad: kernel, stride and dilation must be >= 1, padding >= 0");
  // PyTorch's bound, which keeps every window's first position inside the image.
  if (2 * w.pad_h > (w.kernel_h - 1) * w.dilation_h + 1 || 2 * w.pad_w > (w.kernel_w - 1) * w.dilation_w + 1)
    return api->error(kInvalidArgument, "MaxPoolGrad: padding must be at most half the dilated kernel");
  *kernel = new Window(w);
  return nullptr;
}

void destroy_max_pool_grad(void* kernel) { delete static_cast<Window*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& max_pool_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("MaxPoolGrad", 2, 1, create_max_pool_grad, max_pool_grad_compute, destroy_max_pool_grad),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
