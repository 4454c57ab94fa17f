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

  // Inference tensors have no version counter: a result built from one is never reused.
  bool trusted() const { return version_ >= 0; }

  // Whether t is (still) the tensor this identity was taken of; no copies, no refcounting
  // (runs on every call for the prepared-weights check).
  bool matches(const at::Tensor& t) const {
    return version_ >= 0 && !t.is_inference() &&
           storage_._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
           offset_ == t.storage_offset() && version_ == static_cast<int64_t>(t._version()) &&
           dtype_ == t.scalar_type() && t.sizes() == at::IntArrayRef(sizes_) &&
           t.strides() == at::IntArrayRef(strides_);
  }

  bool operator==(const TensorIdentity& o) const {
    return storage_._unsafe_get_target() == o.storage_._unsafe_get_target() &&
           offset_ == o.offset_ && version_ == o.version_ && dtype_ == o.dtype_ &&
           sizes_ == o.sizes_ && strides_ == o.strides_;
  }
  bool operator!=(const TensorIdentity& o) const { return !(*this == o); }

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_;
  int64_t offset_;
  c10::SmallVector<int64_t, 4> sizes_, strides_;
  at::ScalarType dtype_;
  int64_t version_;
};

}  // namespace gemmfuse::bindings
