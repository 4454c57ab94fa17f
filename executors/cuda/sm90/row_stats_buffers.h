// Where the fused softmax kernel's direct launches exchange row statistics (see
// publish_row_stats in gemm_softmax_tail.cuh): one buffer per stream, kept from launch to launch,
// with the next epoch of that buffer for each launch (the stream orders its launches, so no
// word of an earlier launch can carry it). Allocated, grown and cleared in stream order.
// At most kMaxRowStatsBuffers are kept per device: beyond that, the least recently used one
// is freed in the order of the stream that needs a new one, after its own last launch (an
// event recorded after each launch), so a program that makes streams by the thousand does
// not keep a buffer for each. (Captured launches use the graph's workspace instead.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace gemmfuse::cuda::sm90 {

constexpr size_t kMaxRowStatsBuffers = 8;

struct RowStats {
  unsigned long long* words;
  unsigned int epoch;
};

// The buffer of one direct launch, held from before it is enqueued until after: the
// destructor records that the stream's work so far includes the launch (if any was
// enqueued), and until then the buffer is not freed for another stream.
class RowStatsLease {
 public:
  // `bytes` or more for the stream `stream_id` (cudaStreamGetId) of device `dev` (current).
  RowStatsLease(cudaStream_t stream, int dev, unsigned long long stream_id, size_t bytes);
  ~RowStatsLease();
  RowStatsLease(const RowStatsLease&) = delete;
  RowStatsLease& operator=(const RowStatsLease&) = delete;
  const RowStats& stats() const { return stats_; }

 private:
  cudaStream_t stream_;
  int dev_;
  unsigned long long id_;
  RowStats stats_{};
};

// How many buffers the current device keeps now (for tests).
size_t row_stats_buffers_kept();

}  // namespace gemmfuse::cuda::sm90
