// RegisterCustomOps, which ONNX Runtime calls when a session registers this library: it checks the API table
// and adds every kernel file's ops to the ai.lightning_ort domain.

#include <cstring>
#include <string>

#include "ort_custom_ops.h"

namespace lightning_ort_kernels {
const Api* api = nullptr;
}  // namespace lightning_ort_kernels

using namespace lightning_ort_kernels;

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  const void* table = base->GetApi(kApiVersion);
  if (table == nullptr) {
    // An ONNX Runtime older than the API version these kernels read; version 1's table can still say so.
    const Api oldest(base->GetApi(1));
    return oldest.error(kFail, std::string("lightning_ort's CPU kernels need ONNX Runtime 1.17 or newer, not ") +
                                   base->GetVersionString());
  }
  static Api checked(table);
  const auto build_info = checked.at<const char* (*)()>(kGetBuildInfoString)();
  if (build_info == nullptr || std::strncmp(build_info, "ORT Build Info", 14) != 0)
    return checked.error(kFail, std::string("lightning_ort's CPU kernels: ONNX Runtime ") +
                                    base->GetVersionString() + "'s C API table is not laid out as expected");
  api = &checked;
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(
      api->at<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(kDomain, &domain));
  for (const auto* ops :
       {&batch_norm_ops(), &max_pool_ops(), &conv_ops(), &activation_ops(), &layer_norm_ops(), &group_norm_ops(),
        &transpose_ops(), &matmul_ops()})
    for (const OpDefinition& op : *ops)
      RETURN_IF_ERROR(
          api->at<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomainAdd)(domain, &op));
  return api->at<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain);
}
