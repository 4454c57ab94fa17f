// The executor's environment switches (GEMMFUSE_FUSED_SOFTMAX, GEMMFUSE_F16X3,
// GEMMFUSE_SM90_PDL, GEMMFUSE_SM90_DEFER): a path is on unless its variable is "0". Callers
// read each once, at first use, for A/B timing without a rebuild.
#pragma once

#include <cstdlib>
#include <cstring>

namespace gemmfuse::cuda {

inline bool env_switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

}  // namespace gemmfuse::cuda
