// Per-stream row statistics buffers of the fused softmax kernel (see row_stats_buffers.h).
#include "row_stats_buffers.h"

#include <cstdint>
#include <map>
#include <mutex>

#include "cuda_check.h"

namespace gemmfuse::cuda::sm90 {
namespace {

struct Buffer {
  void* words = nullptr;
  size_t bytes = 0;
  unsigned int epoch = 0;      // the last one used
  cudaEvent_t done = nullptr;  // recorded after the buffer's last launch
  uint64_t last_use = 0;       // for least-recently-used eviction
  int leases = 0;              // launches being enqueued: not to be freed
};

struct Device {
  std::map<unsigned long long, Buffer> by_stream;  // stream id -> buffer (ids are never reused)
  uint64_t clock = 0;
};

std::mutex mu;
std::map<int, Device> devices;

// Frees the least recently used buffer not being leased, ordered after its last launch on
// `stream` (which needs the room), while `d` keeps more than kMaxRowStatsBuffers - 1.
void evict(Device& d, cudaStream_t stream) {
  while (d.by_stream.size() >= kMaxRowStatsBuffers) {
    auto victim = d.by_stream.end();
    for (auto it = d.by_stream.begin(); it != d.by_stream.end(); ++it)
      if (it->second.leases == 0 && it->second.done != nullptr &&
          (victim == d.by_stream.end() || it->second.last_use < victim->second.last_use))
        victim = it;
    if (victim == d.by_stream.end()) return;  // all leased by other threads (or unmarked): keep them
    Buffer& b = victim->second;
    GF_CUDA_CHECK(cudaStreamWaitEvent(stream, b.done, 0));
    GF_CUDA_CHECK(cudaEventDestroy(b.done));  // its resources go once it has completed
    if (b.words != nullptr) GF_CUDA_CHECK(cudaFreeAsync(b.words, stream));
    d.by_stream.erase(victim);
  }
}

}  // namespace

RowStatsLease::RowStatsLease(cudaStream_t stream, unsigned long long stream_id, size_t bytes)
    : stream_(stream), id_(stream_id) {
  GF_CUDA_CHECK(cudaGetDevice(&dev_));
  std::lock_guard<std::mutex> lock(mu);
  Device& d = devices[dev_];
  if (d.by_stream.count(id_) == 0) evict(d, stream_);
  Buffer& b = d.by_stream[id_];
  if (b.bytes < bytes || b.epoch == ~0u) {  // (re)start from zeroed words and epoch 1
    if (b.bytes < bytes) {
      if (b.words != nullptr) GF_CUDA_CHECK(cudaFreeAsync(b.words, stream_));
      b.words = nullptr;
      b.bytes = 0;
      GF_CUDA_CHECK(cudaMallocAsync(&b.words, bytes, stream_));
      b.bytes = bytes;
    }
    GF_CUDA_CHECK(cudaMemsetAsync(b.words, 0, b.bytes, stream_));
    b.epoch = 0;
  }
  b.last_use = ++d.clock;
  ++b.leases;
  stats_ = {static_cast<unsigned long long*>(b.words), ++b.epoch};
}

RowStatsLease::~RowStatsLease() {
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = devices[dev_].by_stream[id_];
  --b.leases;
  // Not GF_CUDA_CHECK: a destructor must not throw. Without an event the buffer is never
  // evicted; a failed record is a sticky error that the caller's next CUDA call reports.
  if (b.done == nullptr && cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming) != cudaSuccess) {
    b.done = nullptr;
    return;
  }
  (void)cudaEventRecord(b.done, stream_);
}

size_t row_stats_buffers_kept() {
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  return devices[dev].by_stream.size();
}

}  // namespace gemmfuse::cuda::sm90
