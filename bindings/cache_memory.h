// Device memory for caches that outlive a call (prepared weights, converted operands).
// Inductor's CUDA graph trees run a graph's first calls (warm-up) with the calling thread's
// allocations routed to the graph's private pool, and fail when a tensor of that pool stays
// alive after the call. A cache entry is therefore allocated by another thread (the pool
// routes by thread) and recorded as used on the caller's stream, so the caching allocator
// frees it only after that stream's work. Caches keep their entries for the life of the
// process (never destroyed at exit, when the CUDA runtime may already be unloading).
#pragma once

#include <ATen/ATen.h>

namespace gemmfuse::bindings {

// An uninitialised tensor like at::empty(sizes, options), outside any CUDA graph pool.
at::Tensor cache_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace gemmfuse::bindings
