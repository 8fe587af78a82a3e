// ONNX Runtime CPU kernel for transposes of float32 tensors, over the session's threads.
//
//   ai.lightning_ort::Transpose(X) -> Y
//       attribute: perm (ints), a permutation of X's axes. Y[i_0, ..., i_{r-1}] = X at index i_k on axis perm[k]:
//       ONNX's Transpose, X float32 and contiguous.
//
// ONNX Runtime's CPU Transpose copies a general permutation element by element on one thread. This one first merges
// the output axes that stay adjacent in X and drops those of size 1; a permutation that keeps X's last axis last is
// then a copy of contiguous runs, and any other one a 2-D transpose between X's last axis and Y's, done in 16 x 16
// tiles (each tile's reads stay in cache while its rows are written). Runs or tile strips are split over the
// session's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

constexpr int64_t kTile = 16;

// Y's axes after merging and dropping: sizes, the stride of each in X, and in Y (contiguous).
struct Axes {
  std::vector<int64_t> sizes, in_strides, out_strides;

  int64_t rank() const { return static_cast<int64_t>(sizes.size()); }
};

Axes merged_axes(const Tensor& x, const std::vector<int64_t>& perm) {
  const int64_t rank = static_cast<int64_t>(x.rank);
  std::vector<int64_t> strides(x.rank, 1);
  for (int64_t a = rank - 2; a >= 0; --a) strides[a] = strides[a + 1] * x.dims[a + 1];
  Axes axes;
  for (int64_t k = 0; k < rank; ++k) {
    const int64_t size = x.dims[perm[k]], stride = strides[perm[k]];
    if (size == 1) continue;
    if (!axes.sizes.empty() && axes.in_strides.back() == stride * size) {
      axes.sizes.back() *= size;
      axes.in_strides.back() = stride;
      continue;
    }
    axes.sizes.push_back(size);
    axes.in_strides.push_back(stride);
  }
  axes.out_strides.assign(axes.sizes.size(), 1);
  for (int64_t k = axes.rank() - 2; k >= 0; --k) axes.out_strides[k] = axes.out_strides[k + 1] * axes.sizes[k + 1];
  return axes;
}

// The offsets in X and Y of successive indices over the axes `outer` (listed outermost first): computed once
// for the first, then carried from index to index.
class Odometer {
 public:
  Odometer(const Axes& axes, const std::vector<int64_t>& outer, int64_t index)
      : axes_(axes), outer_(outer), digits_(outer.size(), 0) {
    for (int64_t d = static_cast<int64_t>(outer.size()) - 1; d >= 0; --d) {
      const int64_t axis = outer[d];
      digits_[d] = index % axes.sizes[axis];
      index /= axes.sizes[axis];
      in += digits_[d] * axes.in_strides[axis];
      out += digits_[d] * axes.out_strides[axis];
    }
  }

  void advance() {
    for (int64_t d = static_cast<int64_t>(outer_.size()) - 1; d >= 0; --d) {
      const int64_t axis = outer_[d];
      in += axes_.in_strides[axis];
      out += axes_.out_strides[axis];
      if (++digits_[d] < axes_.sizes[axis]) return;
      in -= digits_[d] * axes_.in_strides[axis];
      out -= digits_[d] * axes_.out_strides[axis];
      digits_[d] = 0;
    }
  }

  int64_t in = 0, out = 0;

 private:
  const Axes& axes_;
  const std::vector<int64_t>& outer_;
  std::vector<int64_t> digits_;
};

struct TransposeWork {
  const float* x;
  float* y;
  Axes axes;
  std::vector<int64_t> outer;  // the axes iterated outside the copied run or the tiled pair
  int64_t inner = 0;           // the axis contiguous in X (the tiled pair's first), when tiling
  int64_t strips = 1;          // tile strips per outer index
  Chunks chunks;
};

// Runs: Y's last axis is contiguous in X too.
void copy_runs(void* data, size_t task) {
  const TransposeWork& w = *static_cast<const TransposeWork*>(data);
  const int64_t run = w.axes.sizes.back();
  Odometer at(w.axes, w.outer, w.chunks.first(task));
  for (int64_t item = w.chunks.first(task); item < w.chunks.last(task); ++item, at.advance())
    std::memcpy(w.y + at.out, w.x + at.in, static_cast<size_t>(run) * sizeof(float));
}

// One tile: its columns read from X's rows (contiguous), transposed in a buffer in L1, its rows written to Y's
// (contiguous).
KERNEL_CLONES void transpose_tile(const float* __restrict x, float* __restrict y, int64_t rows, int64_t cols,
                                  int64_t x_stride, int64_t y_stride) {
  float tile[kTile][kTile];
  for (int64_t b = 0; b < cols; ++b)
    for (int64_t a = 0; a < rows; ++a) tile[a][b] = x[a + b * x_stride];
  for (int64_t a = 0; a < rows; ++a)
    for (int64_t b = 0; b < cols; ++b) y[a * y_stride + b] = tile[a][b];
}

// Tiles: X's last axis (w.inner, contiguous in X) against Y's last (contiguous in Y); one strip of kTile of the
// former per item, across all of the latter.
void copy_tiles(void* data, size_t task) {
  const TransposeWork& w = *static_cast<const TransposeWork*>(data);
  const Axes& axes = w.axes;
  const int64_t last = axes.rank() - 1;
  const int64_t rows = axes.sizes[w.inner], cols = axes.sizes[last];
  const int64_t y_stride = axes.out_strides[w.inner], x_stride = axes.in_strides[last];
  const int64_t first = w.chunks.first(task), last_item = w.chunks.last(task);
  Odometer at(axes, w.outer, first / w.strips);
  for (int64_t item = first; item < last_item; ++item) {
    if (item > first && item % w.strips == 0) at.advance();
    const int64_t a0 = item % w.strips * kTile, a1 = std::min(a0 + kTile, rows);
    for (int64_t b0 = 0; b0 < cols; b0 += kTile)
      transpose_tile(w.x + at.in + a0 + b0 * x_stride, w.y + at.out + a0 * y_stride + b0, a1 - a0,
                     std::min(kTile, cols - b0), x_stride, y_stride);
  }
}

struct TransposeKernel {
  std::vector<int64_t> perm;
};

OrtStatus* transpose_compute(void* kernel, OrtKernelContext* context) {
  const TransposeKernel& k = *static_cast<const TransposeKernel*>(kernel);
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  const size_t rank = x.rank;
  std::vector<bool> seen(rank, false);
  bool valid = k.perm.size() == rank;
  for (size_t i = 0; valid && i < rank; ++i) {
    valid = k.perm[i] >= 0 && k.perm[i] < static_cast<int64_t>(rank) && !seen[k.perm[i]];
    if (valid) seen[k.perm[i]] = true;
  }
  if (!valid)
    return api->error(kInvalidArgument, "Transpose: perm must be a permutation of X's " + std::to_string(rank) +
                                            " axes");
  int64_t dims[8] = {};
  for (size_t i = 0; i < rank; ++i) dims[i] = x.dims[k.perm[i]];
  TransposeWork work{};
  RETURN_IF_ERROR(make_output(context, 0, dims, rank, &work.y));
  const int64_t total = x.numel();
  if (total == 0) return nullptr;
  work.x = x.data;
  work.axes = merged_axes(x, k.perm);
  const Axes& axes = work.axes;
  const int64_t last = axes.rank() - 1;
  if (axes.rank() <= 1) {
    std::memcpy(work.y, work.x, static_cast<size_t>(total) * sizeof(float));
    return nullptr;
  }
  if (axes.in_strides[last] == 1) {
    for (int64_t a = 0; a < last; ++a) work.outer.push_back(a);
    work.chunks = Chunks::of(total / axes.sizes[last]);
    return parallel_for(context, copy_runs, work.chunks.tasks(), &work);
  }
  work.inner = std::find(axes.in_strides.begin(), axes.in_strides.end(), 1) - axes.in_strides.begin();
  for (int64_t a = 0; a < last; ++a)
    if (a != work.inner) work.outer.push_back(a);
  work.strips = (axes.sizes[work.inner] + kTile - 1) / kTile;
  work.chunks = Chunks::of(total / (axes.sizes[work.inner] * axes.sizes[last]) * work.strips);
  return parallel_for(context, copy_tiles, work.chunks.tasks(), &work);
}

OrtStatus* create_transpose(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  auto* k = new TransposeKernel();
  OrtStatus* status = read_ints(info, "perm", &k->perm);
  if (status != nullptr) {
    delete k;
    return status;
  }
  *kernel = k;
  return nullptr;
}

void destroy_transpose(void* kernel) { delete static_cast<TransposeKernel*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& transpose_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("Transpose", 1, 1, create_transpose, transpose_compute, destroy_transpose),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
