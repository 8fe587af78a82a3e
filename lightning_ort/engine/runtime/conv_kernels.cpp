// ONNX Runtime CPU kernels for convolutions: the weaving of a stride-2 convolution's input gradient, the
// subsampling of a strided pointwise convolution's input for its weight gradient, the blocking of a weight into
// the layout of ONNX Runtime's NCHWc convolution, and the weight gradient of a 3x3 convolution.
//
//   ai.lightning_ort::Interleave2x2(P00, P01, P10, P11) -> Y
//       attributes: height, width (ints), Y's image size.
//       Each Pab is [N, C, rows_ab, cols_ab] float32, contiguous, with rows_ab >= (height - a + 1) / 2 and
//       cols_ab >= (width - b + 1) / 2. Y is [N, C, height, width] with Y[n, c, 2u + a, 2v + b] = Pab[n, c, u, v];
//       what lies beyond in a phase is not read.
//
//       attribute block (int, 0 when absent): 16 reads the phases and writes Y in ONNX Runtime's NCHWc layout of
//       16-channel blocks (C a multiple of 16), the layout of the phase convolutions that produce them.
//
//   ai.lightning_ort::Interleave2x2Add(P00, P01, P10, P11, Z) -> Y
//       The same, with Z ([N, C, rows, cols] like P00) added to the even rows' even columns: the input gradient of
//       a strided 1x1 projection that reads the same tensor as the 3x3 convolution whose phases these are, which
//       lands on exactly those positions. With block = 16, Z is blocked too.
//
//   ai.lightning_ort::Subsample(X) -> Y
//       attributes: row_step, col_step (ints, >= 1).
//       X is [N, C, H, W] float32, contiguous; Y is [N, C, ceil(H / row_step), ceil(W / col_step)] with
//       Y[n, c, u, v] = X[n, c, u * row_step, v * col_step]: every row_step-th row and col_step-th column from the
//       first, copied as they are (NaN and signed zeros included). ONNX Runtime's Slice copies such a selection
//       element by element.
//
//   ai.lightning_ort::BlockWeight(W) -> Y
//       attributes: block (int) B, flip (int, 0 or 1).
//       W is a dense convolution's weight [O, I, kh, kw] float32, O and I multiples of B; T = kh * kw taps.
//       flip = 0: Y is W in the OIHWBiBo layout that com.microsoft.nchwc.Conv reads, shaped [O, I, kh, kw]:
//       Y viewed as [O/B, I/B, T, B, B] holds Y[a, b, t, x, y] = W[a*B + y, b*B + x, t].
//       flip = 1: Y is that layout of W's input-gradient kernel K[i, o, t] = W[o, i, T-1-t] (transposed, taps
//       reversed), shaped [I, O, kh, kw]: Y[a, b, t, x, y] = W[b*B + x, a*B + y, T-1-t].
//       Each B x B x T tile is read from B contiguous rows of W and written once, in one pass over the weight;
//       ONNX Runtime's ReorderInput takes two passes for it (input then output channels), three with the flip.
//
//   ai.lightning_ort::ConvWeightGrad3x3(X, dY) -> dW
//       attributes: stride (int, 1 or 2).
//       The weight gradient [O, C, 3, 3] of a 3x3 convolution with padding 1, no dilation and no groups, from its
//       input X [N, C, H, W] (contiguous, C a multiple of 8) and its output's gradient dY [N, O, (H - 1) / stride
//       + 1, (W - 1) / stride + 1] in the NCHWc layout of ONNX Runtime's ReorderInput with 16-channel blocks
//       (AVX-512's; O a multiple of 32), the blocked copy its input gradient's convolution reads. Each tap's outer
//       products are summed over the output positions in a register tile of 8 input by 32 output channels (one X
//       value broadcast, two 16-channel vectors of dY as the blocked layout holds them: no unfolding, no padding,
//       no transposes), over a group of images per tile pass. A task takes a chunk of the images and one tile of
//       32 output channels; the chunks' sums are added up at the end, in chunk order, over the session's threads.
//
// The four phases are the stride-1 convolutions that compute the input gradient of a stride-2 convolution
// (lightning_ort/engine/fx/conv_phases.py); ONNX Runtime's DepthToSpace, which could weave them once
// concatenated, runs as a generic six-axis transpose, several times slower than this single pass. Work is split by
// plane over the session's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ort_custom_ops.h"
#include "x86_tiles.h"

namespace lightning_ort_kernels {
namespace {

struct InterleaveKernel {
  int64_t height, width, block;
};

struct InterleaveWork {
  const float* phases[5];  // the fifth: Z, added to the even-even phase (Interleave2x2Add)
  int64_t rows[5], cols[5];
  float* out;
  int64_t height, width;
  Chunks planes;  // planes of one channel each, or of one NCHWc block of channels
};

// One output row from the two phases of its parity: even columns from `even` (plus `addend`'s with kAdd; it is
// not read otherwise), odd ones from `odd`. A position is kLanes floats: one channel's value, or an NCHWc block's.
template <bool kAdd, int64_t kLanes>
KERNEL_CLONES void weave_row(const float* __restrict even, const float* __restrict addend,
                             const float* __restrict odd, float* __restrict out, int64_t width) {
  const int64_t pairs = width / 2;
  for (int64_t v = 0; v < pairs; ++v)
    for (int64_t j = 0; j < kLanes; ++j) {
      out[2 * v * kLanes + j] = kAdd ? even[v * kLanes + j] + addend[v * kLanes + j] : even[v * kLanes + j];
      out[(2 * v + 1) * kLanes + j] = odd[v * kLanes + j];
    }
  if (width % 2)
    for (int64_t j = 0; j < kLanes; ++j)
      out[(width - 1) * kLanes + j] = kAdd ? even[pairs * kLanes + j] + addend[pairs * kLanes + j]
                                           : even[pairs * kLanes + j];
}

template <bool kAdd, int64_t kLanes>
void interleave_planes(void* data, size_t task) {
  const InterleaveWork& w = *static_cast<const InterleaveWork*>(data);
  const auto row = [&](int64_t phase, int64_t plane, int64_t u) {
    return w.phases[phase] + (plane * w.rows[phase] + u) * w.cols[phase] * kLanes;
  };
  for (int64_t plane = w.planes.first(task); plane < w.planes.last(task); ++plane) {
    float* out = w.out + plane * w.height * w.width * kLanes;
    for (int64_t y = 0; y < w.height; ++y) {
      const int64_t parity = y % 2, u = y / 2;
      const float* even_row = row(2 * parity, plane, u);
      const float* odd_row = row(2 * parity + 1, plane, u);
      if (kAdd && parity == 0)
        weave_row<true, kLanes>(even_row, row(4, plane, u), odd_row, out + y * w.width * kLanes, w.width);
      else
        weave_row<false, kLanes>(even_row, nullptr, odd_row, out + y * w.width * kLanes, w.width);
    }
  }
}

constexpr int64_t kInterleaveBlock = 16;

template <bool kAdd>
OrtStatus* interleave_compute(void* kernel, OrtKernelContext* context) {
  const char* op = kAdd ? "Interleave2x2Add" : "Interleave2x2";
  const InterleaveKernel& size = *static_cast<const InterleaveKernel*>(kernel);
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
  if (size.block != 0 && (size.block != kInterleaveBlock || dims[1] % kInterleaveBlock != 0))
    return api->error(kInvalidArgument, std::string(op) + ": block=" + std::to_string(size.block) +
                                            " needs block 16 and C a multiple of 16; C is " + std::to_string(dims[1]));
  const int64_t lanes = size.block != 0 ? kInterleaveBlock : 1;
  work.planes = Chunks::of(dims[0] * dims[1] / lanes);
  if (work.planes.items == 0 || size.height == 0 || size.width == 0) return nullptr;
  if (size.block != 0)
    return parallel_for(context, interleave_planes<kAdd, kInterleaveBlock>, work.planes.tasks(), &work);
  return parallel_for(context, interleave_planes<kAdd, 1>, work.planes.tasks(), &work);
}

OrtStatus* create_interleave(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  InterleaveKernel size{};
  RETURN_IF_ERROR(read_int(info, "height", &size.height));
  RETURN_IF_ERROR(read_int(info, "width", &size.width));
  read_int_or(info, "block", 0, &size.block);
  if (size.height < 0 || size.width < 0)
    return api->error(kInvalidArgument, "Interleave2x2: height and width must be >= 0");
  *kernel = new InterleaveKernel(size);
  return nullptr;
}

void destroy_interleave(void* kernel) { delete static_cast<InterleaveKernel*>(kernel); }

struct Steps {
  int64_t rows, cols;
};

struct SubsampleWork {
  const float* in;
  float* out;
  int64_t height, width, out_height, out_width;
  Chunks planes;
  Steps steps;
};

// One output row from an input row: every step-th element; a step of 2 compiles to vector shuffles.
template <int64_t kStep>
KERNEL_CLONES void subsample_row(const float* __restrict in, float* __restrict out, int64_t count, int64_t step) {
  const int64_t stride = kStep > 0 ? kStep : step;
  for (int64_t v = 0; v < count; ++v) out[v] = in[v * stride];
}

void subsample_planes(void* data, size_t task) {
  const SubsampleWork& w = *static_cast<const SubsampleWork*>(data);
  for (int64_t plane = w.planes.first(task); plane < w.planes.last(task); ++plane)
    for (int64_t u = 0; u < w.out_height; ++u) {
      const float* in = w.in + (plane * w.height + u * w.steps.rows) * w.width;
      float* out = w.out + (plane * w.out_height + u) * w.out_width;
      if (w.steps.cols == 2)
        subsample_row<2>(in, out, w.out_width, 2);
      else
        subsample_row<0>(in, out, w.out_width, w.steps.cols);
    }
}

OrtStatus* subsample_compute(void* kernel, OrtKernelContext* context) {
  const Steps& steps = *static_cast<const Steps*>(kernel);
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.rank != 4) return api->error(kInvalidArgument, "Subsample: X must be [N, C, H, W]");
  SubsampleWork work{};
  work.in = x.data;
  work.steps = steps;
  work.height = x.dims[2];
  work.width = x.dims[3];
  work.out_height = (work.height + steps.rows - 1) / steps.rows;
  work.out_width = (work.width + steps.cols - 1) / steps.cols;
  const int64_t dims[4] = {x.dims[0], x.dims[1], work.out_height, work.out_width};
  RETURN_IF_ERROR(make_output(context, 0, dims, 4, &work.out));
  work.planes = Chunks::of(x.dims[0] * x.dims[1]);
  if (work.planes.items == 0 || work.out_height == 0 || work.out_width == 0) return nullptr;
  return parallel_for(context, subsample_planes, work.planes.tasks(), &work);
}

OrtStatus* create_subsample(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  Steps steps{};
  RETURN_IF_ERROR(read_int(info, "row_step", &steps.rows));
  RETURN_IF_ERROR(read_int(info, "col_step", &steps.cols));
  if (steps.rows < 1 || steps.cols < 1)
    return api->error(kInvalidArgument, "Subsample: row_step and col_step must be >= 1");
  *kernel = new Steps(steps);
  return nullptr;
}

void destroy_subsample(void* kernel) { delete static_cast<Steps*>(kernel); }

struct Blocking {
  int64_t block, flip;
};

struct BlockWork {
  const float* weight;
  float* out;
  int64_t block, flip, taps, rows, cols;  // the weight is [rows, cols, taps]; tiles are [rows/B, cols/B] or flipped
  Chunks tiles;
  bool vectors;  // this CPU has the vector path of the block: AVX-512 for 16, AVX2 for 8
};

// Y[a, c, t, x, y] = first[base(x, t) + y * step], where `first` is the tile's first source element:
//   forward: W[a*B + y, c*B + x, t]; base = x * taps + t, step = one row of W (I * taps);
//   flip:    W[c*B + x, a*B + y, T-1-t]; base = x * (I * taps) + T-1-t, step = taps.
// With AVX-512 and B = 16 a tile is a series of 16x16 register transposes: forward, of 16 rows of W (16 * taps
// contiguous floats each) 16 columns at a time; flip, for each x, of the [16, taps] block of W's row x (16 taps at
// a time). With AVX2 and B = 8 the same with 8x8 transposes; elsewhere scalar loads. The rows read stay in
// L1 across the tile, and the output is written in whole runs of B.
struct Tile {
  const float* first;
  float* out;
  int64_t base_x, base_t, offset, step;  // base(x, t) = x * base_x + t * base_t + offset
};

Tile tile_of(const BlockWork& w, int64_t tile) {
  const int64_t b = w.block, taps = w.taps, row = w.cols * taps;
  const int64_t a = tile / (w.flip ? w.rows / b : w.cols / b), c = tile % (w.flip ? w.rows / b : w.cols / b);
  if (!w.flip) return {w.weight + (a * b * w.cols + c * b) * taps, w.out + tile * b * b * taps, taps, 1, 0, row};
  return {w.weight + (c * b * w.cols + a * b) * taps, w.out + tile * b * b * taps, row, -1, taps - 1, taps};
}

#if X86_VECTORS
__attribute__((target("avx512f"))) void block_tile_16(const Tile& tile, int64_t taps, bool flip) {
  __m512 r[16];
  if (!flip) {
    // Column j = x * taps + t of the 16 rows is Y[., ., t, x, 0..15].
    for (int64_t j0 = 0; j0 < 16 * taps; j0 += 16) {
      for (int64_t y = 0; y < 16; ++y) r[y] = _mm512_loadu_ps(tile.first + y * tile.step + j0);
      transpose_16x16(r);
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t x = (j0 + j) / taps, t = (j0 + j) % taps;
        _mm512_storeu_ps(tile.out + (t * 16 + x) * 16, r[j]);
      }
    }
    return;
  }
  // Row x of W holds [16 (y), taps] from `first + x * base_x`; its column s is Y[., ., T-1-s, x, 0..15].
  for (int64_t x = 0; x < 16; ++x)
    for (int64_t s0 = 0; s0 < taps; s0 += 16) {
      const int64_t count = std::min<int64_t>(16, taps - s0);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      const float* row = tile.first + x * tile.base_x + s0;
      for (int64_t y = 0; y < 16; ++y) r[y] = _mm512_maskz_loadu_ps(mask, row + y * taps);
      transpose_16x16(r);
      for (int64_t k = 0; k < count; ++k) _mm512_storeu_ps(tile.out + ((taps - 1 - s0 - k) * 16 + x) * 16, r[k]);
    }
}

__attribute__((target("avx2"))) void block_tile_8(const Tile& tile, int64_t taps, bool flip) {
  __m256 r[8];
  if (!flip) {
    for (int64_t j0 = 0; j0 < 8 * taps; j0 += 8) {
      for (int64_t y = 0; y < 8; ++y) r[y] = _mm256_loadu_ps(tile.first + y * tile.step + j0);
      transpose_8x8(r);
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t x = (j0 + j) / taps, t = (j0 + j) % taps;
        _mm256_storeu_ps(tile.out + (t * 8 + x) * 8, r[j]);
      }
    }
    return;
  }
  for (int64_t x = 0; x < 8; ++x)
    for (int64_t s0 = 0; s0 < taps; s0 += 8) {
      const int64_t count = std::min<int64_t>(8, taps - s0);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const float* row = tile.first + x * tile.base_x + s0;
      for (int64_t y = 0; y < 8; ++y) r[y] = _mm256_maskload_ps(row + y * taps, mask);
      transpose_8x8(r);
      for (int64_t k = 0; k < count; ++k) _mm256_storeu_ps(tile.out + ((taps - 1 - s0 - k) * 8 + x) * 8, r[k]);
    }
}
#endif

void block_tile(const Tile& tile, int64_t b, int64_t taps) {
  for (int64_t t = 0; t < taps; ++t)
    for (int64_t x = 0; x < b; ++x) {
      const float* source = tile.first + x * tile.base_x + t * tile.base_t + tile.offset;
      float* line = tile.out + (t * b + x) * b;
      for (int64_t y = 0; y < b; ++y) line[y] = source[y * tile.step];
    }
}

void block_tiles(void* data, size_t task) {
  const BlockWork& w = *static_cast<const BlockWork*>(data);
  for (int64_t index = w.tiles.first(task); index < w.tiles.last(task); ++index) {
    const Tile tile = tile_of(w, index);
#if X86_VECTORS
    if (w.block == 16 && w.vectors) {
      block_tile_16(tile, w.taps, w.flip);
      continue;
    }
    if (w.block == 8 && w.vectors) {
      block_tile_8(tile, w.taps, w.flip);
      continue;
    }
#endif
    block_tile(tile, w.block, w.taps);
  }
}

OrtStatus* block_weight_compute(void* kernel, OrtKernelContext* context) {
  const Blocking& blocking = *static_cast<const Blocking*>(kernel);
  Tensor weight;
  RETURN_IF_ERROR(read_input(context, 0, &weight));
  const int64_t b = blocking.block;
  if (weight.rank != 4 || weight.dims[0] % b != 0 || weight.dims[1] % b != 0)
    return api->error(kInvalidArgument, "BlockWeight: W must be [O, I, kh, kw] with O and I multiples of block " +
                                            std::to_string(b));
  BlockWork work{};
  work.weight = weight.data;
  work.block = b;
  work.flip = blocking.flip;
  work.rows = weight.dims[0];
  work.cols = weight.dims[1];
  work.taps = weight.dims[2] * weight.dims[3];
  const int64_t dims[4] = {blocking.flip ? work.cols : work.rows, blocking.flip ? work.rows : work.cols,
                           weight.dims[2], weight.dims[3]};
  RETURN_IF_ERROR(make_output(context, 0, dims, 4, &work.out));
  work.tiles = Chunks::of((work.rows / b) * (work.cols / b));
#if X86_VECTORS
  work.vectors = (b == 16 && __builtin_cpu_supports("avx512f")) || (b == 8 && __builtin_cpu_supports("avx2"));
#endif
  if (work.tiles.items == 0 || work.taps == 0) return nullptr;
  return parallel_for(context, block_tiles, work.tiles.tasks(), &work);
}

OrtStatus* create_block_weight(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  Blocking blocking{};
  RETURN_IF_ERROR(read_int(info, "block", &blocking.block));
  RETURN_IF_ERROR(read_int(info, "flip", &blocking.flip));
  if (blocking.block < 1 || (blocking.flip != 0 && blocking.flip != 1))
    return api->error(kInvalidArgument, "BlockWeight: block must be >= 1 and flip 0 or 1");
  *kernel = new Blocking(blocking);
  return nullptr;
}

void destroy_block_weight(void* kernel) { delete static_cast<Blocking*>(kernel); }

// ---------------------------------------------------------------------------------------------------------------
// ConvWeightGrad3x3

typedef float Vector16 __attribute__((vector_size(64)));
constexpr int64_t kBlock = 16;        // the NCHWc channel block of dY (AVX-512's)
constexpr int64_t kTileInputs = 8;    // input channels per register tile
constexpr int64_t kTileOutputs = 32;  // output channels per register tile: two blocks of dY
constexpr int64_t kTileSize = kTileInputs * kTileOutputs;
constexpr int64_t kMaxImageChunks = 4;
constexpr int64_t kPartialBytes = 4 << 20;  // more chunks only while all their sums fit in this
constexpr int64_t kGroupBytes = 256 << 10;  // a group of images' tile rows: 8 input planes, 32 output planes

// sums[c, o] += sum over images n and output positions (y, x) of x_at(n, c, y, x) * dy(n, o, y, x) for one tap, c
// in [0, 8) and o in [0, 32): `x` points at the tap's input in the first image's channel c0 for the first position
// (channel planes `plane` floats apart, images x_image, row step x_row, column step x_col), `dy0` and `dy1` at the
// two output blocks' first position (images dy_image apart, row step dy_row).
// The products are contracted into fused multiply-adds here (the library is built without contraction).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
KERNEL_CLONES void weight_grad_tile(const float* __restrict x, int64_t plane, int64_t x_image, int64_t x_row,
                                    int64_t x_col, const float* __restrict dy0, const float* __restrict dy1,
                                    int64_t dy_image, int64_t dy_row, int64_t images, int64_t rows, int64_t cols,
                                    float* __restrict sums) {
  Vector16 acc[kTileInputs][2];
  for (int64_t c = 0; c < kTileInputs; ++c)
    for (int64_t v = 0; v < 2; ++v) std::memcpy(&acc[c][v], sums + c * kTileOutputs + 16 * v, sizeof(Vector16));
  for (int64_t n = 0; n < images; ++n) {
    for (int64_t y = 0; y < rows; ++y) {
      const float* xr = x + n * x_image + y * x_row;
      const float* g0 = dy0 + n * dy_image + y * dy_row;
      const float* g1 = dy1 + n * dy_image + y * dy_row;
      for (int64_t col = 0; col < cols; ++col) {
        Vector16 d0, d1;
        std::memcpy(&d0, g0 + col * kBlock, sizeof(Vector16));
        std::memcpy(&d1, g1 + col * kBlock, sizeof(Vector16));
        const float* values = xr + col * x_col;
#pragma GCC unroll 8
        for (int64_t c = 0; c < kTileInputs; ++c) {
          acc[c][0] += values[c * plane] * d0;
          acc[c][1] += values[c * plane] * d1;
        }
      }
    }
  }
  for (int64_t c = 0; c < kTileInputs; ++c)
    for (int64_t v = 0; v < 2; ++v) std::memcpy(sums + c * kTileOutputs + 16 * v, &acc[c][v], sizeof(Vector16));
}
#pragma GCC pop_options

// The output rows (or columns) [first, last) whose input stride * i + tap - 1 lies inside [0, size).
struct Span {
  int64_t first, last;
};

Span valid_span(int64_t tap, int64_t stride, int64_t size, int64_t outputs) {
  const int64_t reach = size - tap;  // the last valid i has stride * i <= reach
  return {tap == 0 ? 1 : 0, reach < 0 ? 0 : std::min(outputs, reach / stride + 1)};
}

struct WeightGradWork {
  const float* x;
  const float* dy;
  int64_t images, inputs, outputs, height, width, out_height, out_width, stride;
  int64_t chunks;  // image chunks; a task is one chunk and one output tile
  float* partial;  // per chunk: [9 taps, C / 8, O / 32, 8, 32]
  float* dw;       // [O, C, 3, 3]
  int64_t tile_count() const { return outputs / kTileOutputs; }
  int64_t size() const { return 9 * inputs * outputs; }
};

void weight_grad_share(void* data, size_t task) {
  const WeightGradWork& w = *static_cast<const WeightGradWork*>(data);
  const int64_t tiles = w.tile_count(), chunk = static_cast<int64_t>(task) / tiles;
  const int64_t o0 = static_cast<int64_t>(task) % tiles * kTileOutputs;
  const int64_t in_plane = w.height * w.width, out_plane = w.out_height * w.out_width * kBlock;
  const int64_t x_image = w.inputs * in_plane, dy_image = w.outputs * w.out_height * w.out_width;
  const int64_t x_row = w.stride * w.width, x_col = w.stride, dy_row = w.out_width * kBlock;
  // Images are taken in groups whose tile rows stay in cache from one tap to the next; each tile call sums a
  // group's images, so that small images do not reload the accumulators for every image.
  const int64_t image_bytes = (kTileInputs * in_plane + kTileOutputs * w.out_height * w.out_width) * 4;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / image_bytes);
  float* sums = w.partial + chunk * w.size();
  const int64_t last = (chunk + 1) * w.images / w.chunks;
  for (int64_t n = chunk * w.images / w.chunks; n < last; n += group) {
    const int64_t images = std::min(group, last - n);
    const float* x = w.x + n * x_image;
    const float* dy = w.dy + n * dy_image + (o0 / kBlock) * out_plane;
    for (int64_t tap = 0; tap < 9; ++tap) {
      const int64_t kh = tap / 3, kw = tap % 3;
      const Span rows = valid_span(kh, w.stride, w.height, w.out_height);
      const Span cols = valid_span(kw, w.stride, w.width, w.out_width);
      if (rows.last <= rows.first || cols.last <= cols.first) continue;
      const int64_t first_input = (w.stride * rows.first + kh - 1) * w.width + w.stride * cols.first + kw - 1;
      const float* dy0 = dy + (rows.first * w.out_width + cols.first) * kBlock;
      for (int64_t c0 = 0; c0 < w.inputs; c0 += kTileInputs) {
        const float* xt = x + c0 * in_plane + first_input;
        float* tile = sums + ((tap * (w.inputs / kTileInputs) + c0 / kTileInputs) * tiles + o0 / kTileOutputs) * kTileSize;
        weight_grad_tile(xt, in_plane, x_image, x_row, x_col, dy0, dy0 + out_plane, dy_image, dy_row, images,
                         rows.last - rows.first, cols.last - cols.first, tile);
      }
    }
  }
}

// The chunks' sums of one tap's tile row (one tap, 8 input channels, every output channel) added up in the first
// chunk's, in chunk order, and written to dW.
void weight_grad_total(void* data, size_t task) {
  const WeightGradWork& w = *static_cast<const WeightGradWork*>(data);
  const int64_t row = static_cast<int64_t>(task), span = w.tile_count() * kTileSize;
  const int64_t tap = row / (w.inputs / kTileInputs), c0 = row % (w.inputs / kTileInputs) * kTileInputs;
  float* total = w.partial + row * span;
  for (int64_t chunk = 1; chunk < w.chunks; ++chunk) {
    const float* p = w.partial + chunk * w.size() + row * span;
    for (int64_t i = 0; i < span; ++i) total[i] += p[i];
  }
  for (int64_t t = 0; t < w.tile_count(); ++t)
    for (int64_t c = 0; c < kTileInputs; ++c)
      for (int64_t o = 0; o < kTileOutputs; ++o)
        w.dw[((t * kTileOutputs + o) * w.inputs + c0 + c) * 9 + tap] = total[(t * kTileInputs + c) * kTileOutputs + o];
}

OrtStatus* weight_grad_compute(void* kernel, OrtKernelContext* context) {
  const int64_t stride = *static_cast<const int64_t*>(kernel);
  Tensor x, dy;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  RETURN_IF_ERROR(read_input(context, 1, &dy));
  const bool shapes = x.rank == 4 && dy.rank == 4 && x.dims[0] == dy.dims[0] &&
                      dy.dims[2] == (x.dims[2] - 1) / stride + 1 && dy.dims[3] == (x.dims[3] - 1) / stride + 1 &&
                      x.dims[1] % kTileInputs == 0 && dy.dims[1] % kTileOutputs == 0;
  if (!shapes)
    return api->error(kInvalidArgument,
                      "ConvWeightGrad3x3: X must be [N, C, H, W] and dY [N, O, (H - 1) / stride + 1, (W - 1) / stride "
                      "+ 1] (NCHWc-blocked by 16 channels), C a multiple of 8 and O of 32");
  WeightGradWork work{};
  work.x = x.data;
  work.dy = dy.data;
  work.images = x.dims[0];
  work.inputs = x.dims[1];
  work.outputs = dy.dims[1];
  work.height = x.dims[2];
  work.width = x.dims[3];
  work.out_height = dy.dims[2];
  work.out_width = dy.dims[3];
  work.stride = stride;
  const int64_t dims[4] = {work.outputs, work.inputs, 3, 3};
  RETURN_IF_ERROR(make_output(context, 0, dims, 4, &work.dw));
  const int64_t bytes = work.size() * static_cast<int64_t>(sizeof(float));
  work.chunks = std::max<int64_t>(1, std::min({kMaxImageChunks, work.images, kPartialBytes / std::max<int64_t>(bytes, 1)}));
  std::vector<float> partial(static_cast<size_t>(work.chunks * work.size()), 0.0f);
  work.partial = partial.data();
  if (work.images > 0)
    RETURN_IF_ERROR(parallel_for(context, weight_grad_share, static_cast<size_t>(work.chunks * work.tile_count()), &work));
  return parallel_for(context, weight_grad_total, static_cast<size_t>(9 * work.inputs / kTileInputs), &work);
}

OrtStatus* create_weight_grad(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  int64_t stride = 1;
  RETURN_IF_ERROR(read_int(info, "stride", &stride));
  if (stride != 1 && stride != 2) return api->error(kInvalidArgument, "ConvWeightGrad3x3: stride must be 1 or 2");
  *kernel = new int64_t(stride);
  return nullptr;
}

void destroy_weight_grad(void* kernel) { delete static_cast<int64_t*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& conv_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("Interleave2x2", 4, 1, create_interleave, interleave_compute<false>, destroy_interleave),
      make_op("Interleave2x2Add", 5, 1, create_interleave, interleave_compute<true>, destroy_interleave),
      make_op("Subsample", 1, 1, create_subsample, subsample_compute, destroy_subsample),
      make_op("BlockWeight", 1, 1, create_block_weight, block_weight_compute, destroy_block_weight),
      make_op("ConvWeightGrad3x3", 2, 1, create_weight_grad, weight_grad_compute, destroy_weight_grad),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
