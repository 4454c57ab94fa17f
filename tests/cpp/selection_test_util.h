// Plans and devices for tests of the CUDA executor's host-side choices (the kernel selection,
// the backward's scratch layout): plain C++, no GPU.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda::test {

// An H100/H200 (132 SMs) with the sm90 kernels built.
inline DeviceFacts hopper() {
  DeviceFacts d;
  d.compute_capability = 90;
  d.sms = 132;
  d.row_smem_limit = 227 * 1024;
  d.sm90_kernels = true;
  d.softmax_clusters_bf16 = d.softmax_clusters_f16 = 66;
  return d;
}

inline DeviceFacts ampere() {
  DeviceFacts d = hopper();
  d.compute_capability = 80;
  d.sms = 108;
  d.softmax_clusters_bf16 = d.softmax_clusters_f16 = 0;
  return d;
}

inline std::string linear(int64_t K, int64_t N) {
  return "linear in=" + std::to_string(K) + " out=" + std::to_string(N) + " bias=1\n";
}

inline Plan plan_of(const std::string& spec, int64_t M, DType dtype = DType::F32,
                    Precision precision = Precision::FP32, bool training = false,
                    std::vector<std::vector<int64_t>> operands = {}) {
  PlanRequest r;
  r.chain = parse_chain(spec);
  r.batch_sizes = {M};
  r.operand_sizes = std::move(operands);
  r.dtype = dtype;
  r.precision = precision;
  r.device = Device::CUDA;
  r.for_training = training;
  r.fast_min_rows = 0;
  r.fast_min_flops = 0;
  return make_plan(r);
}

inline bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace gemmfuse::cuda::test
