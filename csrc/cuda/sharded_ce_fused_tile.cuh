// The tiles of the fused sm90 kernels (sharded_ce_fused.cu): the CUTLASS mainloops (TMA loads,
// warpgroup MMA, persistent; cooperative: two consumer warpgroups share a 128-row tile, the
// default; ping-pong: each consumer warpgroup has its own 64-row tile, one's epilogue running
// under the other's MMAs) and the (row slots, columns) view of a thread's accumulators that the
// epilogue uses. Host code can include it too (tests/native/fused_layout_check.cu checks that
// view without a GPU).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/numeric_types.h>

namespace shardkit {
namespace sce {
namespace fused {

constexpr int kTileN = 256, kTileK = 64;

// Rows of a tile: 128 (cooperative) or 64 (ping-pong).
template <bool kPingpong>
constexpr int kTileM = kPingpong ? 64 : 128;

// x [M, K] row-major times the chunk [N, K] row-major (both K-major), fp32 accumulation.
template <class Elem, bool kPingpong>
using FusedMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::ColumnMajor, 8, float,
    cute::Shape<cute::Int<kTileM<kPingpong>>, cute::Int<kTileN>, cute::Int<kTileK>>,
    cute::Shape<cute::_1, cute::_1, cute::_1>, cutlass::gemm::collective::StageCountAuto,
    cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                        cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;

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
