// A tile scheduler for GEMMs whose row count a kernel before them decides: CUTLASS's sm90
// persistent scheduler, launched for the most rows the GEMM may have, runs only the tiles of
// the first *rows rows, *rows read on the device when the kernel starts. fp32's second level
// (split.h) uses it: how many rows hold tiny values is known only once x has been split, and
// the forward pass never waits on the host.
//
// How: tiles go in N-fastest order (raster along N, no swizzle), so the tiles of the first
// rows come first in the scheduler's linear order, and lowering its tile count
// (blocks_per_problem_) to those rows' clusters leaves the rest of it as CUTLASS wrote it.
// GemmUniversal picks it by the tag CountedRows (the TileSchedulerSelector below).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace gemmfuse::cuda::sm90 {

struct CountedRows {};  // GemmUniversal's tile scheduler tag

class CountedRowsScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int* rows = nullptr;  // device: the rows to compute (clamped to [0, M])
  };
  struct Params : Base::Params {
    const int* rows = nullptr;
    uint32_t cluster_rows = 0;  // rows a cluster's tiles cover
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Base::Arguments order = args;  // the order the count relies on
    order.raster_order = RasterOrderOptions::AlongN;
    order.max_swizzle_size = 1;
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        problem, tile, cluster, hw_info, order, workspace, epilogue_subtile, ktile_start_alignment_count);
    p.rows = args.rows;
    p.cluster_rows = static_cast<uint32_t>(cute::size<0>(tile) * cute::size<0>(cluster));
    return p;
  }

  static bool can_implement(Arguments const& args) {
    return args.rows != nullptr && Base::can_implement(args);
  }

  CUTLASS_DEVICE explicit CountedRowsScheduler(Params const& params) : Base(counted(params)) {}

 private:
  // The scheduler's parameters cut to the tiles of the first *rows rows. It waits for the
  // grid before (programmatic launch: the count is that grid's output); every thread reads
  // the same count, so every CTA of a cluster sees the same tiles. Then it lets the next
  // grid be scheduled (it waits for this one to complete): with no rows, the common case,
  // its launch overlaps this grid's exit instead of following it.
  static CUTLASS_DEVICE Base::Params counted(Params const& params) {
    cutlass::arch::wait_on_dependent_grids();
    const int count = *params.rows;
    cutlass::arch::launch_dependent_grids();
    Base::Params cut = params;
    const uint64_t rows = static_cast<uint64_t>(max(count, 0));
    const uint64_t clusters_m = (rows + params.cluster_rows - 1) / params.cluster_rows;
    const uint64_t blocks =
        clusters_m * params.cluster_shape_m_ * params.problem_tiles_n_ * params.cluster_shape_n_;
    if (blocks < cut.blocks_per_problem_) cut.blocks_per_problem_ = blocks;
    return cut;
  }
};

}  // namespace gemmfuse::cuda::sm90

namespace cutlass::gemm::kernel::detail {

template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<gemmfuse::cuda::sm90::CountedRows, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = gemmfuse::cuda::sm90::CountedRowsScheduler;
};

}  // namespace cutlass::gemm::kernel::detail
