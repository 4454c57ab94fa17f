// fp32 attention on fp16 tensor cores, forward (issue 48, item 3):
//   O = softmax(Q Kᵀ · scale [+ mask] [+ causal mask]) V,  LSE = log Σ_j exp(s_ij)
// for Q fp32 [BH, Sq, D] and K, V fp32 [BH, Sk, D] (D = 64, 96 or 128), each of the two products
// on split fp16 parts as the f16x3 GEMM computes one (gemm_f16x3.h): Q's and K's rows and V's
// columns scaled by a power of two and split into a high part and a low part 2^11 larger, the
// product hi·hi + 2^-11 (hi·lo + lo·hi) in fp32; P (in [0, 1]) split without a scale. The
// softmax is FlashAttention-2's online one in fp32, each CTA 64 query rows over tiles of 64
// keys, so no [Sq, Sk] matrix exists. bench/micro/attention_split_study.py: this method's error
// against float64 stays within 1–3% of 3xTF32's (eager fp32 SDPA's on an H100). Heads holding
// a NaN or an infinity, or magnitudes outside the splits' range, are recomputed in plain fp32
// (attention_nonfinite.h). An additive mask (AttentionMask) or the causal one (PyTorch's:
// key j masked after query i, j > i, whatever Sq and Sk are). Not carried: dropout. The
// backward (attention_f16x3_backward.cu) takes the same head dims.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gemmfuse::cuda {

#ifdef __CUDACC__
#define GF_ATTENTION_HD __host__ __device__
#else
#define GF_ATTENTION_HD
#endif

// An additive mask on the scores [B, H, Sq, Sk] (PyTorch's float attn_mask; a boolean one as 0 / −inf):
// element (b, h, i, j) of bh = b·heads + h at data[b·sb + h·sh + i·si + j·sj] (a broadcast
// dim has stride 0), or none (null data). A query row whose every score is masked comes out
// 0 with LSE +inf (so the backward's P is 0 there), as PyTorch's kernels give it.
struct AttentionMask {
  const float* data = nullptr;
  int64_t heads = 1, sb = 0, sh = 0, si = 0, sj = 0;
  GF_ATTENTION_HD const float* row(int64_t bh, int64_t i) const {
    return data + (bh / heads) * sb + (bh % heads) * sh + i * si;
  }
};

struct AttentionF16x3 {
  int64_t BH = 0;              // batch x heads
  int64_t Sq = 0, Sk = 0;      // queries; keys and values
  int D = 0;                   // head dim: 64, 96 or 128
  const float* q = nullptr;    // [BH, Sq, D], contiguous
  const float* k = nullptr;    // [BH, Sk, D], contiguous, as v
  const float* v = nullptr;
  float* o = nullptr;          // [BH, Sq, D]
  float* lse = nullptr;        // [BH, Sq] (natural log), or null
  float scale = 0.f;           // the scores' scale (PyTorch's default: D^-1/2)
  bool causal = false;
  AttentionMask mask;          // none by default
  void* workspace = nullptr;   // attention_f16x3_workspace_bytes(BH, Sq, Sk, D) bytes
};

// Whether the kernel takes this head dim (null) or why not.
const char* attention_f16x3_unfit(int D);
// Whether the kernel runs on this device (null) or why not: mma.sync m16n8k16 needs compute
// capability 8.0, and the kernels' shared memory must fit the device's per-block limit.
const char* attention_f16x3_device_unfit(int D, int device);
const char* attention_f16x3_backward_device_unfit(int D, int device);
// The rule both apply, for `shared_bytes` of shared memory per block.
const char* attention_device_unfit(int shared_bytes, int device);
size_t attention_f16x3_workspace_bytes(int64_t BH, int64_t Sq, int64_t Sk, int D);
// Enqueues the splits and the attention kernel on `stream`.
void launch_attention_f16x3(const AttentionF16x3& a, cudaStream_t stream);

// The backward: dQ, dK, dV from dO, the forward's O and LSE (PyTorch's memory-efficient
// attention's too: the same log Σ exp of the scaled scores).
struct AttentionF16x3Backward {
  int64_t BH = 0;
  int64_t Sq = 0, Sk = 0;         // queries; keys and values
  int D = 0;                      // 64, 96 or 128
  const float* q = nullptr;       // [BH, Sq, D], contiguous, as dout, o, dq; k, v, dk, dv [BH, Sk, D]
  const float* k = nullptr;
  const float* v = nullptr;
  const float* o = nullptr;
  const float* dout = nullptr;
  const float* lse = nullptr;     // [BH, lse_stride], the first Sq of each row read
  int64_t lse_stride = 0;
  float* dq = nullptr;            // zeroed, then accumulated (atomics)
  float* dk = nullptr;
  float* dv = nullptr;
  float scale = 0.f;
  bool causal = false;
  AttentionMask mask;             // the forward's
  void* workspace = nullptr;      // attention_f16x3_backward_workspace_bytes(BH, Sq, Sk, D) bytes
};

const char* attention_f16x3_backward_unfit(int D);
size_t attention_f16x3_backward_workspace_bytes(int64_t BH, int64_t Sq, int64_t Sk, int D);
void launch_attention_f16x3_backward(const AttentionF16x3Backward& a, cudaStream_t stream);

}  // namespace gemmfuse::cuda
