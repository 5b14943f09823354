// Host-only check of the fused kernels' view of a thread's accumulators (no GPU needed):
// builds the mainloop's TiledMma, and for every consumer thread checks what the epilogue of
// csrc/cuda/sharded_ce_fused.cu assumes of rowcol(): a row slot holds one row over all its
// columns, a column index one column over all row slots, columns 2k and 2k+1 are adjacent,
// the four threads of a quad hold the same rows, pair k of quad lane q starts at column
// 8k + 2q, and the threads cover the tile exactly once; for bf16 and fp16.
// Prints "fused layout OK" and exits 0, or names the first broken assumption and exits 1.
#include <cstdio>
#include <vector>

#include "cuda/sharded_ce_fused_tile.cuh"

using namespace cute;
using namespace shardkit::sce::fused;

template <class Elem>
int check(const char* name) {
  using TiledMma = typename FusedMainloop<Elem>::TiledMma;
  constexpr int kTileRows = kTileM;
  TiledMma mma;
  const int threads = size(mma);
  std::vector<int> seen(kTileRows * kTileN, 0);
  std::vector<std::vector<int>> rows_of(threads);
  for (int t = 0; t < threads; ++t) {
    auto thr = mma.get_thread_slice(t);
    Tensor crd = thr.partition_C(make_identity_tensor(make_shape(Int<kTileRows>{}, Int<kTileN>{})));
    Tensor acc = partition_fragment_C(mma, make_shape(Int<kTileRows>{}, Int<kTileN>{}));
    if (size(acc) != size(crd)) {
      std::printf("%s: thread %d holds %d accumulators but %d coordinates\n", name, t, int(size(acc)),
                  int(size(crd)));
      return 1;
    }
    Tensor pos = make_tensor(crd.data(), rowcol(crd.layout()));
    const int R = size<0>(pos), J = size<1>(pos);
    if (int(size<0>(rowcol(acc.layout()))) != R || int(size<1>(rowcol(acc.layout()))) != J || J % 2) {
      std::printf("%s: the accumulator and coordinate views differ in shape (R=%d, J=%d)\n", name, R, J);
      return 1;
    }
    for (int ri = 0; ri < R; ++ri) {
      rows_of[t].push_back(int(get<0>(pos(ri, 0))));
      for (int j = 0; j < J; ++j) {
        const int r = get<0>(pos(ri, j)), c = get<1>(pos(ri, j));
        if (r != get<0>(pos(ri, 0)) || c != get<1>(pos(0, j))) {
          std::printf("%s: thread %d, slot (%d, %d) is at (%d, %d), off its row or column\n", name, t, ri, j,
                      r, c);
          return 1;
        }
        if (j % 2 == 1 && c != get<1>(pos(ri, j - 1)) + 1) {
          std::printf("%s: thread %d, columns %d and %d are not adjacent\n", name, t, j - 1, j);
          return 1;
        }
        // The backward's 16-byte stores: pair j / 2 of the thread with quad lane q starts at
        // column 8 (j / 2) + 2q, so the quad's pairs of 4 consecutive pairs are 32 adjacent columns.
        if (j % 2 == 0 && c != 4 * j + 2 * (t & 3)) {
          std::printf("%s: thread %d, pair %d starts at column %d, not %d\n", name, t, j / 2, c,
                      4 * j + 2 * (t & 3));
          return 1;
        }
        seen[r * kTileN + c] += 1;
      }
    }
  }
  for (int t = 0; t < threads; ++t) {
    if (rows_of[t] != rows_of[t ^ 1] || rows_of[t] != rows_of[t ^ 2]) {
      std::printf("%s: threads %d, %d and %d do not hold the same rows\n", name, t, t ^ 1, t ^ 2);
      return 1;
    }
  }
  for (int k = 0; k < kTileRows * kTileN; ++k) {
    if (seen[k] != 1) {
      std::printf("%s: tile element (%d, %d) is held %d times\n", name, k / kTileN, k % kTileN, seen[k]);
      return 1;
    }
  }
  std::printf("%s: %d threads, each %d row slots x %d columns: fused layout OK\n", name, threads,
              int(rows_of[0].size()), kTileRows * kTileN / threads / int(rows_of[0].size()));
  return 0;
}

int main() {
  return check<cutlass::bfloat16_t>("bf16 cooperative") | check<cutlass::half_t>("fp16 cooperative");
}
