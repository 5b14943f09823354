// shardkit's chunked multi-tensor launcher: applies one device functor to many tensors
// (lists of kDepth aligned tensor lists, e.g. {ema, model}) with a few kernel launches.
//
// Every tensor is cut into chunks of kChunkSize elements and every CUDA block handles one
// (tensor, chunk). The tensor addresses and sizes of one launch travel by value in the
// kernel's parameter block (kept under the classic 4 KB limit), so no host-to-device copy
// and no synchronization is needed; a block finds its tensor by binary search over the
// per-tensor first-block offsets. A launch takes at most Caps<kDepth>::kMaxTensors
// tensors (any number of chunks each); more tensors take more launches, all on the
// current stream.
//
// A functor has the signature
//   __device__ void operator()(void* const* base /* kDepth tensor base pointers */,
//                              int64_t offset /* first element of this chunk */,
//                              int64_t n /* elements in this chunk */) const;
// and is passed by value, so it can carry scalars (e.g. the EMA weight).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <vector>

namespace shardkit {
namespace mt {

constexpr int64_t kChunkSize = 65536;  // elements per block; tests straddle multiples of it
constexpr int kBlockSize = 512;

template <int kDepth>
struct Caps;
template <>
struct Caps<2> {
  static constexpr int kMaxTensors = 96;  // tests cross this per-launch cap
};

template <int kDepth>
struct TensorListMeta {
  void* addr[kDepth][Caps<kDepth>::kMaxTensors];
  int64_t numel[Caps<kDepth>::kMaxTensors];
  // block_start[t] = first block of tensor t in this launch; block_start[count] = total.
  int32_t block_start[Caps<kDepth>::kMaxTensors + 1];
  int32_t count;
};
static_assert(sizeof(TensorListMeta<2>) + 64 <= 4096, "kernel parameters must stay under 4 KB");

template <int kDepth, typename Op>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_kernel(TensorListMeta<kDepth> meta, Op op) {
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  // Largest t with block_start[t] <= block.
  int lo = 0;
  int hi = meta.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int t = lo;
  const int64_t chunk = block - meta.block_start[t];
  const int64_t offset = chunk * kChunkSize;
  const int64_t remaining = meta.numel[t] - offset;
  const int64_t n = remaining < kChunkSize ? remaining : kChunkSize;
  void* ptrs[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) ptrs[d] = meta.addr[d][t];
  op(ptrs, offset, n);
}

// The tensors of one call: lists[d][i] is tensor i of list d. Every list has the same
// length and tensor i has the same numel() in every list (checked by the caller); empty
// tensors are skipped. Launches on the current stream of the current device.
template <int kDepth, typename Op>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, const Op& op) {
  TORCH_INTERNAL_ASSERT(lists.size() == kDepth, "multi_tensor_apply: wrong number of lists");
  constexpr int kMaxTensors = Caps<kDepth>::kMaxTensors;
  // A launch's grid must fit an int32 block index: cap the blocks of one launch too.
  constexpr int64_t kMaxBlocks = int64_t{1} << 30;
  const size_t n_tensors = lists[0].size();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  TensorListMeta<kDepth> meta;
  meta.count = 0;
  int64_t blocks = 0;
  auto launch = [&]() {
    if (meta.count == 0) return;
    meta.block_start[meta.count] = static_cast<int32_t>(blocks);
    multi_tensor_kernel<kDepth, Op><<<static_cast<unsigned>(blocks), kBlockSize, 0, stream>>>(meta, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.count = 0;
    blocks = 0;
  };

  for (size_t i = 0; i < n_tensors; ++i) {
    const int64_t numel = lists[0][i].numel();
    if (numel == 0) continue;
    int64_t first_chunk = 0;
    const int64_t n_chunks = (numel + kChunkSize - 1) / kChunkSize;
    while (first_chunk < n_chunks) {
      if (meta.count == kMaxTensors || blocks >= kMaxBlocks) launch();
      // A tensor whose chunks do not all fit into this launch continues in the next one:
      // it is re-entered with its base address advanced past the chunks already done.
      const int64_t take = std::min(n_chunks - first_chunk, kMaxBlocks - blocks);
      const int c = meta.count;
      for (int d = 0; d < kDepth; ++d) {
        const at::Tensor& x = lists[d][i];
        meta.addr[d][c] = static_cast<char*>(x.data_ptr()) + first_chunk * kChunkSize * x.element_size();
      }
      meta.numel[c] = numel - first_chunk * kChunkSize;
      meta.block_start[c] = static_cast<int32_t>(blocks);
      meta.count = c + 1;
      blocks += take;
      first_chunk += take;
    }
  }
  launch();
}

}  // namespace mt
}  // namespace shardkit
