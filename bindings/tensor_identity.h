// Which tensor contents a cached result was built from. The data pointer alone is not enough:
// PyTorch's allocators hand a freed block to the next tensor of that size, and a fresh tensor
// starts at the same version, so (pointer, version) can name a different tensor (seen: a new
// weight at a freed weight's address got the old weight's prepared column sums).
// The identity is the storage object, held weakly — its address then cannot be reused by
// another storage while the identity lives — plus the view of it (offset, sizes, strides,
// dtype) and the autograd version counter, which every in-place write bumps.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

namespace gemmfuse::bindings {

class TensorIdentity {
 public:
  explicit TensorIdentity(const at::Tensor& t)
      : storage_(t.storage().getWeakStorageImpl()),
        offset_(t.storage_offset()),
        sizes_(t.sizes().begin(), t.sizes().end()),
        strides_(t.strides().begin(), t.strides().end()),
        dtype_(t.scalar_type()),
        version_(t.is_inference() ? -1 : static_cast<int64_t>(t._version())) {}

  // Whether t is (still) the tensor this identity was taken of; no copies, no refcounting
  // (runs on every call). Inference tensors have no version counter: an identity involving
  // one never matches, so a result built from one is never reused.
  bool matches(const at::Tensor& t) const {
    return version_ >= 0 && !t.is_inference() &&
           storage_._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
           offset_ == t.storage_offset() && version_ == static_cast<int64_t>(t._version()) &&
           dtype_ == t.scalar_type() && t.sizes() == at::IntArrayRef(sizes_) &&
           t.strides() == at::IntArrayRef(strides_);
  }

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_;
  int64_t offset_;
  c10::SmallVector<int64_t, 4> sizes_, strides_;
  at::ScalarType dtype_;
  int64_t version_;
};

}  // namespace gemmfuse::bindings
