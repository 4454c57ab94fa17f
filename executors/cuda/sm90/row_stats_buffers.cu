// Per-stream row statistics buffers of the fused softmax kernel (see row_stats_buffers.h).
#include "row_stats_buffers.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "cuda_check.h"

namespace gemmfuse::cuda::sm90 {
namespace {

struct Buffer {
  void* words = nullptr;
  size_t bytes = 0;
  unsigned int epoch = 0;      // the last one used
  cudaEvent_t done = nullptr;  // recorded after the buffer's last launch (none: not evictable)
  uint64_t last_use = 0;       // for least-recently-used eviction
  int leases = 0;              // launches being enqueued: not to be freed
  // Outgrown words still leased by a launch on the same stream being enqueued by another
  // thread: freed, in the stream's order, when the last lease ends.
  std::vector<void*> retired;
};

struct Device {
  std::map<unsigned long long, Buffer> by_stream;  // stream id -> buffer (ids are never reused)
  uint64_t clock = 0;
};

std::mutex mu;
std::map<int, Device> devices;

// Frees the least recently used buffer that is neither leased nor unmarked, ordered after
// its last launch on `stream` (which needs the room), while `d` keeps kMaxRowStatsBuffers or
// more. The entry leaves the map before any call that can throw.
void evict(Device& d, cudaStream_t stream) {
  while (d.by_stream.size() >= kMaxRowStatsBuffers) {
    auto victim = d.by_stream.end();
    for (auto it = d.by_stream.begin(); it != d.by_stream.end(); ++it)
      if (it->second.leases == 0 && it->second.done != nullptr &&
          (victim == d.by_stream.end() || it->second.last_use < victim->second.last_use))
        victim = it;
    if (victim == d.by_stream.end()) return;  // all leased by other threads (or unmarked): keep them
    const Buffer b = victim->second;
    d.by_stream.erase(victim);
    GF_CUDA_CHECK(cudaStreamWaitEvent(stream, b.done, 0));
    GF_CUDA_CHECK(cudaEventDestroy(b.done));  // its resources go once it has completed
    if (b.words != nullptr) GF_CUDA_CHECK(cudaFreeAsync(b.words, stream));
  }
}

}  // namespace

RowStatsLease::RowStatsLease(cudaStream_t stream, int dev, unsigned long long stream_id, size_t bytes)
    : stream_(stream), dev_(dev), id_(stream_id) {
  std::lock_guard<std::mutex> lock(mu);
  Device& d = devices[dev_];
  const bool fresh = d.by_stream.count(id_) == 0;
  if (fresh) evict(d, stream_);
  Buffer& b = d.by_stream[id_];
  try {
    if (b.bytes < bytes || b.epoch == ~0u) {  // (re)start from zeroed words and epoch 1
      if (b.bytes < bytes) {
        if (b.words != nullptr) {
          // Stream order frees the old words after every launch enqueued on this stream so
          // far; one still being enqueued by another thread must keep them until it is.
          if (b.leases > 0) b.retired.push_back(b.words);
          else GF_CUDA_CHECK(cudaFreeAsync(b.words, stream_));
        }
        b.words = nullptr;
        b.bytes = 0;
        GF_CUDA_CHECK(cudaMallocAsync(&b.words, bytes, stream_));
        b.bytes = bytes;
      }
      GF_CUDA_CHECK(cudaMemsetAsync(b.words, 0, b.bytes, stream_));
      b.epoch = 0;
    }
  } catch (...) {
    if (fresh && b.words == nullptr && b.leases == 0) d.by_stream.erase(id_);
    throw;
  }
  b.last_use = ++d.clock;
  ++b.leases;
  stats_ = {static_cast<unsigned long long*>(b.words), ++b.epoch};
}

RowStatsLease::~RowStatsLease() {
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = devices[dev_].by_stream[id_];
  --b.leases;
  // No GF_CUDA_CHECK: a destructor must not throw. Where the event cannot be recorded the
  // buffer becomes unevictable (no event to order a free after) and the error surfaces at
  // the caller's next CUDA call.
  if (b.done == nullptr && cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming) != cudaSuccess) {
    b.done = nullptr;
    return;
  }
  if (cudaEventRecord(b.done, stream_) != cudaSuccess) {
    (void)cudaEventDestroy(b.done);
    b.done = nullptr;
    return;
  }
  if (b.leases == 0) {  // the launches that held outgrown words are enqueued: free them after
    for (void* w : b.retired) (void)cudaFreeAsync(w, stream_);
    b.retired.clear();
  }
}

size_t row_stats_buffers_kept() {
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  return devices[dev].by_stream.size();
}

}  // namespace gemmfuse::cuda::sm90
