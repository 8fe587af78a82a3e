// ONNX Runtime CPU kernel for matrix products through the BLAS that PyTorch was built with (Intel MKL).
//
//   ai.lightning_ort::BlasMatMul(A, B) -> Y
//       attributes: transA, transB (int, 0 or 1), alpha (float), threads (int, the session's intra-op threads).
//       Y = alpha * op(A) @ op(B), op(X) = X transposed where its attribute is 1: com.microsoft's FusedMatMul on
//       float32 matrices (rank 2), contiguous, A [M, K] or [K, M], B [K, N] or [N, K], Y [M, N].
//
// On some x86 CPUs MKL's sgemm multiplies faster than ONNX Runtime's MLAS; lightning_ort measures both once per
// process (engine/runtime/cpu_matmul.py) and, where MKL is faster, CPU sessions run their products here. The
// product is cut into panels, one per thread of the session's pool: of Y's rows or columns (its longer side), or
// of the sum over K where K is at least twice M and N (partial sums, added after). Each thread runs MKL's sgemm on
// its panel single-threaded (mkl_set_num_threads_local), so that MKL never starts OpenMP threads of its own
// beside ONNX Runtime's. MKL's symbols are looked up in the process, where PyTorch loaded them; a
// kernel is not created where they are missing.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
namespace {

// Fortran BLAS sgemm (column-major, 32-bit integers: MKL's LP64 interface, the one PyTorch calls).
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);
using SetLocalThreads = int (*)(int);

struct Blas {
  Sgemm sgemm = nullptr;
  SetLocalThreads set_local_threads = nullptr;
};

// MKL's sgemm_ and MKL_Set_Num_Threads_Local (the C form of mkl_set_num_threads_local): from PyTorch's library
// (this library links it), else from the process's global scope.
Blas blas_in(void* scope) {
  Blas b;
  b.sgemm = reinterpret_cast<Sgemm>(dlsym(scope, "sgemm_"));
  b.set_local_threads = reinterpret_cast<SetLocalThreads>(dlsym(scope, "MKL_Set_Num_Threads_Local"));
  if (b.sgemm == nullptr || b.set_local_threads == nullptr) return Blas{};
  return b;
}

const Blas& blas() {
  static const Blas found = [] {
    void* torch = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    const Blas in_torch = torch != nullptr ? blas_in(torch) : Blas{};
    return in_torch.sgemm != nullptr ? in_torch : blas_in(RTLD_DEFAULT);
  }();
  return found;
}

constexpr int64_t kChunk = 16384;

// y[i] += x[i] for n floats.
KERNEL_CLONES void add_into(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Panels of fewer rows or columns than this (a cache line of floats) are not split further; depth panels (the
// sum over K cut into parts) are at least kMinDepth deep.
constexpr int64_t kMinPanel = 16;
constexpr int64_t kMinDepth = 256;

// How Y is cut among the threads: into panels of its rows or of its columns, or the sum over K into partial sums,
// for products whose K is at least twice M and N (weight gradients: the sum over a batch's tokens), which MKL ran
// slowly on narrow panels of Y.
enum class Split { kRows, kColumns, kDepth };

struct MatMulWork {
  const float* a;
  const float* b;
  float* y;
  float* partial;  // the partial sums of depth panels 1, 2, ... (panel 0 writes Y), each M x N
  int64_t m, n, k;
  bool trans_a, trans_b;
  float alpha;
  Split split;
  int64_t per_panel;  // rows, columns or depth of each panel
  int64_t panels;
};

// Y's panel `task`: as column-major BLAS sees the row-major arrays, Y^T = alpha * op(B)^T @ op(A)^T.
void matmul_panel(void* data, size_t task) {
  const MatMulWork& w = *static_cast<const MatMulWork*>(data);
  const int64_t first = static_cast<int64_t>(task) * w.per_panel;
  const int64_t side = w.split == Split::kRows ? w.m : w.split == Split::kColumns ? w.n : w.k;
  const int64_t count = std::min(w.per_panel, side - first);
  if (count <= 0) return;
  const char trans_a = w.trans_a ? 'T' : 'N', trans_b = w.trans_b ? 'T' : 'N';
  // BLAS takes no leading dimension below 1, even of an empty operand.
  const int lda = static_cast<int>(std::max<int64_t>(1, w.trans_a ? w.m : w.k));
  const int ldb = static_cast<int>(std::max<int64_t>(1, w.trans_b ? w.k : w.n));
  const int ldy = static_cast<int>(w.n);
  const float zero = 0.0f;
  const float* a = w.a;
  const float* b = w.b;
  float* y = w.y;
  int rows = static_cast<int>(w.m), columns = static_cast<int>(w.n), depth = static_cast<int>(w.k);
  if (w.split == Split::kRows) {
    a += w.trans_a ? first : first * w.k;
    y += first * w.n;
    rows = static_cast<int>(count);
  } else if (w.split == Split::kColumns) {
    b += w.trans_b ? first * w.k : first;
    y += first;
    columns = static_cast<int>(count);
  } else {
    a += w.trans_a ? first * w.m : first;
    b += w.trans_b ? first : first * w.n;
    if (task > 0) y = w.partial + (static_cast<int64_t>(task) - 1) * w.m * w.n;
    depth = static_cast<int>(count);
  }
  const int previous = blas().set_local_threads(1);
  blas().sgemm(&trans_b, &trans_a, &columns, &rows, &depth, &w.alpha, b, &ldb, a, &lda, &zero, y, &ldy);
  blas().set_local_threads(previous);
}

// Rows `task` of Y: the partial sums of depth panels 1, 2, ... added into panel 0's.
void add_partial_sums(void* data, size_t task) {
  const MatMulWork& w = *static_cast<const MatMulWork*>(data);
  const int64_t size = w.m * w.n, first = static_cast<int64_t>(task) * kChunk, last = std::min(first + kChunk, size);
  for (int64_t p = 0; p + 1 < w.panels; ++p) add_into(w.y + first, w.partial + p * size + first, last - first);
}

struct MatMulKernel {
  bool trans_a, trans_b;
  float alpha;
  int64_t threads;
};

OrtStatus* matmul_compute(void* kernel, OrtKernelContext* context) {
  const MatMulKernel& kn = *static_cast<const MatMulKernel*>(kernel);
  Tensor a, b;
  RETURN_IF_ERROR(read_input(context, 0, &a));
  RETURN_IF_ERROR(read_input(context, 1, &b));
  if (a.rank != 2 || b.rank != 2)
    return api->error(kInvalidArgument, "BlasMatMul: A and B must be matrices (rank 2), not of ranks " +
                                            std::to_string(a.rank) + " and " + std::to_string(b.rank));
  MatMulWork w{};
  w.trans_a = kn.trans_a;
  w.trans_b = kn.trans_b;
  w.alpha = kn.alpha;
  w.m = kn.trans_a ? a.dims[1] : a.dims[0];
  w.k = kn.trans_a ? a.dims[0] : a.dims[1];
  w.n = kn.trans_b ? b.dims[0] : b.dims[1];
  const int64_t b_rows = kn.trans_b ? b.dims[1] : b.dims[0];
  if (b_rows != w.k)
    return api->error(kInvalidArgument, "BlasMatMul: op(A) has " + std::to_string(w.k) + " columns but op(B) has " +
                                            std::to_string(b_rows) + " rows");
  constexpr int64_t kLargest = std::numeric_limits<int>::max();
  if (std::max({w.m, w.n, w.k, w.m * w.k, w.k * w.n, w.m * w.n}) > kLargest)
    return api->error(kInvalidArgument, "BlasMatMul: matrices of 2^31 elements or more are beyond 32-bit BLAS");
  const int64_t dims[2] = {w.m, w.n};
  RETURN_IF_ERROR(make_output(context, 0, dims, 2, &w.y));
  if (w.m == 0 || w.n == 0) return nullptr;
  w.a = a.data;
  w.b = b.data;
  w.split = w.k >= 2 * std::max(w.m, w.n) ? Split::kDepth : w.m >= w.n ? Split::kRows : Split::kColumns;
  const int64_t side = w.split == Split::kRows ? w.m : w.split == Split::kColumns ? w.n : w.k;
  const int64_t smallest = w.split == Split::kDepth ? kMinDepth : kMinPanel;
  w.panels = std::max<int64_t>(1, std::min(kn.threads, side / smallest));
  w.per_panel = (side + w.panels - 1) / w.panels;
  if (w.split == Split::kColumns) w.per_panel = (w.per_panel + kMinPanel - 1) / kMinPanel * kMinPanel;
  w.panels = (side + w.per_panel - 1) / w.per_panel;
  if (w.panels == 1) {
    matmul_panel(&w, 0);
    return nullptr;
  }
  std::vector<float> partial;
  if (w.split == Split::kDepth) {
    partial.resize(static_cast<size_t>((w.panels - 1) * w.m * w.n));
    w.partial = partial.data();
  }
  RETURN_IF_ERROR(parallel_for(context, matmul_panel, static_cast<size_t>(w.panels), &w));
  if (w.split != Split::kDepth) return nullptr;
  return parallel_for(context, add_partial_sums, static_cast<size_t>((w.m * w.n + kChunk - 1) / kChunk), &w);
}

OrtStatus* create_matmul(const OrtCustomOp*, const void*, const OrtKernelInfo* info, void** kernel) {
  if (blas().sgemm == nullptr)
    return api->error(kFail,
                      "BlasMatMul: this process has no MKL sgemm_ and mkl_set_num_threads_local (PyTorch built "
                      "without MKL); create the session with SessionSettings(cpu_matmul='mlas')");
  int64_t trans_a = 0, trans_b = 0, threads = 1;
  float alpha = 1.0f;
  read_int_or(info, "transA", 0, &trans_a);
  read_int_or(info, "transB", 0, &trans_b);
  read_int_or(info, "threads", 1, &threads);
  OrtStatus* status = read_float(info, "alpha", &alpha);
  if (status != nullptr) {
    api->at<void (*)(OrtStatus*)>(kReleaseStatus)(status);
    alpha = 1.0f;
  }
  *kernel = new MatMulKernel{trans_a != 0, trans_b != 0, alpha, std::max<int64_t>(1, threads)};
  return nullptr;
}

void destroy_matmul(void* kernel) { delete static_cast<MatMulKernel*>(kernel); }

}  // namespace

const std::vector<OpDefinition>& matmul_ops() {
  static const std::vector<OpDefinition> ops = {
      make_op("BlasMatMul", 2, 1, create_matmul, matmul_compute, destroy_matmul),
  };
  return ops;
}

}  // namespace lightning_ort_kernels
