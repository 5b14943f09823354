// Launching the fused sm90 GEMMs of the sharded cross-entropy (included by sharded_ce_fused.cu,
// after the epilogue). A call walks many chunks of the same shape: the kernel's parameters (its
// two TMA descriptors, the tile scheduler's, the epilogue's) are built once per call and chunk
// shape; a chunk of that shape then only points the weight's descriptor at its rows
// (cuTensorMapReplaceAddress) and sets the epilogue's per-chunk fields. The shared-memory
// attribute is set once per kernel and device. Each direction has a kernel entry of its own name,
// so that a profiler trace says which ran.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <memory>
#include <mutex>
#include <vector>

#include "sharded_ce_fused_epilogue.cuh"

namespace shardkit {
namespace sce {
namespace fused {

// One fused GEMM's launch state for a call (held by its Scratch).
class GemmLaunch {
 public:
  virtual ~GemmLaunch() = default;
  // Launches the GEMM of x [B, D] and the chunk wc [n, D] with the epilogue's parameters p;
  // `pdl`: as a programmatic dependent of the previous kernel on `stream`.
  virtual void run(const at::Tensor& x, const at::Tensor& wc, const EpiParams& p, bool pdl,
                   cudaStream_t stream) = 0;
};

namespace {

static_assert(kTileM == kRowsPerTile && kTileN == kColsPerTile, "the chunk sizes assume the tiles' shape");

template <class Elem, bool kBackward>
struct FusedGemm {
  using Mainloop = FusedMainloop<Elem>;
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SceEpilogue<kBackward, Elem>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 232448,
                "the kernel's shared memory exceeds an sm90 SM's");
};

// The kernel entries, as cutlass::device_kernel but named for what they run.
#define SHARDKIT_FUSED_GEMM_ENTRY(name)                                                         \
  template <class K>                                                                            \
  __global__ __launch_bounds__(K::MaxThreadsPerBlock, K::MinBlocksPerMultiprocessor) void name( \
      CUTLASS_GRID_CONSTANT typename K::Params const params) {                                  \
    extern __shared__ char smem[];                                                              \
    K op;                                                                                       \
    op(params, smem);                                                                           \
  }
SHARDKIT_FUSED_GEMM_ENTRY(sce_forward_gemm_128x256_cooperative)
SHARDKIT_FUSED_GEMM_ENTRY(sce_backward_gemm_128x256_cooperative)
#undef SHARDKIT_FUSED_GEMM_ENTRY

// (Only the entry of this kernel is instantiated: one kernel per direction and dtype.)
template <class K, bool kBackward>
constexpr auto gemm_entry() {
  if constexpr (kBackward)
    return &sce_backward_gemm_128x256_cooperative<K>;
  else
    return &sce_forward_gemm_128x256_cooperative<K>;
}

using ReplaceAddressFn = CUresult (*)(CUtensorMap*, void*);

// The driver's cuTensorMapReplaceAddress (through the runtime, as CUTLASS reaches the driver's
// cuTensorMapEncodeTiled: no link to libcuda); nullptr where it is missing.
ReplaceAddressFn replace_address_fn() {
  static const ReplaceAddressFn fn = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if __CUDACC_VER_MAJOR__ > 12
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &pfn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapReplaceAddress", &pfn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return ReplaceAddressFn(nullptr);
    }
    return reinterpret_cast<ReplaceAddressFn>(pfn);
  }();
  return fn;
}

template <class Elem, bool kBackward>
class GemmLaunchAs final : public GemmLaunch {
  using Kernel = typename FusedGemm<Elem, kBackward>::Kernel;

 public:
  void run(const at::Tensor& x, const at::Tensor& wc, const EpiParams& p, bool pdl,
           cudaStream_t stream) override {
    const int64_t n = wc.size(0);
    const ReplaceAddressFn replace = replace_address_fn();
    if (n != n_ || x.const_data_ptr() != a_ || replace == nullptr) {
      build(x, wc, p, stream);
    } else {
      auto* desc = const_cast<CUtensorMap*>(
          reinterpret_cast<const CUtensorMap*>(params_.mainloop.tma_load_b.get_tma_descriptor()));
      TORCH_CHECK(replace(desc, const_cast<void*>(wc.const_data_ptr())) == CUDA_SUCCESS,
                  "shardkit: the fused sharded cross-entropy kernel could not address the weight chunk at ",
                  wc.const_data_ptr());
      params_.epilogue.p = p;
    }
    const auto entry = gemm_entry<Kernel, kBackward>();
    const int smem = Kernel::SharedStorageSize;
    allow_smem(reinterpret_cast<const void*>(entry), smem, x.get_device());
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = Kernel::get_grid_shape(params_);
    cfg.blockDim = Kernel::get_block_shape();
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    const cudaError_t err = cudaLaunchKernelEx(&cfg, entry, params_);
    TORCH_CHECK(err == cudaSuccess, "shardkit: the fused sharded cross-entropy kernel failed to launch: ",
                cudaGetErrorString(err));
  }

 private:
  // The parameters of the GEMM of x and a chunk of wc's shape (both descriptors encoded anew).
  void build(const at::Tensor& x, const at::Tensor& wc, const EpiParams& p, cudaStream_t stream) {
    const int M = static_cast<int>(x.size(0)), N = static_cast<int>(wc.size(0)),
              K = static_cast<int>(x.size(1));
    using Mainloop = typename FusedGemm<Elem, kBackward>::Mainloop;
    typename Mainloop::StrideA sa = make_stride(static_cast<int64_t>(K), Int<1>{}, static_cast<int64_t>(0));
    typename Mainloop::StrideB sb = make_stride(static_cast<int64_t>(K), Int<1>{}, static_cast<int64_t>(0));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = x.get_device();
    hw.sm_count = at::cuda::getDeviceProperties(x.get_device())->multiProcessorCount;
    typename Kernel::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                    {M, N, K, 1},
                                    {reinterpret_cast<const Elem*>(x.const_data_ptr()), sa,
                                     reinterpret_cast<const Elem*>(wc.const_data_ptr()), sb},
                                    {p},
                                    hw};
    TORCH_CHECK(Kernel::can_implement(args),
                "shardkit: the fused sharded cross-entropy kernel cannot run on x ", x.sizes(),
                " and w chunk ", wc.sizes(), " (set SHARDKIT_FUSED=0)");
    // The persistent data-parallel tile scheduler needs no workspace (no split-K, no stream-K).
    TORCH_INTERNAL_ASSERT(Kernel::get_workspace_size(args) == 0, "the fused GEMM asks for a workspace");
    TORCH_INTERNAL_ASSERT(Kernel::initialize_workspace(args, nullptr, stream) == cutlass::Status::kSuccess);
    params_ = Kernel::to_underlying_arguments(args, nullptr);
    n_ = wc.size(0);
    a_ = x.const_data_ptr();
  }

  // The kernel's dynamic shared memory above the 48 KiB default, once per device.
  static void allow_smem(const void* entry, int smem, int device) {
    static std::mutex mu;
    static std::vector<char> done;
    const std::lock_guard<std::mutex> lock(mu);
    if (done.size() <= static_cast<size_t>(device)) done.resize(device + 1, 0);
    if (done[device]) return;
    if (smem >= (48 << 10))
      C10_CUDA_CHECK(cudaFuncSetAttribute(entry, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    done[device] = 1;
  }

  typename Kernel::Params params_;
  int64_t n_ = -1;
  const void* a_ = nullptr;
};

template <class Elem, bool kBackward>
std::unique_ptr<GemmLaunch> make_gemm_launch() {
  return std::make_unique<GemmLaunchAs<Elem, kBackward>>();
}

}  // namespace
}  // namespace fused
}  // namespace sce
}  // namespace shardkit
