// Elementwise kernels split their work into fixed chunks across OpenMP threads; each element's
// result does not depend on the split, so any thread count gives the same bits.
#pragma once
#include <cstdint>

namespace sckpt {

constexpr int64_t kChunk = 16384;

// Calls f(begin, length) for consecutive chunks of [0, n), in parallel when there is more than one.
template <class F>
void for_chunks(int64_t n, F&& f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    f(begin, (n - begin) < kChunk ? n - begin : kChunk);
  }
}

}  // namespace sckpt
