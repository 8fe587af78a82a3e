// ONNX Runtime CPU kernels for group normalization (nn.GroupNorm) in training, forward and gradient.
//
//   ai.lightning_ort::GroupNormTraining(X, scale, B) -> (Y, mean, rstd)
//       attributes: groups (int) G, epsilon (float).
//       X is [N, C, spatial...] float32, contiguous, C a multiple of G; scale and B are [C]. Per image n and group
//       g (C / G channels and their positions, contiguous in X), mean and the biased variance var, rstd =
//       1 / sqrt(var + epsilon), and Y = (X - mean) * rstd * scale[c] + B[c]. mean and rstd are [N, G], as
//       PyTorch's native_group_norm returns them.
//   ai.lightning_ort::GroupNormGrad(dY, X, scale, mean, rstd) -> (dX, dscale, dB)
//       attribute: groups (int) G. With x^ = (X - mean) * rstd and g' = dY * scale[c], per image and group
//           dX = rstd * (g' - mean(g') - x^ * mean(g' * x^)),
//       and over all images and positions dscale[c] = sum(dY * x^), dB[c] = sum(dY): PyTorch's CPU kernel's
//       result, from the per-channel sums of dY * X and dY.
//
// The public onnxruntime wheel has no group-norm kernel for training: the forward exports as InstanceNormalization
// on a reshaped input, three means for the saved statistics and the affine nodes, and the gradient as about twenty
// nodes (sums over positions and over channels, the products between them), each a pass over the activation. These
// take two passes each way. Sums are taken in float lanes over runs of at most kRun elements and in double across
// runs. Work is split by (image, group) over the session's intra-op thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRun = 512;

// The sum of p and of p * p over n elements.
KERNEL_CLONES void sums_of(const float* __restrict p, int64_t n, double* sum, double* squares) {
  double total = 0.0, total_squares = 0.0;
  int64_t start = 0;
  for (; start + kLanes <= n;) {
    const int64_t end = start + std::min(kRun, (n - start) / kLanes * kLanes);
    FloatLanes<kLanes> s = {}, q = {};
    for (int64_t i = start; i < end; i += kLanes) {
      FloatLanes<kLanes> v;
      load_lanes<kLanes>(v, p + i);
      s += v;
      q += v * v;
    }
    total += lanes_total<kLanes>(s);
    total_squares += lanes_total<kLanes>(q);
    start = end;
  }
  for (int64_t i = start; i < n; ++i) {
    total += p[i];
    total_squares += static_cast<double>(p[i]) * p[i];
  }
  *sum = total;
  *squares = total_squares;
}

// The sum of g * x and of g over n elements.
KERNEL_CLONES void grad_sums_of(const float* __restrict g, const float* __restrict x, int64_t n, double* dot,
                                double* sum) {
  double total_dot = 0.0, total = 0.0;
  int64_t start = 0;
  for (; start + kLanes <= n;) {
    const int64_t end = start + std::min(kRun, (n - start) / kLanes * kLanes);
    FloatLanes<kLanes> d = {}, s = {};
    for (int64_t i = start; i < end; i += kLanes) {
      FloatLanes<kLanes> gi, xi;
      load_lanes<kLanes>(gi, g + i);
      load_lanes<kLanes>(xi, x + i);
      d += gi * xi;
      s += gi;
    }
    total_dot += lanes_total<kLanes>(d);
    total += lanes_total<kLanes>(s);
    start = end;
  }
  for (int64_t i = start; i < n; ++i) {
    total_dot += static_cast<double>(g[i]) * x[i];
    total += g[i];
  }
  *dot = total_dot;
  *sum = total;
}

KERNEL_CLONES void affine_of(const float* __restrict x, float* __restrict y, int64_t n, float a, float b) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * a + b;
}

KERNEL_CLONES void grad_of(const float* __restrict g, const float* __restrict x, float* __restrict out, int64_t n,
                           float a, float b, float c) {
  for (int64_t i = 0; i < n; ++i) out[i] = a * g[i] + b * x[i] + c;
}

// [N, G, C / G, spatial] view of a group-norm input.
struct Groups {
  int64_t batch = 0, groups = 0, channels = 0, per_group = 0, spatial = 1;

  int64_t size() const { return per_group * spatial; }  // elements of one (image, group)
  int64_t offset(int64_t n, int64_t g) const { return (n * groups + g) * size(); }
};

OrtStatus* groups_of(const Tensor& x, int64_t groups, const char* op, Groups* out) {
  if (x.rank < 2 || groups <= 0 || x.dims[1] % groups != 0)
    return api->error(kInvalidArgument, std::string(op) + ": X must be [N, C, ...] with C a multiple of groups (" +
                                            std::to_string(groups) + ")");
  out->batch = x.dims[0];
  out->groups = groups;
  out->channels = x.dims[1];
  out->per_group = x.dims[1] / groups;
  out->spatial = 1;
  for (size_t i = 2; i < x.rank; ++i) out->spatial *= x.dims[i];
  return nullptr;
}

OrtStatus* check_size(const Tensor& t, int64_t size, const char* op, const char* name, const char* what) {
  if (t.numel() != size)
    return api->error(kInvalidArgument, std::string(op) + ": " + name + " must hold " + what + ", " +
                                            std::to_string(size) + " values, not " + std::to_string(t.numel()));
  return nullptr;
}

struct ForwardWork {
  const float* x;
  const float* scale;
  const float* bias;
  float* y;
  float* mean;
  float* rstd;
  Groups l;
  Chunks chunks;  // over the N * G (image, group) pairs
  float epsilon;
};

void forward_task(void* data, size_t task) {
  const ForwardWork& w = *static_cast<const ForwardWork*>(data);
  const Groups& l = w.l;
  for (int64_t pair = w.chunks.first(task); pair < w.chunks.last(task); ++pair) {
    const int64_t n = pair / l.groups, g = pair % l.groups;
    const int64_t offset = l.offset(n, g);
    double sum = 0.0, squares = 0.0;
    sums_of(w.x + offset, l.size(), &sum, &squares);
    const double count = static_cast<double>(l.size());
    const double mean = sum / count;
    const double var = std::max(squares / count - mean * mean, 0.0);
    const float rstd = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(w.epsilon)));
    w.mean[pair] = static_cast<float>(mean);
    w.rstd[pair] = rstd;
    for (int64_t k = 0; k < l.per_group; ++k) {
      const int64_t c = g * l.per_group + k;
      const float a = rstd * w.scale[c];
      const float b = w.bias[c] - w.mean[pair] * a;
      affine_of(w.x + offset + k * l.spatial, w.y + offset + k * l.spatial, l.spatial, a, b);
    }
  }
}

struct GroupsKernel {
  int64_t groups;
  float epsilon;
};

OrtStatus* forward_compute(void* kernel, OrtKernelContext* context) {
  const GroupsKernel& k = *static_cast<const GroupsKernel*>(kernel);
  const char* op = "GroupNormTraining";
  Tensor x, scale, bias;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  RETURN_IF_ERROR(read_input(context, 1, &scale));
  RETURN_IF_ERROR(read_input(context, 2, &bias));
  ForwardWork work{};
  RETURN_IF_ERROR(groups_of(x, k.groups, op, &work.l));
  RETURN_IF_ERROR(check_size(scale, work.l.channels, op, "scale", "one value per channel"));
  RETURN_IF_ERROR(check_size(bias, work.l.channels, op, "B", "one value per channel"));
  work.x = x.data;
  work.scale = scale.data;
  work.bias = bias.data;
  work.epsilon = k.epsilon;
  work.chunks = Chunks::of(work.l.batch * work.l.groups);
  const int64_t statistics[2] = {work.l.batch, work.l.groups};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.y));
  RETURN_IF_ERROR(make_output(context, 1, statistics, 2, &work.mean));
  RETURN_IF_ERROR(make_output(context, 2, statistics, 2, &work.rstd));
  if (work.chunks.items == 0) return nullptr;
  return parallel_for(context, forward_task, work.chunks.tasks(), &work);
}

struct GradWork {
  const float* grad;
  const float* x;
  const float* scale;
  const float* mean;
  const float* rstd;
  float* grad_x;
  double* dots;  // [N, C]: sum of dY * X over each plane
  double* sums;  // [N, C]: sum of dY over each plane
  Groups l;
  Chunks chunks;
};

void grad_task(void* data, size_t task) {
  const GradWork& w = *static_cast<const GradWork*>(data);
  const Groups& l = w.l;
  for (int64_t pair = w.chunks.first(task); pair < w.chunks.last(task); ++pair) {
    const int64_t n = pair / l.groups, g = pair % l.groups;
    const int64_t offset = l.offset(n, g);
    double scaled_dot = 0.0, scaled_sum = 0.0;
    for (int64_t k = 0; k < l.per_group; ++k) {
      const int64_t c = g * l.per_group + k, plane = offset + k * l.spatial;
      double* dot = w.dots + n * l.channels + c;
      double* sum = w.sums + n * l.channels + c;
      grad_sums_of(w.grad + plane, w.x + plane, l.spatial, dot, sum);
      scaled_dot += *dot * w.scale[c];
      scaled_sum += *sum * w.scale[c];
    }
    // PyTorch's CPU kernel's coefficients: dX = rstd * scale[c] * dY + b * X + c.
    const double mean = w.mean[pair], rstd = w.rstd[pair], count = static_cast<double>(l.size());
    const double b = (scaled_sum * mean - scaled_dot) * rstd * rstd * rstd / count;
    const double c = -b * mean - scaled_sum * rstd / count;
    for (int64_t k = 0; k < l.per_group; ++k) {
      const int64_t channel = g * l.per_group + k, plane = offset + k * l.spatial;
      grad_of(w.grad + plane, w.x + plane, w.grad_x + plane, l.spatial, static_cast<float>(rstd) * w.scale[channel],
              static_cast<float>(b), static_cast<float>(c));
    }
  }
}

OrtStatus* grad_compute(void* kernel, OrtKernelContext* context) {
  const GroupsKernel& k = *static_cast<const GroupsKernel*>(kernel);
  const char* op = "GroupNormGrad";
  Tensor grad, x, scale, mean, rstd;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  RETURN_IF_ERROR(read_input(context, 2, &scale));
  RETURN_IF_ERROR(read_input(context, 3, &mean));
  RETURN_IF_ERROR(read_input(context, 4, &rstd));
  RETURN_IF_ERROR(check_same_shape(grad, x, op, "dY"));
  GradWork work{};
  RETURN_IF_ERROR(groups_of(x, k.groups, op, &work.l));
  const Groups& l = work.l;
  RETURN_IF_ERROR(check_size(scale, l.channels, op, "scale", "one value per channel"));
  RETURN_IF_ERROR(check_size(mean, l.batch * l.groups, op, "mean", "one value per image and group"));
  RETURN_IF_ERROR(check_size(rstd, l.batch * l.groups, op, "rstd", "one value per image and group"));
  work.grad = grad.data;
  work.x = x.data;
  work.scale = scale.data;
  work.mean = mean.data;
  work.rstd = rstd.data;
  work.chunks = Chunks::of(l.batch * l.groups);
  float *grad_scale = nullptr, *grad_bias = nullptr;
  const int64_t channels[1] = {l.channels};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.grad_x));
  RETURN_IF_ERROR(make_output(context, 1, channels, 1, &grad_scale));
  RETURN_IF_ERROR(make_output(context, 2, channels, 1, &grad_bias));
  std::vector<double> dots(static_cast<size_t>(l.batch * l.channels)), sums(dots.size());
  work.dots = dots.data();
  work.sums = sums.data();
  if (work.chunks.items > 0) RETURN_IF_ERROR(parallel_for(context, grad_task, work.chunks.tasks(), &work));
  for (int64_t c = 0; c < l.channels; ++c) {
    const int64_t g = c / l.per_group;
    double scale_total = 0.0, bias_total = 0.0;
    for (int64_t n = 0; n < l.batch; ++n) {
      const int64_t pair = n * l.groups + g;
      const double dot = dots[n * l.channels + c], sum = sums[n * l.channels + c];
      scale_total += (dot - sum * work.mean[pair]) * work.rstd[pair];
      bias_total += sum;
    }
    grad_scale[c] = static_cast<float>(scale_total);
    grad_bias[c] = static_cast<float>(bias_total);
  }
  return nullptr;
}

template <bool kForward>
OrtStatus* create_groups(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  GroupsKernel k{};
  RETURN_IF_ERROR(read_int(info, "groups", &k.groups));
  if (kForward) RETURN_IF_ERROR(read_float(info, "epsilon", &k.epsilon));
  if (k.groups <= 0)
    return api->error(kInvalidArgument, std::string(kForward ? "GroupNormTraining" : "GroupNormGrad") +
                                            ": groups must be positive, not " + std::to_string(k.groups));
  *kernel = new GroupsKernel(k);
  return nullptr;
}

void destroy_groups(void* kernel) { delete static_cast<GroupsKernel*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& group_norm_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("GroupNormTraining", 3, 3, create_groups<true>, forward_compute, destroy_groups),
      make_op("GroupNormGrad", 5, 3, create_groups<false>, grad_compute, destroy_groups),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
