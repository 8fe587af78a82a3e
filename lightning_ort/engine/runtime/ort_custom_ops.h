// The part of ONNX Runtime's C ABI that lightning_ort's CPU kernels use, and the helpers they share.
//
// The wheel ships no C API header, so the ABI is declared here: the API table is read by position.
// RegisterCustomOps (register_kernels.cpp) checks one entry of known result (GetBuildInfoString) before it
// registers anything, and fails the session's creation with a message otherwise. Each kernel file defines its
// ops with make_op and lists them for RegisterCustomOps.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

extern "C" {
struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// OrtCustomOp as of API version 16: the version-1 callbacks, input/output characteristics, memory types,
// variadic arities, and the status-returning CreateKernelV2 / KernelComputeV2.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const void*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const void*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
};
}

namespace lightning_ort_kernels {

constexpr uint32_t kApiVersion = 17;
constexpr uint32_t kCustomOpVersion = 16;
constexpr int kFloat = 1;             // ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
constexpr int kInvalidArgument = 2;   // ORT_INVALID_ARGUMENT
constexpr int kFail = 1;              // ORT_FAIL
constexpr int kRequired = 0;          // INPUT_OUTPUT_REQUIRED
constexpr int kMemTypeDefault = 0;    // OrtMemTypeDefault
constexpr const char* kDomain = "ai.lightning_ort";

// Positions in the OrtApi table (onnxruntime_c_api.h, ORT_API_VERSION 17 and later).
enum ApiEntry : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetAttributeArrayInt64 = 163,
  kGetBuildInfoString = 254,
  kKernelContextParallelFor = 274,
};

// The API table and typed calls through it.
class Api {
 public:
  explicit Api(const void* table) : table_(static_cast<void* const*>(table)) {}

  template <typename Fn>
  Fn at(ApiEntry entry) const {
    return reinterpret_cast<Fn>(table_[entry]);
  }

  OrtStatus* error(int code, const std::string& message) const {
    return at<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, message.c_str());
  }

 private:
  void* const* table_;
};

// The checked API table, set by RegisterCustomOps before any kernel is created.
extern const Api* api;

// The elementwise loops, compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one for the CPU.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define KERNEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL_CLONES
#endif

// kLanes float accumulators as one vector value (a GCC and Clang extension), for sums taken in independent lanes.
// Each clone of KERNEL_CLONES holds it in its own vector registers. Accumulators in a float array are vectorized
// or left scalar as the compiler's unrolling heuristics decide: GCC 12 kept 16-lane arrays scalar in some loops
// (docs/performance.md, "Sums in vector registers", has the measurements).
template <int64_t kLanes>
struct VectorOf {
  typedef float type __attribute__((vector_size(kLanes * sizeof(float))));
};
template <int64_t kLanes>
using FloatLanes = typename VectorOf<kLanes>::type;

// The kLanes floats at p (any alignment) into v.
template <int64_t kLanes>
inline void load_lanes(FloatLanes<kLanes>& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}

// v's lanes into the kLanes floats at p (any alignment).
template <int64_t kLanes>
inline void store_lanes(float* p, const FloatLanes<kLanes>& v) {
  std::memcpy(p, &v, sizeof v);
}

// total plus v's lanes, added in double one by one, lane 0 first (so that the lanes of several vectors add up in
// one chain).
template <int64_t kLanes>
inline double lanes_total(const FloatLanes<kLanes>& v, double total = 0.0) {
  for (int64_t j = 0; j < kLanes; ++j) total += v[j];
  return total;
}

// Returns early from the enclosing function with `call`'s status when it is an error.
#define RETURN_IF_ERROR(call)               \
  do {                                      \
    OrtStatus* status_ = (call);            \
    if (status_ != nullptr) return status_; \
  } while (0)

struct Tensor {
  float* data = nullptr;
  int64_t dims[8] = {};
  size_t rank = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (size_t i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
};

inline OrtStatus* read_input(OrtKernelContext* context, size_t index, Tensor* out) {
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(api->at<OrtStatus* (*)(OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(
      context, index, &value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(api->at<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(
      value, &info));
  OrtStatus* status = api->at<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(
      info, &out->rank);
  if (status == nullptr && out->rank > 8) status = api->error(kInvalidArgument, "tensors of rank > 8");
  if (status == nullptr)
    status = api->at<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(
        info, out->dims, out->rank);
  api->at<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  RETURN_IF_ERROR(status);
  void* data = nullptr;
  RETURN_IF_ERROR(api->at<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(value),
                                                                                       &data));
  out->data = static_cast<float*>(data);
  return nullptr;
}

inline OrtStatus* make_output(OrtKernelContext* context, size_t index, const int64_t* dims, size_t rank, float** out) {
  OrtValue* value = nullptr;
  RETURN_IF_ERROR(
      api->at<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
          context, index, dims, rank, &value));
  void* data = nullptr;
  RETURN_IF_ERROR(api->at<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(value, &data));
  *out = static_cast<float*>(data);
  return nullptr;
}

inline OrtStatus* parallel_for(OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, void* data) {
  return api->at<OrtStatus* (*)(OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      kKernelContextParallelFor)(context, fn, total, total, data);
}

// `items` whole items (image planes, weight tiles) split into about 64 tasks for parallel_for.
struct Chunks {
  int64_t items = 0, per_task = 1;

  static Chunks of(int64_t items) { return {items, std::max<int64_t>(1, items / 64)}; }
  size_t tasks() const { return static_cast<size_t>((items + per_task - 1) / per_task); }
  int64_t first(size_t task) const { return static_cast<int64_t>(task) * per_task; }
  int64_t last(size_t task) const { return std::min(first(task) + per_task, items); }
};

inline OrtStatus* check_same_shape(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  bool same = t.rank == x.rank;
  for (size_t i = 0; same && i < x.rank; ++i) same = t.dims[i] == x.dims[i];
  if (!same) return api->error(kInvalidArgument, std::string(op) + ": " + name + " must have X's shape");
  return nullptr;
}

inline OrtStatus* read_float(const OrtKernelInfo* info, const char* name, float* value) {
  return api->at<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name,
                                                                                                         value);
}

// The ints attribute `name` into values: its length first, then its values.
inline OrtStatus* read_ints(const OrtKernelInfo* info, const char* name, std::vector<int64_t>* values) {
  using Read = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*, size_t*);
  size_t size = 0;
  RETURN_IF_ERROR(api->at<Read>(kKernelInfoGetAttributeArrayInt64)(info, name, nullptr, &size));
  values->assign(size, 0);
  if (size == 0) return nullptr;
  return api->at<Read>(kKernelInfoGetAttributeArrayInt64)(info, name, values->data(), &size);
}

inline OrtStatus* read_int(const OrtKernelInfo* info, const char* name, int64_t* value) {
  return api->at<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name,
                                                                                                           value);
}

// The int attribute `name` into value, or fallback where the node has no such attribute.
inline void read_int_or(const OrtKernelInfo* info, const char* name, int64_t fallback, int64_t* value) {
  OrtStatus* status = read_int(info, name, value);
  if (status == nullptr) return;
  api->at<void (*)(OrtStatus*)>(kReleaseStatus)(status);
  *value = fallback;
}

struct OpDefinition : OrtCustomOp {
  const char* name;
  size_t inputs;
  size_t outputs;
};

inline OpDefinition make_op(const char* name, size_t inputs, size_t outputs,
                     OrtStatus* (*create)(const OrtCustomOp*, const void*, const OrtKernelInfo*, void**),
                     OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  OpDefinition op{};
  op.version = kCustomOpVersion;
  op.name = name;
  op.inputs = inputs;
  op.outputs = outputs;
  op.GetName = [](const OrtCustomOp* self) { return static_cast<const OpDefinition*>(self)->name; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return kFloat; };
  op.GetInputTypeCount = [](const OrtCustomOp* self) { return static_cast<const OpDefinition*>(self)->inputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = [](const OrtCustomOp* self) { return static_cast<const OpDefinition*>(self)->outputs; };
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return kMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  return op;
}

// The ops of each kernel file, which RegisterCustomOps adds to the domain.
const std::vector<OpDefinition>& batch_norm_ops();
const std::vector<OpDefinition>& max_pool_ops();
const std::vector<OpDefinition>& conv_ops();
const std::vector<OpDefinition>& activation_ops();
const std::vector<OpDefinition>& layer_norm_ops();
const std::vector<OpDefinition>& group_norm_ops();
const std::vector<OpDefinition>& transpose_ops();
const std::vector<OpDefinition>& matmul_ops();

}  // namespace lightning_ort_kernels
