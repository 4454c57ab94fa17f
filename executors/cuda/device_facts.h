// What the kernel selection needs to know of the current device (selection.h's DeviceFacts),
// read from the CUDA runtime once per device.
#pragma once

#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda {

// The current device's facts. The fused GEMM + softmax kernel's residency (an occupancy
// query of that kernel) is read only where `plan` is one it may run (match_fused_softmax),
// as before the selection was one step; without a plan, it is left 0.
DeviceFacts device_facts(const Plan* plan = nullptr);

}  // namespace gemmfuse::cuda
