// ONNX Runtime CPU kernel that weaves the four phases of a stride-2 convolution's input gradient into the image.
//
//   ai.lightning_ort::Interleave2x2(P00, P01, P10, P11) -> Y
//       attributes: height, width (ints), Y's image size.
//       Each Pab is [N, C, rows_ab, cols_ab] float32, contiguous, with rows_ab >= (height - a + 1) / 2 and
//       cols_ab >= (width - b + 1) / 2. Y is [N, C, height, width] with Y[n, c, 2u + a, 2v + b] = Pab[n, c, u, v];
//       what lies beyond in a phase is not read.
//
//   ai.lightning_ort::Interleave2x2Add(P00, P01, P10, P11, Z) -> Y
//       The same, with Z ([N, C, rows, cols] like P00) added to the even rows' even columns: the input gradient of
//       a strided 1x1 projection that reads the same tensor as the 3x3 convolution whose phases these are, which
//       lands on exactly those positions.
//
// The four phases are the stride-1 convolutions that compute the input gradient of a stride-2 convolution
// (lightning_ort/engine/fx/conv_phases.py); ONNX Runtime's DepthToSpace, which could weave them once
// concatenated, runs as a generic six-axis transpose, several times slower than this single pass. Work is split by
// plane over the session's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

struct ImageSize {
  int64_t height, width;
};

struct InterleaveWork {
  const float* phases[5];  // the fifth: Z, added to the even-even phase (Interleave2x2Add)
  int64_t rows[5], cols[5];
  float* out;
  int64_t height, width, planes, planes_per_task;
};

// One output row from the two phases of its parity: even columns from `even` (plus `addend`'s with kAdd; it is
// not read otherwise), odd ones from `odd`.
template <bool kAdd>
KERNEL_CLONES void weave_row(const float* __restrict even, const float* __restrict addend,
                             const float* __restrict odd, float* __restrict out, int64_t width) {
  const int64_t pairs = width / 2;
  for (int64_t v = 0; v < pairs; ++v) {
    out[2 * v] = kAdd ? even[v] + addend[v] : even[v];
    out[2 * v + 1] = odd[v];
  }
  if (width % 2) out[width - 1] = kAdd ? even[pairs] + addend[pairs] : even[pairs];
}

template <bool kAdd>
void interleave_planes(void* data, size_t task) {
  const InterleaveWork& w = *static_cast<const InterleaveWork*>(data);
  const int64_t first = static_cast<int64_t>(task) * w.planes_per_task;
  const int64_t last = std::min(first + w.planes_per_task, w.planes);
  for (int64_t plane = first; plane < last; ++plane) {
    float* out = w.out + plane * w.height * w.width;
    for (int64_t y = 0; y < w.height; ++y) {
      const int64_t parity = y % 2, u = y / 2;
      const int64_t even = 2 * parity, odd = 2 * parity + 1;
      const float* even_row = w.phases[even] + (plane * w.rows[even] + u) * w.cols[even];
      const float* odd_row = w.phases[odd] + (plane * w.rows[odd] + u) * w.cols[odd];
      if (kAdd && parity == 0)
        weave_row<true>(even_row, w.phases[4] + (plane * w.rows[4] + u) * w.cols[4], odd_row, out + y * w.width,
                        w.width);
      else
        weave_row<false>(even_row, nullptr, odd_row, out + y * w.width, w.width);
    }
  }
}

template <bool kAdd>
OrtStatus* interleave_compute(void* kernel, OrtKernelContext* context) {
  const char* op = kAdd ? "Interleave2x2Add" : "Interleave2x2";
  const ImageSize& size = *static_cast<const ImageSize*>(kernel);
  InterleaveWork work{};
  Tensor phases[5];
  for (size_t i = 0; i < (kAdd ? 5 : 4); ++i) {
    RETURN_IF_ERROR(read_input(context, i, &phases[i]));
    const Tensor& p = phases[i];
    const int64_t row = i < 4 ? static_cast<int64_t>(i) / 2 : 0, col = i < 4 ? static_cast<int64_t>(i) % 2 : 0;
    if (p.rank != 4 || p.dims[0] != phases[0].dims[0] || p.dims[1] != phases[0].dims[1])
      return api->error(kInvalidArgument, std::string(op) + ": the phases must be [N, C, rows, cols] of one N and C");
    if (p.dims[2] < (size.height - row + 1) / 2 || p.dims[3] < (size.width - col + 1) / 2) {
      const std::string name = i < 4 ? "phase " + std::to_string(i) : "Z";
      return api->error(kInvalidArgument, std::string(op) + ": " + name + " is [" + std::to_string(p.dims[2]) + ", " +
                                              std::to_string(p.dims[3]) + "], too small for an image of " +
                                              std::to_string(size.height) + "x" + std::to_string(size.width));
    }
    work.phases[i] = p.data;
    work.rows[i] = p.dims[2];
    work.cols[i] = p.dims[3];
  }
  const int64_t dims[4] = {phases[0].dims[0], phases[0].dims[1], size.height, size.width};
  RETURN_IF_ERROR(make_output(context, 0, dims, 4, &work.out));
  work.height = size.height;
  work.width = size.width;
  work.planes = dims[0] * dims[1];
  if (work.planes == 0 || size.height == 0 || size.width == 0) return nullptr;
  // About 64 tasks for the thread pool, whole planes each.
  work.planes_per_task = std::max<int64_t>(1, work.planes / 64);
  const int64_t tasks = (work.planes + work.planes_per_task - 1) / work.planes_per_task;
  return parallel_for(context, interleave_planes<kAdd>, static_cast<size_t>(tasks), &work);
}

OrtStatus* create_interleave(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  ImageSize size{};
  RETURN_IF_ERROR(read_int(info, "height", &size.height));
  RETURN_IF_ERROR(read_int(info, "width", &size.width));
  if (size.height < 0 || size.width < 0)
    return api->error(kInvalidArgument, "Interleave2x2: height and width must be >= 0");
  *kernel = new ImageSize(size);
  return nullptr;
}

void destroy_interleave(void* kernel) { delete static_cast<ImageSize*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& conv_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("Interleave2x2", 4, 1, create_interleave, interleave_compute<false>, destroy_interleave),
      make_op("Interleave2x2Add", 5, 1, create_interleave, interleave_compute<true>, destroy_interleave),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
