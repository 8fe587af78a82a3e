// ONNX Runtime CPU kernel for the gradient of 2-D max pooling, which finds each window's maximum again.
//
//   ai.lightning_ort::MaxPoolGrad(dY, X) -> dX
//       attributes: kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w (ints).
//       X is [N, C, H, W] float32 and dY [N, C, OH, OW], contiguous. Each dY value is added at the position of
//       its window's maximum in X, found as PyTorch's CPU kernel finds it: the first largest value in row-major
//       window order, or the last NaN.
//
// ONNX Runtime's MaxPool runs 25x slower with its Indices output than without (its values-only kernel is MLAS's),
// and the exporter adds a second pooling of the whole input to turn those indices into PyTorch's; so the forward
// pools values only, and this kernel finds each window's maximum again from X, comparing the columns of an output
// row side by side (a window's taps in PyTorch's order) without branches. Work is split by plane
// over the session's intra-op thread pool: a plane's gradient only receives its own plane's values, so no two
// tasks write the same element.

#include <algorithm>
#include <cmath>
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

struct MaxPoolGradWork {
  const float* grad;
  const float* x;
  float* grad_x;
  int64_t height, width, out_height, out_width;
  int64_t planes, planes_per_task;
  Window window;
};

// The window of output column ow in a row: its first column (moved into the image by whole dilations, as PyTorch
// moves it) and its end.
struct Columns {
  int64_t first, end;
};

inline Columns columns_of(const Window& k, int64_t ow, int64_t width) {
  int64_t first = ow * k.stride_w - k.pad_w;
  const int64_t end = std::min(first + (k.kernel_w - 1) * k.dilation_w + 1, width);
  while (first < 0) first += k.dilation_w;
  return {first, end};
}

// For the output columns [lo, hi) of one output row, whose windows lie wholly inside the image's columns: the
// position of each window's maximum over the rows [h0, h1), tap by tap in PyTorch's order (row-major), every
// column at once, without branches. (Vectorized, the strided loads of a row this short cost more.)
KERNEL_CLONES void interior_maxima(const float* __restrict__ x, const Window& k, int64_t width, int64_t h0,
                                   int64_t h1, int64_t lo, int64_t hi, float* __restrict__ largest,
                                   int64_t* __restrict__ best) {
  for (int64_t ih = h0; ih < h1; ih += k.dilation_h)
    for (int64_t t = 0; t < k.kernel_w; ++t) {
      const int64_t offset = ih * width + t * k.dilation_w - k.pad_w;
      for (int64_t ow = lo; ow < hi; ++ow) {
        const int64_t index = offset + ow * k.stride_w;
        const float value = x[index];
        const bool take = (value > largest[ow]) | (value != value);  // NaN: value != value
        largest[ow] = take ? value : largest[ow];
        best[ow] = take ? index : best[ow];
      }
    }
}

// The gradient of one image plane; largest and best are scratch rows of out_width entries.
void plane_grad(const MaxPoolGradWork& w, const float* x, const float* grad, float* grad_x, float* largest,
                int64_t* best) {
  const Window& k = w.window;
  std::fill_n(grad_x, w.height * w.width, 0.0f);
  // Output columns whose windows need no clipping to the image's columns.
  const int64_t lo = std::min((k.pad_w + k.stride_w - 1) / k.stride_w, w.out_width);
  const int64_t last = w.width - 1 - (k.kernel_w - 1) * k.dilation_w + k.pad_w;
  const int64_t hi = std::max(lo, std::min(last < 0 ? 0 : last / k.stride_w + 1, w.out_width));
  for (int64_t oh = 0; oh < w.out_height; ++oh) {
    int64_t h0 = oh * k.stride_h - k.pad_h;
    const int64_t h1 = std::min(h0 + (k.kernel_h - 1) * k.dilation_h + 1, w.height);
    while (h0 < 0) h0 += k.dilation_h;
    for (int64_t ow = 0; ow < w.out_width; ++ow) {
      largest[ow] = -std::numeric_limits<float>::infinity();
      best[ow] = h0 * w.width + columns_of(k, ow, w.width).first;
    }
    interior_maxima(x, k, w.width, h0, h1, lo, hi, largest, best);
    const auto border = [&](int64_t ow) {
      const Columns c = columns_of(k, ow, w.width);
      for (int64_t ih = h0; ih < h1; ih += k.dilation_h)
        for (int64_t iw = c.first; iw < c.end; iw += k.dilation_w) {
          const int64_t index = ih * w.width + iw;
          const float value = x[index];
          if (value > largest[ow] || std::isnan(value)) {
            largest[ow] = value;
            best[ow] = index;
          }
        }
    };
    for (int64_t ow = 0; ow < lo; ++ow) border(ow);
    for (int64_t ow = hi; ow < w.out_width; ++ow) border(ow);
    const float* g = grad + oh * w.out_width;
    for (int64_t ow = 0; ow < w.out_width; ++ow) grad_x[best[ow]] += g[ow];
  }
}

void grad_planes(void* data, size_t task) {
  const MaxPoolGradWork& w = *static_cast<const MaxPoolGradWork*>(data);
  const int64_t first = static_cast<int64_t>(task) * w.planes_per_task;
  const int64_t last = std::min(first + w.planes_per_task, w.planes);
  const int64_t in_plane = w.height * w.width, out_plane = w.out_height * w.out_width;
  thread_local std::vector<float> largest;
  thread_local std::vector<int64_t> best;
  largest.resize(static_cast<size_t>(w.out_width));
  best.resize(static_cast<size_t>(w.out_width));
  for (int64_t p = first; p < last; ++p)
    plane_grad(w, w.x + p * in_plane, w.grad + p * out_plane, w.grad_x + p * in_plane, largest.data(), best.data());
}

OrtStatus* max_pool_grad_compute(void* kernel, OrtKernelContext* context) {
  const char* op = "MaxPoolGrad";
  Tensor grad, x;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  if (x.rank != 4 || grad.rank != 4 || grad.dims[0] != x.dims[0] || grad.dims[1] != x.dims[1])
    return api->error(kInvalidArgument, std::string(op) + ": X must be [N, C, H, W] and dY [N, C, OH, OW]");
  MaxPoolGradWork work{};
  work.grad = grad.data;
  work.x = x.data;
  work.height = x.dims[2];
  work.width = x.dims[3];
  work.out_height = grad.dims[2];
  work.out_width = grad.dims[3];
  work.planes = x.dims[0] * x.dims[1];
  work.window = *static_cast<const Window*>(kernel);
  const Window& k = work.window;
  const int64_t reach_h = (work.out_height - 1) * k.stride_h - k.pad_h, reach_w = (work.out_width - 1) * k.stride_w - k.pad_w;
  if (work.out_height > 0 && work.out_width > 0 && (reach_h >= work.height || reach_w >= work.width))
    return api->error(kInvalidArgument, std::string(op) + ": dY has more positions than X's windows");
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.grad_x));
  if (x.numel() == 0) return nullptr;
  // About 64 tasks for the thread pool, whole planes each.
  work.planes_per_task = std::max<int64_t>(1, work.planes / 64);
  const int64_t tasks = (work.planes + work.planes_per_task - 1) / work.planes_per_task;
  return parallel_for(context, grad_planes, static_cast<size_t>(tasks), &work);
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
