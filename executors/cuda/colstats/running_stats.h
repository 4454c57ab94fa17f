// BatchNorm running statistics as the module keeps them (fp32, bf16 or fp16), read and
// written in place in fp64 arithmetic, rounded once on store: a bf16 model's running_mean is
// updated without a per-call conversion to fp32 and back (two kernels each way).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "gemmfuse/chain.h"
#include "gemmfuse/executor.h"

namespace gemmfuse::cuda {

struct RunningStat {
  void* p = nullptr;  // nullptr: absent
  DType type = DType::F32;
  __host__ __device__ explicit operator bool() const { return p != nullptr; }
};

__device__ __forceinline__ double load_stat(const RunningStat& s, int64_t i) {
  switch (s.type) {
    case DType::BF16: return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(s.p)[i]));
    case DType::F16: return static_cast<double>(__half2float(static_cast<const __half*>(s.p)[i]));
    default: return static_cast<double>(static_cast<const float*>(s.p)[i]);
  }
}

__device__ __forceinline__ void store_stat(const RunningStat& s, int64_t i, double v) {
  switch (s.type) {
    case DType::BF16: static_cast<__nv_bfloat16*>(s.p)[i] = __double2bfloat16(v); break;
    case DType::F16: static_cast<__half*>(s.p)[i] = __double2half(v); break;
    default: static_cast<float*>(s.p)[i] = static_cast<float>(v); break;
  }
}

// The state tensor s<i> that `op` names (nullptr when the operand is None). Throws
// std::invalid_argument when it is not a state operand of this call.
inline void* state_ptr(const RunArgs& args, const Operand& op) {
  if (!op.present()) return nullptr;
  if (op.kind != Operand::Kind::State || op.index < 0 ||
      op.index >= static_cast<int>(args.state.size()) || !args.state[op.index])
    throw std::invalid_argument("gemmfuse: batch_norm state s" + std::to_string(op.index) + " missing");
  return args.state[op.index];
}

// A running-statistics operand with its dtype (absent when the operand is None).
inline RunningStat running_stat(const RunArgs& args, const Operand& op) {
  void* p = state_ptr(args, op);
  const DType t = p && static_cast<size_t>(op.index) < args.state_dtypes.size()
                      ? args.state_dtypes[op.index] : DType::F32;
  return {p, t};
}

}  // namespace gemmfuse::cuda
