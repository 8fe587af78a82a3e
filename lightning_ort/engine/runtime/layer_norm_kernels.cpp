// ONNX Runtime CPU kernel for the gradient of layer normalization over the last dimensions.
//
//   ai.lightning_ort::LayerNormGrad(dY, X, scale, mean, invstd) -> (dX, dscale, dB)
//       X and dY are [rows, D] float32 (any leading shape; D the normalized size, scale's), contiguous; mean and
//       invstd hold one value per row, as the forward's LayerNormalization outputs them. With x^ = (x - mean) *
//       invstd and g' = dY * scale, per row
//           dX = invstd * (g' - mean(g') - x^ * mean(g' * x^)),
//       and over all rows dscale = sum(dY * x^), dB = sum(dY).
//
// The public onnxruntime wheel has no layer-norm gradient, so the exported gradient is about a dozen nodes (the
// centred input, its scaling, two row sums, two column sums, the products between them), each a pass over the
// activation; this is two passes over each row, while it is in cache. Rows are split into tasks over the session's
// intra-op thread pool; each task sums its rows' columns in float, and the tasks' partial sums are added in double.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

constexpr int64_t kTasks = 64;  // for the thread pool; fewer where there are fewer rows

struct LayerNormGradWork {
  const float* grad;
  const float* x;
  const float* scale;
  const float* mean;
  const float* invstd;
  float* grad_x;
  int64_t rows, size, rows_per_task;
  float* partial;  // per task: D sums of dY * x^, then D sums of dY
};

// One row: its gradient, and its terms added to the task's column sums. The row's two sums are taken in kLanes
// independent float accumulators (FloatLanes, held in vector registers).
constexpr int64_t kLanes = 16;

KERNEL_CLONES void row_grad(const float* __restrict g, const float* __restrict x, const float* __restrict scale,
                            float mean, float invstd, float* __restrict out, float* __restrict scale_sums,
                            float* __restrict bias_sums, int64_t size) {
  FloatLanes<kLanes> sums = {}, dots = {};
  const int64_t whole = size / kLanes * kLanes;
  for (int64_t start = 0; start < whole; start += kLanes) {
    FloatLanes<kLanes> gi, xi, scale_i, scale_sum, bias_sum;
    load_lanes<kLanes>(gi, g + start);
    load_lanes<kLanes>(xi, x + start);
    load_lanes<kLanes>(scale_i, scale + start);
    load_lanes<kLanes>(scale_sum, scale_sums + start);
    load_lanes<kLanes>(bias_sum, bias_sums + start);
    const FloatLanes<kLanes> normalized = (xi - mean) * invstd;
    const FloatLanes<kLanes> scaled = gi * scale_i;
    sums += scaled;
    dots += scaled * normalized;
    store_lanes<kLanes>(scale_sums + start, scale_sum + gi * normalized);
    store_lanes<kLanes>(bias_sums + start, bias_sum + gi);
  }
  float sum = 0.0f, dot = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) {
    sum += sums[j];
    dot += dots[j];
  }
  for (int64_t i = whole; i < size; ++i) {
    const float normalized = (x[i] - mean) * invstd;
    const float scaled = g[i] * scale[i];
    sum += scaled;
    dot += scaled * normalized;
    scale_sums[i] += g[i] * normalized;
    bias_sums[i] += g[i];
  }
  const float shift = sum / static_cast<float>(size), projection = dot / static_cast<float>(size);
  for (int64_t i = 0; i < size; ++i) {
    const float normalized = (x[i] - mean) * invstd;
    out[i] = invstd * (g[i] * scale[i] - shift - normalized * projection);
  }
}

void layer_norm_grad_task(void* data, size_t task) {
  const LayerNormGradWork& w = *static_cast<const LayerNormGradWork*>(data);
  float* scale_sums = w.partial + static_cast<int64_t>(task) * 2 * w.size;
  float* bias_sums = scale_sums + w.size;
  const int64_t first = static_cast<int64_t>(task) * w.rows_per_task;
  const int64_t last = std::min(first + w.rows_per_task, w.rows);
  for (int64_t r = first; r < last; ++r) {
    const int64_t offset = r * w.size;
    row_grad(w.grad + offset, w.x + offset, w.scale, w.mean[r], w.invstd[r], w.grad_x + offset, scale_sums,
             bias_sums, w.size);
  }
}

OrtStatus* layer_norm_grad_compute(void*, OrtKernelContext* context) {
  const char* op = "LayerNormGrad";
  Tensor grad, x, scale, mean, invstd;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  RETURN_IF_ERROR(read_input(context, 2, &scale));
  RETURN_IF_ERROR(read_input(context, 3, &mean));
  RETURN_IF_ERROR(read_input(context, 4, &invstd));
  RETURN_IF_ERROR(check_same_shape(grad, x, op, "dY"));
  const int64_t size = scale.numel();
  if (size == 0 || x.numel() % size != 0)
    return api->error(kInvalidArgument, std::string(op) + ": scale must hold X's normalized size, not " +
                                            std::to_string(size) + " of " + std::to_string(x.numel()) + " values");
  const int64_t rows = x.numel() / size;
  if (mean.numel() != rows || invstd.numel() != rows)
    return api->error(kInvalidArgument, std::string(op) + ": mean and invstd must hold one value per row, " +
                                            std::to_string(rows));
  LayerNormGradWork work{grad.data, x.data, scale.data, mean.data, invstd.data, nullptr, rows, size, 0, nullptr};
  float *grad_scale = nullptr, *grad_bias = nullptr;
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.grad_x));
  RETURN_IF_ERROR(make_output(context, 1, scale.dims, scale.rank, &grad_scale));
  RETURN_IF_ERROR(make_output(context, 2, scale.dims, scale.rank, &grad_bias));
  const int64_t tasks = std::max<int64_t>(1, std::min(kTasks, rows));
  work.rows_per_task = (rows + tasks - 1) / tasks;
  const int64_t used = rows == 0 ? 0 : (rows + work.rows_per_task - 1) / work.rows_per_task;
  std::vector<float> partial(static_cast<size_t>(std::max<int64_t>(used, 1) * 2 * size), 0.0f);
  work.partial = partial.data();
  if (used > 0) RETURN_IF_ERROR(parallel_for(context, layer_norm_grad_task, static_cast<size_t>(used), &work));
  for (int64_t i = 0; i < size; ++i) {
    double scale_total = 0.0, bias_total = 0.0;
    for (int64_t t = 0; t < used; ++t) {
      scale_total += partial[t * 2 * size + i];
      bias_total += partial[t * 2 * size + size + i];
    }
    grad_scale[i] = static_cast<float>(scale_total);
    grad_bias[i] = static_cast<float>(bias_total);
  }
  return nullptr;
}

OrtStatus* create_layer_norm_grad(const OrtCustomOp*, const void*, const OrtKernelInfo*, void** kernel) {
  *kernel = nullptr;
  return nullptr;
}

void destroy_layer_norm_grad(void*) {}

}  // namespace

const std::vector<OpDefinition>& layer_norm_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("LayerNormGrad", 5, 3, create_layer_norm_grad, layer_norm_grad_compute, destroy_layer_norm_grad),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
