// The tiles of the fused sm90 kernels (sharded_ce_fused.cu): the CUTLASS mainloop (TMA loads,
// warpgroup MMA, persistent, cooperative: two consumer warpgroups share a [128, 256] tile; it
// measured faster than ping-pong on [128, 128] tiles, benchmarks/RESULTS.md, 2026-11-27) and the
// (row slots, columns) view of a thread's accumulators
// that the epilogue uses. Host code can include it too (tests/native/fused_layout_check.cu
// checks that view without a GPU).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/numeric_types.h>

namespace shardkit {
namespace sce {
namespace fused {

// The rows, columns and depth of every tile.
constexpr int kTileM = 128, kTileN = 256, kTileK = 64;

// The epilogue's shared memory (a tile's column scales), left out of the mainloop's stages.
constexpr int kEpilogueSmem = kTileN * 4;

// x [M, K] row-major times the chunk [N, K] row-major (both K-major), fp32 accumulation.
template <class Elem>
using FusedMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::ColumnMajor, 8, float,
    cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>,
    cute::Shape<cute::_1, cute::_1, cute::_1>,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

// A thread's accumulator fragment, ((2 columns, 2 rows, column groups), MMA_M, MMA_N) for
// Hopper's warpgroup MMA, seen as (row slots, columns): rows (the 2-row mode, MMA_M), columns
// (the 2-column mode, the column groups, MMA_N).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout l) {
  using namespace cute;
  static_assert(decltype(rank(l))::value == 3 && decltype(rank<0>(l))::value == 3,
                "a Hopper warpgroup-MMA accumulator layout was expected");
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

}  // namespace fused
}  // namespace sce
}  // namespace shardkit
