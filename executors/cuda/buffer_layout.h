// Scratch and prepared memory as buffers one after another, each on a 256-byte boundary: the
// one way the CUDA executor's layouts (layout.h, the backward's, dW's and attention's) place
// their buffers and read them back. No other dependencies, so kernel_emu's copies build it.
#pragma once

#include <cstddef>

namespace gemmfuse::cuda {

constexpr size_t kAlign = 256;
inline size_t align_up(size_t v, size_t a = kAlign) { return (v + a - 1) / a * a; }

// Buffers placed one after another, each at a kAlign boundary: take(bytes) returns where.
// end() is the bytes they need, rounded up to kAlign. A layout whose stages reuse the same bytes
// sets `at` back to where they start.
struct Cursor {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t off = align_up(at);
    at = off + bytes;
    return off;
  }
  size_t end() const { return align_up(at); }
};

// Memory laid out by a Cursor: the buffer at an offset, as the type it holds.
struct LaidOut {
  void* base;
  template <class T>
  T* as(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};

}  // namespace gemmfuse::cuda
