// The current device's DeviceFacts (device_facts.h).
#include "device_facts.h"

#include "device_info.h"
#include "gemm_f16x3.h"
#include "gemm_softmax.h"
#include "row_program.h"

namespace gemmfuse::cuda {

DeviceFacts device_facts(const Plan* plan) {
  DeviceFacts d;
  d.compute_capability = compute_capability();
  d.sms = sm_count();
  d.row_smem_limit = row_smem_limit();  // also opts the interpreter into that much, once per device
  d.sm90_kernels = sm90::f16x3_built();
  if (plan != nullptr && d.sm90_kernels && d.compute_capability == 90 &&
      match_fused_softmax(*plan).matches) {
    const int clusters = sm90::gemm_softmax_max_clusters(plan->dtype);  // read once per device
    (plan->dtype == DType::F16 ? d.softmax_clusters_f16 : d.softmax_clusters_bf16) = clusters;
  }
  return d;
}

}  // namespace gemmfuse::cuda
