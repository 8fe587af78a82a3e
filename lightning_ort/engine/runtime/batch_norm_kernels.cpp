// ONNX Runtime CPU kernels for training-mode batch normalization, optionally followed by a residual add and a ReLU.
//
// The public onnxruntime wheel has no training kernels, so a batch norm in training mode is otherwise exported
// as separate ONNX nodes (means, centring, squares, BatchNormalization, Relu; and about nine for the gradient),
// each one a full pass over the activation. These kernels take two passes each way: the per-channel sums, then
// the elementwise result.
//
//   ai.lightning_ort::BatchNormTraining(X, scale, bias, running_mean, running_var)
//           -> (Y, mean, invstd, new_running_mean, new_running_var)
//       attributes: epsilon and momentum (floats); clamp (int, 0 or 1), min and max (floats). The running
//       statistics are updated as PyTorch updates them: momentum * batch value + (1 - momentum) * running value,
//       with the unbiased batch variance.
//       With clamp, Y is clamped to [min, max]: ReLU is min = 0, max = inf; ReLU6 (hardtanh) min = 0, max = 6.
//   ai.lightning_ort::BatchNormTrainingGrad(dY, X, scale, bias, mean, invstd) -> (dX, dscale, dbias)
//       attributes: clamp, min, max. With clamp, dY is kept only where the normalized value v was inside the
//       bounds, min < v < max (v > min alone for an infinite max), as PyTorch's ReLU and hardtanh gradients keep
//       it. v is recomputed from X: the forward's output need not be kept for it. dY is X's shape, or
//       [N, C, 1, ...]: one value per image plane, the same at each of its positions (the gradient of a global
//       average pool after the batch norm, not expanded).
//       attribute block (int, 0 when absent): 16 reads dY and writes dX in ONNX Runtime's NCHWc layout of
//       16-channel blocks (ReorderInput's), X still plain: the layout of the convolutions that produce dY and
//       read dX, so that no reorder runs between them (C a multiple of 16; an AVX-512 CPU). A dY of one value
//       per plane is read as it is.
//   ai.lightning_ort::BatchNormAddTraining(X, scale, bias, running_mean, running_var, Z)
//           -> (Y, mean, invstd, new_running_mean, new_running_var)
//       As BatchNormTraining, with Z (X's shape) added before the clamp: Y = clamp(x * a + b + z), a residual
//       block's relu(bn(conv(h)) + skip).
//   ai.lightning_ort::BatchNormAddTrainingGrad(dY, X, scale, bias, mean, invstd, Y) -> (dX, dscale, dbias, dZ)
//       As BatchNormTrainingGrad, with the clamp's mask read from the forward's output Y (min < y < max holds
//       where min < v < max did, v = x * a + b + z), and dZ the masked dY. With block = 16, dZ is blocked too
//       and Y plain, as X.
//
// X is [N, C, spatial...] float32, contiguous; the statistics are per channel over N and the spatial dims,
// accumulated in double. Work is split by channel over the session's intra-op thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ort_custom_ops.h"
#include "x86_tiles.h"

namespace lightning_ort_kernels {
namespace {

// [N, C, S] view of a batch-norm input, S the product of the spatial dims.
struct Layout {
  int64_t batch = 0, channels = 0, spatial = 1;
};

OrtStatus* channel_layout(const Tensor& x, const char* op, Layout* layout) {
  if (x.rank < 2) return api->error(kInvalidArgument, std::string(op) + ": X must have rank >= 2 ([N, C, ...])");
  layout->batch = x.dims[0];
  layout->channels = x.dims[1];
  layout->spatial = 1;
  for (size_t i = 2; i < x.rank; ++i) layout->spatial *= x.dims[i];
  return nullptr;
}

OrtStatus* check_channels(const Tensor& t, int64_t channels, const char* op, const char* name) {
  if (t.rank != 1 || t.dims[0] != channels)
    return api->error(kInvalidArgument, std::string(op) + ": " + name + " must have shape [C] = [" +
                                            std::to_string(channels) + "]");
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------------------
// Both passes normalize as y = x * a + b with a = scale * invstd and b = bias - mean * a, in float, from the
// float statistics the forward outputs: the gradient recomputes y from X (for the clamp's mask) instead of reading
// the forward's output. The library is compiled without floating-point contraction, so both compute the same y.

// Sums are taken in independent float accumulators, lanes (FloatLanes, held in vector registers: a single
// accumulator is one dependent addition per element), over runs of at most kRun elements, and in double across
// runs, so float rounding stays local to a run. The forward's sums take kSumLanes lanes, two AVX-512 registers
// per sum, so that two chains of dependent additions overlap; the gradient's, which recompute the clamp's mask
// for each element, take kGradLanes (both measured: docs/performance.md, "Batch norm in fused kernels"). The
// forward's lanes are kSumVectors vectors of kVectorLanes (one 32-lane vector value compiled to slower code).
constexpr int64_t kVectorLanes = 16;
constexpr int64_t kSumVectors = 2;
constexpr int64_t kSumLanes = kSumVectors * kVectorLanes;
constexpr int64_t kGradLanes = 16;
constexpr int64_t kRun = 512;

// The end of the run of whole lane groups that starts at start, in a plane of n elements: at most kRun elements
// on, start itself where fewer than kLanes are left (the rest is summed one by one).
template <int64_t kLanes>
inline int64_t run_end(int64_t start, int64_t n) {
  return start + std::min(kRun, (n - start) / kLanes * kLanes);
}

struct Affine {
  float a, b;
};

Affine affine(float scale, float bias, float mean, float invstd) {
  const float a = scale * invstd;
  return {a, bias - mean * a};
}

// The clamp after the normalization: none, a lower bound only (ReLU: max is infinite), or both (hardtanh).
enum ClampMode { kNone = 0, kLower = 1, kBoth = 2 };

struct Bounds {
  float lo, hi;
};

// v clamped to the bounds; NaN stays NaN, as in PyTorch.
template <int kClamp>
inline float clamped(float v, Bounds bounds) {
  if (kClamp == kNone) return v;
  v = v < bounds.lo ? bounds.lo : v;
  return kClamp == kBoth && v > bounds.hi ? bounds.hi : v;
}

// g where the clamp's input v was strictly inside the bounds, else 0 (also for an infinite or NaN g, as
// PyTorch's ReLU and hardtanh gradients), as a bitwise and: a conditional select of loaded values does not
// vectorize.
template <int kClamp>
inline float kept(float g, float v, Bounds bounds) {
  if (kClamp == kNone) return g;
  const bool inside = kClamp == kLower ? v > bounds.lo : ((v > bounds.lo) & (v < bounds.hi));  // no branch
  uint32_t bits;
  std::memcpy(&bits, &g, sizeof bits);
  bits &= -static_cast<uint32_t>(inside);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// g[i] kept by the clamp: its input recomputed from x (v = x * a + b), or, after a residual add, read from the
// clamp's output y, which lies strictly inside the bounds exactly where its input did.
template <int kClamp, bool kResidual>
inline float masked(const float* g, const float* x, const float* y, int64_t i, float a, float b, Bounds bounds) {
  if constexpr (kResidual)
    return kept<kClamp>(g[i], y[i], bounds);
  else
    return kept<kClamp>(g[i], x[i] * a + b, bounds);
}

// x * a + b, plus z[i] after a residual add.
template <bool kResidual>
inline float normalized(float x, float a, float b, const float* z, int64_t i) {
  if constexpr (kResidual)
    return x * a + b + z[i];
  else
    return x * a + b;
}

// The clamp mode of the clamp, min and max attributes.
int clamp_mode(bool clamp, Bounds bounds) {
  if (!clamp) return kNone;
  return std::isinf(bounds.hi) && bounds.hi > 0 ? kLower : kBoth;
}

// Channels are split into blocks, one task each; a block's elements in one image are contiguous, a row of
// block * spatial floats. Images of at least kForwardPlanes positions (kGradPlanes for the gradient) take one
// channel per block, sum each plane in float lanes and run the elementwise passes plane by plane with the
// channel's coefficients. Smaller images take enough channels per block to make rows of about kRowElements,
// summed column by column in double across the batch, and run the elementwise passes over rows with per-element
// coefficients, so that no loop runs over a handful of elements. The gradient's row passes read six coefficient
// arrays and two double accumulators per element, so it takes planes from smaller images than the forward does
// (the thresholds are measured: docs/performance.md, "Batch norm in fused kernels").
constexpr int64_t kRowElements = 4096;
constexpr int64_t kForwardPlanes = kRun;
constexpr int64_t kGradPlanes = 64;

struct Blocks {
  int64_t channels;  // per block
  int64_t count;
  bool planes;  // one channel per block, run plane by plane
};

Blocks blocks_of(const Layout& l, int64_t plane_positions) {
  const bool planes = l.spatial >= plane_positions;
  int64_t per = planes ? 1 : std::max<int64_t>(1, kRowElements / std::max<int64_t>(l.spatial, 1));
  per = std::min(per, std::max<int64_t>(1, (l.channels + 7) / 8));  // 8 tasks or more for the thread pool
  return {per, (l.channels + per - 1) / per, planes};
}

// The per-element coefficient arrays of a block's rows: the normalization's a and b (forward and gradient), and
// the gradient's mean, shift, projection and scale.
enum Coefficient { kA = 0, kB = 1, kMean = 2, kShift = 3, kProjection = 4, kScale = 5 };

// The channels [first, last) of a block and the coefficient and accumulator space of its rows, reused by the
// thread's next block.
struct Block {
  int64_t first, last, row;
  bool planes;
  float* coefficients;  // kCoefficients arrays of row floats
  float* grad_row;      // row floats: a per-plane dY repeated over the positions (grad_rows)
  double* sums;         // 2 arrays of row doubles

  static constexpr int kCoefficients = 6;

  Block(const Layout& l, const Blocks& blocks, size_t task) {
    first = static_cast<int64_t>(task) * blocks.channels;
    last = std::min(first + blocks.channels, l.channels);
    row = (last - first) * l.spatial;
    planes = blocks.planes;
    thread_local std::vector<float> floats;
    thread_local std::vector<double> doubles;
    floats.resize(static_cast<size_t>((kCoefficients + 1) * row));
    doubles.assign(static_cast<size_t>(2 * row), 0.0);
    coefficients = floats.data();
    grad_row = floats.data() + kCoefficients * row;
    sums = doubles.data();
  }

  float* coefficient(int index) const { return coefficients + index * row; }

  // Fills coefficient `index` with value(c) for each channel's positions.
  template <typename Value>
  void fill(int index, int64_t spatial, Value value) const {
    float* out = coefficient(index);
    for (int64_t c = first; c < last; ++c) std::fill_n(out + (c - first) * spatial, spatial, value(c));
  }

  // Fills kA and kB with each channel's normalization.
  void fill_affine(int64_t spatial, const float* scale, const float* bias, const float* mean,
                   const float* invstd) const {
    for (int64_t c = first; c < last; ++c) {
      const Affine f = affine(scale[c], bias[c], mean[c], invstd[c]);
      std::fill_n(coefficient(kA) + (c - first) * spatial, spatial, f.a);
      std::fill_n(coefficient(kB) + (c - first) * spatial, spatial, f.b);
    }
  }

  // Adds the column sums (sums[0, row) and sums[row, 2 * row)) up per channel, into first_total and second_total.
  void reduce_columns(int64_t spatial, double* first_total, double* second_total) const {
    for (int64_t c = first; c < last; ++c)
      for (int64_t i = 0; i < spatial; ++i) {
        first_total[c - first] += sums[(c - first) * spatial + i];
        second_total[c - first] += sums[row + (c - first) * spatial + i];
      }
  }
};

// Calls body with the clamp mode and whether a residual is added as compile-time constants
// (std::integral_constant), for the templated loops.
template <typename Body>
void with_modes(int mode, bool residual, Body body) {
  const auto with_clamp = [&](auto added) {
    if (mode == kLower)
      body(std::integral_constant<int, kLower>{}, added);
    else if (mode == kBoth)
      body(std::integral_constant<int, kBoth>{}, added);
    else
      body(std::integral_constant<int, kNone>{}, added);
  };
  if (residual)
    with_clamp(std::true_type{});
  else
    with_clamp(std::false_type{});
}

KERNEL_CLONES void plane_sums(const float* p, int64_t n, double* sum, double* squares) {
  double total = 0.0, total_squares = 0.0;
  int64_t start = 0;
  for (int64_t end; (end = run_end<kSumLanes>(start, n)) > start; start = end) {
    FloatLanes<kVectorLanes> s[kSumVectors] = {}, q[kSumVectors] = {};
    for (int64_t i = start; i < end; i += kSumLanes)
      for (int64_t h = 0; h < kSumVectors; ++h) {
        FloatLanes<kVectorLanes> v;
        load_lanes<kVectorLanes>(v, p + i + h * kVectorLanes);
        s[h] += v;
        q[h] += v * v;
      }
    double run = 0.0, run_squares = 0.0;
    for (int64_t h = 0; h < kSumVectors; ++h) {
      run = lanes_total<kVectorLanes>(s[h], run);
      run_squares = lanes_total<kVectorLanes>(q[h], run_squares);
    }
    total += run;
    total_squares += run_squares;
  }
  for (int64_t i = start; i < n; ++i) {
    total += p[i];
    total_squares += static_cast<double>(p[i]) * p[i];
  }
  *sum += total;
  *squares += total_squares;
}

KERNEL_CLONES void column_sums(const float* p, int64_t n, double* sum, double* squares) {
  for (int64_t i = 0; i < n; ++i) {
    sum[i] += p[i];
    squares[i] += static_cast<double>(p[i]) * p[i];
  }
}

// The per-channel sums of x and x * x over a block.
void block_sums(const float* x, const Layout& l, const Block& block, double* sum, double* squares) {
  const int64_t stride = l.channels * l.spatial;
  if (block.planes) {
    for (int64_t c = block.first; c < block.last; ++c)
      for (int64_t n = 0; n < l.batch; ++n)
        plane_sums(x + n * stride + c * l.spatial, l.spatial, &sum[c - block.first], &squares[c - block.first]);
    return;
  }
  for (int64_t n = 0; n < l.batch; ++n)
    column_sums(x + n * stride + block.first * l.spatial, block.row, block.sums, block.sums + block.row);
  block.reduce_columns(l.spatial, sum, squares);
}

// The forward: per-channel mean and biased variance, the running statistics, then y = x * a + b (+ z), clamped.

struct ForwardWork {
  const float* x;
  const float* scale;
  const float* bias;
  const float* running_mean;
  const float* running_var;
  const float* z;  // the residual; nullptr for none
  float* y;
  float* mean;
  float* invstd;
  float* new_running_mean;
  float* new_running_var;
  Layout layout;
  Blocks blocks;
  float epsilon;
  float momentum;
  int clamp;
  Bounds bounds;
};

template <int kClamp, bool kResidual>
KERNEL_CLONES void plane_affine(const float* x, const float* z, float* y, int64_t n, Affine f, Bounds bounds) {
  for (int64_t i = 0; i < n; ++i) y[i] = clamped<kClamp>(normalized<kResidual>(x[i], f.a, f.b, z, i), bounds);
}

template <int kClamp, bool kResidual>
KERNEL_CLONES void row_affine(const float* x, const float* z, float* y, int64_t n, const float* a, const float* b,
                              Bounds bounds) {
  for (int64_t i = 0; i < n; ++i) y[i] = clamped<kClamp>(normalized<kResidual>(x[i], a[i], b[i], z, i), bounds);
}

// y for a block whose statistics are known.
template <int kClamp, bool kResidual>
void normalize_block(const ForwardWork& w, const Block& block) {
  const Layout& l = w.layout;
  const int64_t stride = l.channels * l.spatial;
  if (block.planes) {
    for (int64_t c = block.first; c < block.last; ++c) {
      const Affine f = affine(w.scale[c], w.bias[c], w.mean[c], w.invstd[c]);
      for (int64_t n = 0; n < l.batch; ++n) {
        const int64_t offset = n * stride + c * l.spatial;
        plane_affine<kClamp, kResidual>(w.x + offset, kResidual ? w.z + offset : nullptr, w.y + offset, l.spatial, f,
                                        w.bounds);
      }
    }
    return;
  }
  block.fill_affine(l.spatial, w.scale, w.bias, w.mean, w.invstd);
  for (int64_t n = 0; n < l.batch; ++n) {
    const int64_t offset = n * stride + block.first * l.spatial;
    row_affine<kClamp, kResidual>(w.x + offset, kResidual ? w.z + offset : nullptr, w.y + offset, block.row,
                                  block.coefficient(kA), block.coefficient(kB), w.bounds);
  }
}

void forward_block(void* data, size_t task) {
  const ForwardWork& w = *static_cast<const ForwardWork*>(data);
  const Layout& l = w.layout;
  const Block block(l, w.blocks, task);
  std::vector<double> sum(static_cast<size_t>(block.last - block.first)), squares(sum.size());
  block_sums(w.x, l, block, sum.data(), squares.data());
  const double count = static_cast<double>(l.batch * l.spatial);
  for (int64_t c = block.first; c < block.last; ++c) {
    const double mean = sum[c - block.first] / count;
    const double var = std::max(squares[c - block.first] / count - mean * mean, 0.0);
    w.mean[c] = static_cast<float>(mean);
    w.invstd[c] = static_cast<float>(1.0 / std::sqrt(var + static_cast<double>(w.epsilon)));
    const float unbiased = static_cast<float>(var * count / std::max(count - 1.0, 1.0));
    w.new_running_mean[c] = w.momentum * w.mean[c] + (1.0f - w.momentum) * w.running_mean[c];
    w.new_running_var[c] = w.momentum * unbiased + (1.0f - w.momentum) * w.running_var[c];
  }
  with_modes(w.clamp, w.z != nullptr, [&](auto mode, auto residual) {
    normalize_block<decltype(mode)::value, decltype(residual)::value>(w, block);
  });
}

struct ForwardKernel {
  float epsilon;
  float momentum;
  int clamp;
  Bounds bounds;
  bool residual;  // BatchNormAddTraining
};

OrtStatus* forward_compute(void* kernel, OrtKernelContext* context) {
  const ForwardKernel& k = *static_cast<const ForwardKernel*>(kernel);
  const char* op = k.residual ? "BatchNormAddTraining" : "BatchNormTraining";
  Tensor x, scale, bias, running_mean, running_var, z;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  RETURN_IF_ERROR(read_input(context, 1, &scale));
  RETURN_IF_ERROR(read_input(context, 2, &bias));
  RETURN_IF_ERROR(read_input(context, 3, &running_mean));
  RETURN_IF_ERROR(read_input(context, 4, &running_var));
  Layout layout;
  RETURN_IF_ERROR(channel_layout(x, op, &layout));
  RETURN_IF_ERROR(check_channels(scale, layout.channels, op, "scale"));
  RETURN_IF_ERROR(check_channels(bias, layout.channels, op, "bias"));
  RETURN_IF_ERROR(check_channels(running_mean, layout.channels, op, "running_mean"));
  RETURN_IF_ERROR(check_channels(running_var, layout.channels, op, "running_var"));
  if (k.residual) {
    RETURN_IF_ERROR(read_input(context, 5, &z));
    RETURN_IF_ERROR(check_same_shape(z, x, op, "Z"));
  }
  ForwardWork work{};
  work.z = z.data;
  work.x = x.data;
  work.scale = scale.data;
  work.bias = bias.data;
  work.running_mean = running_mean.data;
  work.running_var = running_var.data;
  work.layout = layout;
  work.blocks = blocks_of(layout, kForwardPlanes);
  work.epsilon = k.epsilon;
  work.momentum = k.momentum;
  work.clamp = k.clamp;
  work.bounds = k.bounds;
  const int64_t channels[1] = {layout.channels};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.y));
  RETURN_IF_ERROR(make_output(context, 1, channels, 1, &work.mean));
  RETURN_IF_ERROR(make_output(context, 2, channels, 1, &work.invstd));
  RETURN_IF_ERROR(make_output(context, 3, channels, 1, &work.new_running_mean));
  RETURN_IF_ERROR(make_output(context, 4, channels, 1, &work.new_running_var));
  if (x.numel() == 0) return nullptr;
  return parallel_for(context, forward_block, static_cast<size_t>(work.blocks.count), &work);
}

// The gradient: with g = dY (kept where the clamp passed it through), per channel sum(g) and
// sum(g * (x - mean)), then dx = (g - sum(g) / M - (x - mean) * invstd^2 * sum(g * (x - mean)) / M) * scale * invstd,
// and dz = g after a residual add.

struct BackwardWork {
  const float* grad;
  const float* x;
  const float* scale;
  const float* bias;
  const float* mean;
  const float* invstd;
  const float* y;  // the forward's output, after a residual add; else nullptr
  float* grad_x;
  float* grad_scale;
  float* grad_bias;
  float* grad_z;  // after a residual add; else nullptr
  Layout layout;
  Blocks blocks;
  int clamp;
  Bounds bounds;
  bool grad_per_plane;  // dY is [N, C, 1, ...]
};

// dY at image n, channels [first, last) of a block: dY itself, or, for a dY of one value per plane, each
// channel's value repeated over its positions in the block's scratch row (it stays in cache), valid until the
// next call.
const float* grad_rows(const BackwardWork& w, const Block& block, int64_t n, int64_t first, int64_t last) {
  const Layout& l = w.layout;
  if (!w.grad_per_plane) return w.grad + (n * l.channels + first) * l.spatial;
  for (int64_t c = first; c < last; ++c)
    std::fill_n(block.grad_row + (c - first) * l.spatial, l.spatial, w.grad[n * l.channels + c]);
  return block.grad_row;
}

template <int kClamp, bool kResidual>
KERNEL_CLONES void plane_grad_sums(const float* g, const float* x, const float* y, int64_t n, float mean, Affine f,
                                   Bounds bounds, double* sum, double* dot) {
  double total = 0.0, total_dot = 0.0;
  int64_t start = 0;
  for (int64_t end; (end = run_end<kGradLanes>(start, n)) > start; start = end) {
    FloatLanes<kGradLanes> s = {}, d = {};
    for (int64_t i = start; i < end; i += kGradLanes) {
      FloatLanes<kGradLanes> gi, xi;
      for (int64_t j = 0; j < kGradLanes; ++j) gi[j] = masked<kClamp, kResidual>(g, x, y, i + j, f.a, f.b, bounds);
      load_lanes<kGradLanes>(xi, x + i);
      s += gi;
      d += gi * (xi - mean);
    }
    total += lanes_total<kGradLanes>(s);
    total_dot += lanes_total<kGradLanes>(d);
  }
  for (int64_t i = start; i < n; ++i) {
    const float gi = masked<kClamp, kResidual>(g, x, y, i, f.a, f.b, bounds);
    total += gi;
    total_dot += static_cast<double>(gi) * (x[i] - mean);
  }
  *sum += total;
  *dot += total_dot;
}

template <int kClamp, bool kResidual>
KERNEL_CLONES void column_grad_sums(const float* g, const float* x, const float* y, int64_t n, const float* a,
                                    const float* b, const float* mean, Bounds bounds, double* sum, double* dot) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = masked<kClamp, kResidual>(g, x, y, i, a[i], b[i], bounds);
    sum[i] += gi;
    dot[i] += static_cast<double>(gi) * (x[i] - mean[i]);
  }
}

template <int kClamp, bool kResidual>
KERNEL_CLONES void plane_grad(const float* g, const float* x, const float* y, float* out, float* out_z, int64_t n,
                              float mean, Affine f, Bounds bounds, float shift, float k, float a) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = masked<kClamp, kResidual>(g, x, y, i, f.a, f.b, bounds);
    out[i] = (gi - shift - (x[i] - mean) * k) * a;
    if constexpr (kResidual) out_z[i] = gi;
  }
}

template <int kClamp, bool kResidual>
KERNEL_CLONES void row_grad(const float* __restrict g, const float* __restrict x, const float* __restrict y,
                            float* __restrict out, float* __restrict out_z, int64_t n, const float* const* c,
                            Bounds bounds) {
  const float *__restrict a = c[kA], *__restrict b = c[kB], *__restrict mean = c[kMean];
  const float *__restrict shift = c[kShift], *__restrict k = c[kProjection], *__restrict scale = c[kScale];
  for (int64_t i = 0; i < n; ++i) {
    const float gi = masked<kClamp, kResidual>(g, x, y, i, a[i], b[i], bounds);
    out[i] = (gi - shift[i] - (x[i] - mean[i]) * k[i]) * scale[i];
    if constexpr (kResidual) out_z[i] = gi;
  }
}

// The per-channel sums of g and g * (x - mean) over a block (coefficients kA, kB and kMean filled).
template <int kClamp, bool kResidual>
void block_grad_sums(const BackwardWork& w, const Block& block, double* sum, double* dot) {
  const Layout& l = w.layout;
  const int64_t stride = l.channels * l.spatial;
  if (block.planes) {
    for (int64_t c = block.first; c < block.last; ++c) {
      const Affine f = affine(w.scale[c], w.bias[c], w.mean[c], w.invstd[c]);
      for (int64_t n = 0; n < l.batch; ++n) {
        const int64_t offset = n * stride + c * l.spatial;
        const float* g = grad_rows(w, block, n, c, c + 1);
        plane_grad_sums<kClamp, kResidual>(g, w.x + offset, kResidual ? w.y + offset : nullptr, l.spatial, w.mean[c],
                                           f, w.bounds, &sum[c - block.first], &dot[c - block.first]);
      }
    }
    return;
  }
  for (int64_t n = 0; n < l.batch; ++n) {
    const int64_t offset = n * stride + block.first * l.spatial;
    column_grad_sums<kClamp, kResidual>(grad_rows(w, block, n, block.first, block.last), w.x + offset,
                                        kResidual ? w.y + offset : nullptr,
                                        block.row, block.coefficient(kA), block.coefficient(kB),
                                        block.coefficient(kMean), w.bounds, block.sums, block.sums + block.row);
  }
  block.reduce_columns(l.spatial, sum, dot);
}

template <int kClamp, bool kResidual>
void backward_block_with(const BackwardWork& w, const Block& block) {
  const Layout& l = w.layout;
  const int64_t channels = block.last - block.first;
  if (!block.planes) {
    block.fill_affine(l.spatial, w.scale, w.bias, w.mean, w.invstd);
    block.fill(kMean, l.spatial, [&](int64_t c) { return w.mean[c]; });
  }
  std::vector<double> sum(static_cast<size_t>(channels)), dot(sum.size());
  block_grad_sums<kClamp, kResidual>(w, block, sum.data(), dot.data());
  const double count = static_cast<double>(l.batch * l.spatial);
  for (int64_t c = block.first; c < block.last; ++c) {
    const double invstd = w.invstd[c];
    w.grad_scale[c] = static_cast<float>(dot[c - block.first] * invstd);
    w.grad_bias[c] = static_cast<float>(sum[c - block.first]);
  }
  const auto shift = [&](int64_t c) { return static_cast<float>(sum[c - block.first] / count); };
  const auto projection = [&](int64_t c) {
    const double invstd = w.invstd[c];
    return static_cast<float>(dot[c - block.first] * invstd * invstd / count);
  };
  const auto scale = [&](int64_t c) { return static_cast<float>(static_cast<double>(w.scale[c]) * w.invstd[c]); };
  const int64_t stride = l.channels * l.spatial;
  if (block.planes) {
    for (int64_t c = block.first; c < block.last; ++c) {
      const Affine f = affine(w.scale[c], w.bias[c], w.mean[c], w.invstd[c]);
      for (int64_t n = 0; n < l.batch; ++n) {
        const int64_t offset = n * stride + c * l.spatial;
        const float* g = grad_rows(w, block, n, c, c + 1);
        plane_grad<kClamp, kResidual>(g, w.x + offset, kResidual ? w.y + offset : nullptr, w.grad_x + offset,
                                      kResidual ? w.grad_z + offset : nullptr, l.spatial, w.mean[c], f, w.bounds,
                                      shift(c), projection(c), scale(c));
      }
    }
    return;
  }
  block.fill(kShift, l.spatial, shift);
  block.fill(kProjection, l.spatial, projection);
  block.fill(kScale, l.spatial, scale);
  const float* coefficients[Block::kCoefficients];
  for (int i = 0; i < Block::kCoefficients; ++i) coefficients[i] = block.coefficient(i);
  for (int64_t n = 0; n < l.batch; ++n) {
    const int64_t offset = n * stride + block.first * l.spatial;
    row_grad<kClamp, kResidual>(grad_rows(w, block, n, block.first, block.last), w.x + offset,
                                kResidual ? w.y + offset : nullptr,
                                w.grad_x + offset, kResidual ? w.grad_z + offset : nullptr, block.row, coefficients,
                                w.bounds);
  }
}

void backward_block(void* data, size_t task) {
  const BackwardWork& w = *static_cast<const BackwardWork*>(data);
  const Block block(w.layout, w.blocks, task);
  with_modes(w.clamp, w.y != nullptr, [&](auto mode, auto residual) {
    backward_block_with<decltype(mode)::value, decltype(residual)::value>(w, block);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The gradient in NCHWc blocks: one task per block of kChannelBlock channels. In that layout one image's block is
// [S, 16], a vector of the block's channels per position, and X's 16 planes are transposed to it in registers, 16
// positions at a time, so that each vector lane is one channel throughout: the sums are lane-wise, in float over
// a tile's positions and in double across tiles, and dX and dZ are written a vector per position. The elementwise
// arithmetic is the plain path's, operation for operation, so both give the same dX for the same sums.

constexpr int64_t kChannelBlock = 16;

#if X86_VECTORS
struct ChannelVectors {
  __m512 a, b, mean, lo, hi;
};

// Rows r[0..15]: the block's 16 planes at positions [p, p + count), from plane 0 at `plane` (rows `spatial`
// apart), zero beyond count; transposed, r[q] holds the 16 channels at position p + q.
__attribute__((target("avx512f"))) inline void load_positions(const float* plane, int64_t spatial, int64_t count,
                                                              __m512 r[16]) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  for (int64_t j = 0; j < kChannelBlock; ++j) r[j] = _mm512_maskz_loadu_ps(mask, plane + j * spatial);
  transpose_16x16(r);
}

// g where the clamp's input, v (X normalized) or y (the forward's output after a residual add), was strictly
// inside the bounds, else 0; as kept().
template <int kClamp, bool kResidual>
__attribute__((target("avx512f"))) inline __m512 masked16(__m512 g, __m512 x, __m512 y, const ChannelVectors& v) {
  if constexpr (kClamp == kNone) return g;
  const __m512 in = kResidual ? y : _mm512_add_ps(_mm512_mul_ps(x, v.a), v.b);
  __mmask16 inside = _mm512_cmp_ps_mask(in, v.lo, _CMP_GT_OQ);
  if constexpr (kClamp == kBoth) inside &= _mm512_cmp_ps_mask(in, v.hi, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(inside, g);
}

__attribute__((target("avx512f"))) inline void add_to(double* sums, __m512 v) {
  const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  _mm512_storeu_pd(sums, _mm512_add_pd(_mm512_loadu_pd(sums), low));
  _mm512_storeu_pd(sums + 8, _mm512_add_pd(_mm512_loadu_pd(sums + 8), high));
}

// Where image n's block starts, and its dY when that is one value per plane.
struct Tiles {
  int64_t offset;  // the block's start in image n, in either layout
  __m512 per_plane;
};

__attribute__((target("avx512f"))) inline Tiles tiles_of(const BackwardWork& w, int64_t n, int64_t first) {
  const Layout& l = w.layout;
  const __m512 per_plane = w.grad_per_plane ? _mm512_loadu_ps(w.grad + n * l.channels + first) : _mm512_setzero_ps();
  return {(n * l.channels + first) * l.spatial, per_plane};
}

// Loads the tile of up to 16 positions from p of X (and Y) into x (and y), transposed so that x[q] holds the 16
// channels at the tile's position q, as dY's vector does; returns its positions.
template <bool kResidual>
__attribute__((target("avx512f"))) inline int64_t load_tile(const BackwardWork& w, const Tiles& t, int64_t p,
                                                            __m512 x[16], __m512 y[16]) {
  const int64_t count = std::min<int64_t>(16, w.layout.spatial - p);
  load_positions(w.x + t.offset + p, w.layout.spatial, count, x);
  if constexpr (kResidual) load_positions(w.y + t.offset + p, w.layout.spatial, count, y);
  return count;
}

// The block's dY at a position (or its one value per plane), kept by the clamp of its x (or y) there.
template <int kClamp, bool kResidual>
__attribute__((target("avx512f"))) inline __m512 tile_grad(const BackwardWork& w, const Tiles& t, int64_t position,
                                                           __m512 x, __m512 y, const ChannelVectors& v) {
  const __m512 g = w.grad_per_plane ? t.per_plane : _mm512_loadu_ps(w.grad + t.offset + position * kChannelBlock);
  return masked16<kClamp, kResidual>(g, x, y, v);
}

template <int kClamp, bool kResidual>
__attribute__((target("avx512f"))) void blocked_backward_with(const BackwardWork& w, int64_t first) {
  const Layout& l = w.layout;
  float a[kChannelBlock], b[kChannelBlock];
  for (int64_t j = 0; j < kChannelBlock; ++j) {
    const int64_t c = first + j;
    const Affine f = affine(w.scale[c], w.bias[c], w.mean[c], w.invstd[c]);
    a[j] = f.a;
    b[j] = f.b;
  }
  const ChannelVectors v{_mm512_loadu_ps(a), _mm512_loadu_ps(b), _mm512_loadu_ps(w.mean + first),
                         _mm512_set1_ps(w.bounds.lo), _mm512_set1_ps(w.bounds.hi)};
  __m512 x[16], y[16] = {};  // y: read after a residual add only
  double sum[kChannelBlock] = {}, dot[kChannelBlock] = {};
  for (int64_t n = 0; n < l.batch; ++n) {
    const Tiles t = tiles_of(w, n, first);
    for (int64_t p = 0; p < l.spatial; p += 16) {
      const int64_t count = load_tile<kResidual>(w, t, p, x, y);
      __m512 s = _mm512_setzero_ps(), d = _mm512_setzero_ps();
      for (int64_t q = 0; q < count; ++q) {
        const __m512 g = tile_grad<kClamp, kResidual>(w, t, p + q, x[q], y[q], v);
        s = _mm512_add_ps(s, g);
        d = _mm512_add_ps(d, _mm512_mul_ps(g, _mm512_sub_ps(x[q], v.mean)));
      }
      add_to(sum, s);
      add_to(dot, d);
    }
  }
  const double count = static_cast<double>(l.batch * l.spatial);
  float shift[kChannelBlock], projection[kChannelBlock], scale[kChannelBlock];
  for (int64_t j = 0; j < kChannelBlock; ++j) {
    const int64_t c = first + j;
    const double invstd = w.invstd[c];
    w.grad_scale[c] = static_cast<float>(dot[j] * invstd);
    w.grad_bias[c] = static_cast<float>(sum[j]);
    shift[j] = static_cast<float>(sum[j] / count);
    projection[j] = static_cast<float>(dot[j] * invstd * invstd / count);
    scale[j] = static_cast<float>(static_cast<double>(w.scale[c]) * invstd);
  }
  const __m512 shifts = _mm512_loadu_ps(shift), projections = _mm512_loadu_ps(projection);
  const __m512 scales = _mm512_loadu_ps(scale);
  for (int64_t n = 0; n < l.batch; ++n) {
    const Tiles t = tiles_of(w, n, first);
    for (int64_t p = 0; p < l.spatial; p += 16) {
      const int64_t count = load_tile<kResidual>(w, t, p, x, y);
      for (int64_t q = 0; q < count; ++q) {
        const int64_t at = t.offset + (p + q) * kChannelBlock;
        const __m512 g = tile_grad<kClamp, kResidual>(w, t, p + q, x[q], y[q], v);
        const __m512 centred = _mm512_mul_ps(_mm512_sub_ps(x[q], v.mean), projections);
        _mm512_storeu_ps(w.grad_x + at, _mm512_mul_ps(_mm512_sub_ps(_mm512_sub_ps(g, shifts), centred), scales));
        if constexpr (kResidual) _mm512_storeu_ps(w.grad_z + at, g);
      }
    }
  }
}

void blocked_backward_block(void* data, size_t task) {
  const BackwardWork& w = *static_cast<const BackwardWork*>(data);
  with_modes(w.clamp, w.y != nullptr, [&](auto mode, auto residual) {
    blocked_backward_with<decltype(mode)::value, decltype(residual)::value>(
        w, static_cast<int64_t>(task) * kChannelBlock);
  });
}
#endif

struct BackwardKernel {
  int clamp;
  Bounds bounds;
  bool residual;  // BatchNormAddTrainingGrad
  int64_t block;  // 0, or kChannelBlock: dY, dX and dZ in NCHWc blocks
};

OrtStatus* backward_compute(void* kernel, OrtKernelContext* context) {
  const BackwardKernel& k = *static_cast<const BackwardKernel*>(kernel);
  const char* op = k.residual ? "BatchNormAddTrainingGrad" : "BatchNormTrainingGrad";
  Tensor grad, x, scale, bias, mean, invstd, y;
  RETURN_IF_ERROR(read_input(context, 0, &grad));
  RETURN_IF_ERROR(read_input(context, 1, &x));
  RETURN_IF_ERROR(read_input(context, 2, &scale));
  RETURN_IF_ERROR(read_input(context, 3, &bias));
  RETURN_IF_ERROR(read_input(context, 4, &mean));
  RETURN_IF_ERROR(read_input(context, 5, &invstd));
  Layout layout;
  RETURN_IF_ERROR(channel_layout(x, op, &layout));
  const bool per_plane = grad.rank == x.rank && grad.rank > 2 && grad.dims[0] == x.dims[0] &&
                         grad.dims[1] == x.dims[1] && grad.numel() == layout.batch * layout.channels;
  if (grad.numel() != x.numel() && !per_plane)
    return api->error(kInvalidArgument, std::string(op) + ": dY must have X's shape, or [N, C, 1, ...] for one value " +
                                            "per image plane");
  RETURN_IF_ERROR(check_channels(scale, layout.channels, op, "scale"));
  RETURN_IF_ERROR(check_channels(bias, layout.channels, op, "bias"));
  RETURN_IF_ERROR(check_channels(mean, layout.channels, op, "mean"));
  RETURN_IF_ERROR(check_channels(invstd, layout.channels, op, "invstd"));
  if (k.residual) {
    RETURN_IF_ERROR(read_input(context, 6, &y));
    RETURN_IF_ERROR(check_same_shape(y, x, op, "Y"));
  }
  if (k.block != 0) {
#if X86_VECTORS
    const bool vectors = __builtin_cpu_supports("avx512f");
#else
    const bool vectors = false;
#endif
    if (!vectors || k.block != kChannelBlock || layout.channels % kChannelBlock != 0)
      return api->error(kInvalidArgument, std::string(op) + ": block=" + std::to_string(k.block) +
                                              " needs block 16, C a multiple of 16 and an AVX-512 CPU; C is " +
                                              std::to_string(layout.channels));
  }
  BackwardWork work{};
  work.grad = grad.data;
  work.grad_per_plane = grad.numel() != x.numel();  // the [N, C, 1, ...] form, checked above
  work.x = x.data;
  work.scale = scale.data;
  work.bias = bias.data;
  work.mean = mean.data;
  work.invstd = invstd.data;
  work.y = y.data;
  work.layout = layout;
  work.blocks = blocks_of(layout, kGradPlanes);
  work.clamp = k.clamp;
  work.bounds = k.bounds;
  const int64_t channels[1] = {layout.channels};
  RETURN_IF_ERROR(make_output(context, 0, x.dims, x.rank, &work.grad_x));
  RETURN_IF_ERROR(make_output(context, 1, channels, 1, &work.grad_scale));
  RETURN_IF_ERROR(make_output(context, 2, channels, 1, &work.grad_bias));
  if (k.residual) RETURN_IF_ERROR(make_output(context, 3, x.dims, x.rank, &work.grad_z));
  if (x.numel() == 0) {
    for (int64_t c = 0; c < layout.channels; ++c) work.grad_scale[c] = work.grad_bias[c] = 0.0f;
    return nullptr;
  }
#if X86_VECTORS
  if (k.block != 0)
    return parallel_for(context, blocked_backward_block, static_cast<size_t>(layout.channels / kChannelBlock),
                        &work);
#endif
  return parallel_for(context, backward_block, static_cast<size_t>(work.blocks.count), &work);
}

// ---------------------------------------------------------------------------------------------------------------
// Op definitions.

OrtStatus* read_clamp(const OrtKernelInfo* info, int* mode, Bounds* bounds) {
  int64_t clamp = 0;
  RETURN_IF_ERROR(read_int(info, "clamp", &clamp));
  RETURN_IF_ERROR(read_float(info, "min", &bounds->lo));
  RETURN_IF_ERROR(read_float(info, "max", &bounds->hi));
  *mode = clamp_mode(clamp != 0, *bounds);
  return nullptr;
}

template <bool kResidual>
OrtStatus* create_forward(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  ForwardKernel k{};
  RETURN_IF_ERROR(read_float(info, "epsilon", &k.epsilon));
  RETURN_IF_ERROR(read_float(info, "momentum", &k.momentum));
  RETURN_IF_ERROR(read_clamp(info, &k.clamp, &k.bounds));
  k.residual = kResidual;
  *kernel = new ForwardKernel(k);
  return nullptr;
}

template <bool kResidual>
OrtStatus* create_backward(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  BackwardKernel k{};
  RETURN_IF_ERROR(read_clamp(info, &k.clamp, &k.bounds));
  k.residual = kResidual;
  read_int_or(info, "block", 0, &k.block);
  *kernel = new BackwardKernel(k);
  return nullptr;
}

void destroy_forward(void* kernel) { delete static_cast<ForwardKernel*>(kernel); }
void destroy_backward(void* kernel) { delete static_cast<BackwardKernel*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& batch_norm_ops() {
  static const std::vector<OpDefinition> ops = {
    make_op("BatchNormTraining", 5, 5, create_forward<false>, forward_compute, destroy_forward),
    make_op("BatchNormTrainingGrad", 6, 3, create_backward<false>, backward_compute, destroy_backward),
    make_op("BatchNormAddTraining", 6, 5, create_forward<true>, forward_compute, destroy_forward),
    make_op("BatchNormAddTrainingGrad", 7, 4, create_backward<true>, backward_compute, destroy_backward),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
